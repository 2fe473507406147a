"""The batched scheduling step of :meth:`kvblocks.core.manager.KVCacheManager.step`: one call per running
sequence's append, commit and growth, validated as a batch before anything changes."""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from kvblocks.core.sequence import _count_arg, _Sequence
from kvblocks.errors import InvalidArgumentError, SequenceStateError
from kvblocks.hashing import PrecomputedHashes, pack_tokens

__all__ = ["commit_checked", "run_step"]

_MAX_TOKEN = 0xFFFFFFFF  # what array("I") holds
_MAX_COUNT = 1 << 60
"""The largest token count the step computes with: no sequence gets near it, and sums of three such counts fit a
signed 64-bit integer (what the compiled build's step counts in, kvblocks/core/step.pxd)."""


def run_step(
    manager: Any,
    seq_ids: Sequence[Hashable],
    num_computed_tokens: Sequence[int | None] | None,
    new_token_ids: Sequence[Iterable[int] | None] | None,
    num_new_tokens: int | Sequence[int],
    num_lookahead_tokens: int | Sequence[int],
) -> list[Hashable]:
    """One scheduling step for running sequences; returns the ids that could not get their slots.

    For each sequence ``seq_ids[i]``, in order: append ``new_token_ids[i]`` (the sampled token,
    or the accepted drafts and the bonus token), commit ``num_computed_tokens[i]`` (what the
    forward pass wrote, accepted drafts included; None keeps the last commit), then give it
    slots for the next forward pass: ``num_new_tokens[i]`` tokens after its committed line (1
    for decode, the next chunk for chunked prefill) plus ``num_lookahead_tokens[i]`` draft
    slots. ``allocate`` counts from its covered slots; ``step`` counts from the committed
    line, as an engine reasons::

        block size 4, decode, one draft slot (k=1)
        before      | a b c d | e f . . |        committed 6, known 6
        step(["r"], [6], [[g]], 1, 1)            g appended: 7 known
        after       | a b c d | e f g * |        slots for 7 + 1 draft; 6 committed

    A sequence that cannot get its slots is returned, and nothing changed for it (its entry
    may be sent again, e.g. after preempting another sequence). Bad input anywhere in the batch
    raises before anything changes. Same rules, same results as the per-sequence calls.
    """
    if type(seq_ids) is not list and type(seq_ids) is not tuple:
        seq_ids = list(seq_ids)  # indexed below
    count = len(seq_ids)
    commits = _column(num_computed_tokens, count, "num_computed_tokens", None)
    news = _column(num_new_tokens, count, "num_new_tokens", 1)
    drafts = _column(num_lookahead_tokens, count, "num_lookahead_tokens", 0)
    appends: Sequence[Iterable[int] | None] = (None,) * count if new_token_ids is None else new_token_ids
    if type(appends) is not list and type(appends) is not tuple:
        appends = list(appends)  # indexed below
    if len(appends) != count:
        raise InvalidArgumentError(f"new_token_ids has {len(appends)} entries for {count} sequences")
    seqs = manager._seqs
    try:
        batch = [seqs[seq_id] for seq_id in seq_ids]
    except (KeyError, TypeError):
        for seq_id in seq_ids:
            manager._get(seq_id)  # raises the precise error
        raise  # pragma: no cover - one of them raised
    if count > 1:  # each sequence is marked with this step's number; one marked already appears twice
        mark = manager._step_marks = manager._step_marks + 1
        for s in batch:
            if s.step_mark == mark:
                raise InvalidArgumentError("a sequence appears twice in one step")
            s.step_mark = mark
    hooked = manager._guards_changes
    # 1. validate every entry: nothing changes unless the whole batch is sound; each sequence keeps its plan
    for i in range(count):
        seq_id, s, n_arg, tokens, new_arg, k_arg = seq_ids[i], batch[i], commits[i], appends[i], news[i], drafts[i]
        packed: Sequence[int] | int | None = None
        appended = 0
        if tokens is not None:
            if type(tokens) is tuple or type(tokens) is list:  # the common shapes, packed in C
                if len(tokens) == 1 and type(tokens[0]) is int and 0 <= tokens[0] <= _MAX_TOKEN:
                    packed = tokens[0]  # one sound token (a decode step): appended as it is
                else:
                    try:
                        packed = array("I", tokens)
                    except (OverflowError, TypeError):
                        packed = pack_tokens(tokens)  # raises, naming the bad position
            else:
                packed = pack_tokens(tokens)
            appended = 1 if type(packed) is int else len(packed)  # type: ignore[arg-type]
            if not appended:
                packed = None
            elif type(s.content) is PrecomputedHashes:
                raise SequenceStateError(f"sequence {seq_id!r} was registered by block hashes; no tokens")
        committed = s.num_committed
        if n_arg is None:
            n = committed
        else:
            if type(n_arg) is not int:
                n_arg = _count_arg(n_arg, "num_computed_tokens")
            if not 0 <= n_arg <= _MAX_COUNT:  # outside [committed, allocated] whatever the sequence: refused
                manager._check_commit(seq_id, s, n_arg, appended)
            n = n_arg
        slots = s.num_covered
        if (
            hooked
            or s.table is None
            or not committed <= n <= slots + s.lookahead
            or n > s.content.num_tokens + appended
        ):
            manager._check_commit(seq_id, s, n, appended)
        # counts past _MAX_COUNT cannot get their slots either way: taken as _MAX_COUNT, they fail to grow
        new = min(
            new_arg if type(new_arg) is int and new_arg >= 0 else _count_arg(new_arg, "num_new_tokens"), _MAX_COUNT
        )
        k = min(k_arg if type(k_arg) is int and k_arg >= 0 else _count_arg(k_arg, "num_lookahead_tokens"), _MAX_COUNT)
        covered = n + new
        s.step_commit = n
        s.step_tokens = packed
        s.step_cover = covered if covered > slots else slots
        s.step_lookahead = k
    # 2. apply, sequence by sequence; one that cannot get its slots is left as it was
    failed: list[Hashable] = []
    size = manager._block_size
    groups = manager._groups
    # When no local group keeps tables beside the full group's, a sequence's room is the pool's free supply and a
    # decoding sequence's next block is the full group's: both asked here (the coordinator's room_to_grow and
    # grow, for their commonest case; every other growth goes through the coordinator).
    full = groups.full
    pool = full.pool if not groups.locals else None
    for i in range(count):
        s = batch[i]
        n, packed, covered, k = s.step_commit, s.step_tokens, s.step_cover, s.step_lookahead
        s.step_tokens = None  # the plan keeps no token run past its step
        need = (covered + k + size - 1) // size - len(s.table)
        if need > 0 and not (
            need <= len(pool._fresh) + len(pool._idle) if pool is not None else groups.room_to_grow(s, need)
        ):
            failed.append(seq_ids[i])  # nothing changed for it
            continue
        committed = s.num_committed
        content = s.content
        if packed is not None:
            hashed = content  # tokens were refused above for a sequence given by block hashes: a HashedTokens
            known = hashed.num_tokens
            if type(packed) is int:
                hashed.append_token(packed)
            else:
                hashed.extend_packed(packed)
        if n != committed:
            if n // size == committed // size and n <= s.num_covered and n < s.watch:
                s.num_committed = n  # no block newly full, nothing watched: nothing enters the tree
            else:
                first = committed // size
                if n // size == first + 1 and content.hashes[first] not in full.tree._block_of:
                    pinned = 0  # a decode's one block, cached by nobody (package-private: the tree's index)
                else:
                    pinned = full.idle_duplicates(s, first, n // size)
                if pinned and max(need, 0) + pinned > full.pool.num_free:  # its commit would take the room
                    if packed is not None:
                        content.truncate(known)
                    failed.append(seq_ids[i])  # nothing changed for it
                    continue
                commit_checked(manager, s, n)
        if not need:  # the common case: the table already has the slots
            s.num_covered = covered
            s.lookahead = k
        else:
            covered = max(covered, s.num_covered)
            if need == 1 and pool is not None:  # package-private, as the coordinator's grow
                s.table.append(pool.take_fresh(1)[0] if pool._fresh else full.take(1)[0])
                s.num_covered = covered
                s.lookahead = k
            else:
                groups.grow(s, covered, k, True)  # fits: checked above, pins included
    return failed


def commit_checked(manager: Any, s: _Sequence, n: int) -> None:
    """Commit a checked ``n`` for admitted ``s`` (the manager's ``commit``, its step and its tiers' loads): blocks
    newly below the line enter every group's index. Blocks fully below the old line are already in the tree
    (inserted, hit or pinned); those newly below the new line go in now."""
    size = manager._block_size
    before = s.num_committed
    start = before // size
    stop = n // size
    cache = stop > start and manager._caching
    if cache:
        manager._full.cache(s, start, stop)
    s.num_committed = n
    if n > s.num_covered:  # accepted drafts, committed in lookahead slots: they are allocated tokens now
        s.lookahead -= n - s.num_covered
        s.num_covered = n
    groups = manager._beside
    if groups is not None:
        s.watch = groups.committed(id(s), s.content.hashes, before, n, cache)


def _column(values: object, count: int, what: str, default: object) -> Sequence[Any]:
    """One value per sequence: a sequence of ``count`` values, or one value for all."""
    if type(values) is list and len(values) == count:  # the common shape, first
        return values
    if values is None:
        return [default] * count
    if isinstance(values, (list, tuple)):
        if len(values) != count:
            raise InvalidArgumentError(f"{what} has {len(values)} entries for {count} sequences")
        return values
    return [values] * count
