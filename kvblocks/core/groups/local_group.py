"""A local layer group (sliding window, chunked local, ...): its pool, index, tables and every rule it owns.

A local group's table has one entry per block position of the sequence; positions its kind releases
hold :data:`PLACEHOLDER`::

    block size 4, window 6; a sequence committed up to token 14 (next token: 14, attends 9..14)
    positions           0    1    2    3
    full table          5    6    7    8
    window table        -1   -1   3    9       blocks 0 and 1 left the window: released, still cached

Which positions are released is the kind's to say (:meth:`~kvblocks.core.groups.KindRules.released`, as
sorted ranges): a leading run for a window, the gap between the prompt and the window for a
retained-prefix window. Per sequence the group keeps the positions it released
(:meth:`LocalGroupManager.released_positions`, :meth:`LocalGroupManager.is_released`) and the prompt the
kind's formulas may need; a kind may keep fewer entries than positions (a circular buffer: one). A
caller that builds or cuts a table itself goes through :meth:`LocalGroupManager.set_table`,
:meth:`LocalGroupManager.cut_back` and :meth:`LocalGroupManager.pop_table`.

The group answers the manager's questions the same way every group kind does (:class:`GroupManager`):
what it lacks for an admission and what it then keeps and takes, growth, what a commit caches and
releases, a sequence's release, integrity. The formulas are its kind's (:mod:`kvblocks.core.groups`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvblocks.core.groups.block_index import FlatBlockIndex
from kvblocks.core.groups.hits import GroupHitRule, needed_blocks
from kvblocks.core.groups.registry import GROUP_KIND_RULES, kind_rules
from kvblocks.core.groups.rules import Positions, covers, minus, union
from kvblocks.errors import ConfigError, IntegrityError
from kvblocks.events import EventSink
from kvblocks.hashing import BlockHash
from kvblocks.pool import BlockPool

__all__ = ["PLACEHOLDER", "LocalGroup", "LocalGroupManager"]

PLACEHOLDER = -1
"""A local group's table entry for a position its kind released (it left the window)."""


@dataclass(frozen=True)
class LocalGroup:
    """One local layer group: its kind (sliding window, chunked local, ...), span (window or chunk, tokens) and
    pool size.

    ``block_size`` (None: the manager's) must be a multiple of the manager's block size, the size the
    hash chain is cut at: a group block of ``r`` chain blocks is cached under the hash of its last one::

        manager block size 4, group block size 8 (r = 2)
        chain hashes     h0   h1   h2   h3          tokens 0..15
        group blocks     [ b0: h1 ] [ b1: h3 ]
    """

    kind: str
    span: int
    num_blocks: int
    block_size: int | None = None

    def __post_init__(self) -> None:
        if not kind_rules(self.kind).local:
            local = ", ".join(repr(name) for name, rules in GROUP_KIND_RULES.items() if rules.local)
            raise ConfigError(f"a local group is one of {local}, got {self.kind!r}")
        for what in ("span", "num_blocks", "block_size"):
            value = getattr(self, what)
            if what == "block_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"a local group's {what} must be a positive int, got {value!r}")


class _EveryNth(Sequence[BlockHash]):
    """Chain hashes ``r - 1, 2r - 1, ...``: the keys of a group whose blocks are ``r`` chain blocks long."""

    __slots__ = ("_hashes", "_ratio")

    def __init__(self, hashes: Sequence[BlockHash], ratio: int) -> None:
        self._hashes = hashes
        self._ratio = ratio

    def __len__(self) -> int:
        return len(self._hashes) // self._ratio

    def __getitem__(self, position: int) -> BlockHash:  # type: ignore[override]
        if position < 0:
            raise IndexError(position)  # only the manager reads it, with group positions >= 0
        return self._hashes[(position + 1) * self._ratio - 1]


class LocalGroupManager:
    """A local group: its rule, pool, index and the tables of admitted sequences (keyed by ``id(sequence)``).

    ``take_blocks(count)`` is how it gets new blocks: its own :meth:`take` (evicting idle cached ones), or
    what a tier stack puts there (the same, writing the evicted blocks back).
    """

    __slots__ = (
        "_inflight",
        "_prompts",
        "_released",
        "block_size",
        "index",
        "kind",
        "number",
        "pool",
        "ratio",
        "rule",
        "span",
        "tables",
        "take_blocks",
    )

    def __init__(self, group: LocalGroup, chain_block_size: int, number: int, events: EventSink | None) -> None:
        block_size = group.block_size or chain_block_size
        if block_size % chain_block_size:
            raise ConfigError(
                f"a local group's block_size {block_size} must be a multiple of the manager's {chain_block_size}"
            )
        self.number = number  # the group's index in the manager
        self.rule = GroupHitRule(group.kind, block_size, group.span)  # type: ignore[arg-type]
        self.kind = self.rule.kind_rules  # the formulas, once, in the kind
        if not self.kind.prefix_cached and block_size != chain_block_size:
            raise ConfigError(
                f"a {group.kind} group is never prefix-cached and takes no block_size of its own, got {block_size}"
            )
        self.span = group.span
        self.block_size = block_size
        self.ratio = block_size // chain_block_size  # chain blocks per group block
        self.pool = BlockPool(group.num_blocks)
        self.index = FlatBlockIndex(self.pool, events=events, group=number, group_kind=self.kind.event_name)
        self.tables: dict[int, list[int]] = {}  # id(_Sequence) -> table
        self._released: dict[int, Positions] = {}  # id(_Sequence) -> the positions released (PLACEHOLDER there)
        self._prompts: dict[int, int | None] = {}  # id(_Sequence) -> the tokens it knew when admitted
        self._inflight: dict[int, Positions] = {}  # id(_Sequence) -> positions a one-pass admission never took
        self.take_blocks: Callable[[int], list[int]] = self.take

    # ------------------------------------------------------------------ formulas

    def keys(self, hashes: Sequence[BlockHash]) -> Sequence[BlockHash]:
        """The group's block keys: position ``p`` -> the chain hash its block ends with."""
        return hashes if self.ratio == 1 else _EveryNth(hashes, self.ratio)

    def blocks_for(self, chain_blocks: int) -> int:
        """The group's block positions when the full-attention table has ``chain_blocks`` blocks."""
        return -(-chain_blocks // self.ratio)

    def table_length(self, chain_blocks: int) -> int:
        """A sequence's table length when the full-attention table has ``chain_blocks`` blocks (one entry per
        position, unless the kind keeps fewer)."""
        return self.kind.table_length(-(-chain_blocks // self.ratio))

    def first_needed(self, next_token: int) -> int:
        """The first block position any token from ``next_token`` on attends to (its window's or chunk's start)."""
        return self.kind.first_needed(next_token, self.block_size, self.span)

    def next_move(self, next_token: int) -> int:
        """The smallest token count from which the positions released at ``next_token`` may grow."""
        return self.kind.next_move(next_token, self.block_size, self.span)

    def take(self, count: int) -> list[int]:
        pool = self.pool
        short = count - pool.num_fresh
        if short > 0:
            self.index.evict(short)
        return pool.take_fresh(count)

    # ------------------------------------------------------------------ a sequence's positions

    def released_positions(self, key: int) -> Positions:
        """The positions the sequence released (its table holds :data:`PLACEHOLDER` exactly there). Replaced, not
        changed, when it releases more: an unchanged object means nothing was released since."""
        return self._released[key]

    def is_released(self, key: int, position: int) -> bool:
        """Whether the sequence released block position ``position``."""
        return any(position in r for r in self._released[key])

    def set_table(self, key: int, table: list[int], token: int, prompt: int | None) -> None:
        """Take ``table``, built by the caller (its blocks held, :data:`PLACEHOLDER` where released), for a
        sequence whose windows are placed at ``token`` and whose prompt is ``prompt`` tokens."""
        gone = _placeholders(table)
        self.tables[key] = table
        self._released[key] = gone
        self._prompts[key] = prompt
        inflight = minus(gone, self.kind.released(token, self.block_size, self.span, prompt))
        if inflight:
            self._inflight[key] = inflight

    def pop_table(self, key: int) -> list[int]:
        """Forget the sequence (its table is returned; the caller gives its blocks back)."""
        self._released.pop(key)
        self._prompts.pop(key)
        self._inflight.pop(key, None)
        return self.tables.pop(key)

    def cut_back(self, key: int, tokens: int) -> None:
        """Cut the table back to ``tokens`` (a shorter hit): the positions the kind releases there go, then the
        positions past them, tail first."""
        table = self.tables[key]
        end = self.kind.table_length(-(-tokens // self.block_size))
        had = self._released[key]
        gone = _clip(union(had, self.kind.released(tokens, self.block_size, self.span, self._prompts[key])), end)
        leaving = [table[p] for r in minus(gone, had) for p in r if table[p] != PLACEHOLDER]
        dropped = [b for b in reversed(table[end:]) if b != PLACEHOLDER]
        del table[end:]
        for r in gone:
            table[r.start : r.stop] = [PLACEHOLDER] * len(r)
        self.pool._release_valid(leaving)
        self.pool._release_valid(dropped)
        self._released[key] = gone
        inflight = _clip(self._inflight.pop(key, ()), end)
        if inflight:
            self._inflight[key] = inflight

    def require_block_per_position(self, what: str) -> None:
        """Raise :class:`ConfigError` unless the kind's tables hold one entry per position: ``what`` (a caller
        that builds tables itself) serves only those."""
        if any(self.kind.table_length(n) != n for n in (1, 2, 3)):
            raise ConfigError(f"{what} does not serve {self.kind.name} groups: their tables are not a block a position")

    # ------------------------------------------------------------------ hits

    def served(self, hashes: Sequence[BlockHash]) -> Callable[[int], bool]:
        """Whether block position ``p`` is cached on device (a hash past the known ones never is)."""
        keys = self.keys(hashes)
        count = len(keys)
        block_of = self.index._block_of  # the package's own index: read its table directly on this hot path

        def cached(position: int) -> bool:
            return position < count and keys[position] in block_of

        return cached

    def hit_blocks(self, hashes: Sequence[BlockHash], hit_tokens: int) -> list[int] | None:
        """The blocks a hit at ``hit_tokens`` keeps (those its window needs there), or None when the group
        does not hold them all. Pure."""
        window = needed_blocks(self.rule, hit_tokens)
        block_of = self.index._block_of.get  # the package's own index, read directly on the admission path
        if self.ratio == 1:  # keys are the chain's hashes: one C-level pass over the window
            kept = list(map(block_of, hashes[window.start : window.stop]))
        else:
            keys = self.keys(hashes)
            kept = [block_of(keys[p]) for p in window]
        return None if None in kept else kept  # type: ignore[return-value]

    # ------------------------------------------------------------------ admission and growth

    def admission(
        self,
        hashes: Sequence[BlockHash],
        hits: int,
        total: int,
        hit_tokens: int,
        encoder: int,
        *,
        prompt: int | None = None,
        covered: int | None = None,
    ) -> tuple[int, Any] | None:
        """(blocks short, what :meth:`take_admission` needs) for an admission of ``hits`` cached chain blocks
        (``hit_tokens`` tokens) growing to ``total`` chain blocks, of a sequence that knows ``prompt`` tokens and
        whose slots cover ``covered`` (before lookahead); None when the group no longer holds what the hit needs.
        Pure. Every group kind answers it: the manager asks every group, then every group takes."""
        kept = self.hit_blocks(hashes, hit_tokens)
        if kept is None:
            return None
        kind = self.kind
        size = self.block_size
        length = self.table_length(total)
        pass_end = None if prompt is None or covered is None else min(prompt, covered)
        released = _clip(kind.admission_released(hit_tokens, pass_end, size, self.span, prompt), length)
        fresh = minus(range(0, length), union(released, needed_blocks(self.rule, hit_tokens)))
        inflight = minus(released, kind.released(hit_tokens, size, self.span, prompt))
        pool = self.pool
        need = sum(map(len, fresh))
        return need - (pool.num_free - pool.count_idle(kept)), (kept, length, released, fresh, inflight, prompt)

    def take_admission(self, key: int, hits: int, total: int, hit_tokens: int, prepared: Any) -> None:
        """Keep the window blocks the hit needs, take the new ones (the caller checked the room)."""
        kept, length, released, fresh, inflight, prompt = prepared
        self.pool._acquire_valid(kept)
        table = [PLACEHOLDER] * length
        if kept:
            window = needed_blocks(self.rule, hit_tokens)
            table[window.start : window.stop] = kept
        count = sum(map(len, fresh))
        if count:
            new = self.take_blocks(count)
            done = 0
            for r in fresh:
                table[r.start : r.stop] = new[done : done + len(r)]
                done += len(r)
        self.tables[key] = table
        self._released[key] = released
        self._prompts[key] = prompt
        if inflight:
            self._inflight[key] = inflight

    def growth_short(self, key: int, total: int) -> int:
        """Blocks the group lacks to grow the sequence's table to ``total`` chain blocks. Pure."""
        return self.table_length(total) - len(self.tables[key]) - self.pool.num_free

    def resize(self, key: int, total: int) -> None:
        """Grow (or shrink: a smaller lookahead) the table to ``total`` chain blocks; the surplus tail goes back."""
        table = self.tables[key]
        after = self.table_length(total)
        if after > len(table):
            table += self.take_blocks(after - len(table))
        elif after < len(table):
            surplus = table[after:]
            del table[after:]
            self.pool._release_valid(reversed(surplus))

    # ------------------------------------------------------------------ commit and release

    def committed(self, key: int, hashes: Sequence[BlockHash], before: int, n: int, cache: bool) -> None:
        """The sequence committed from ``before`` to ``n`` tokens: cache its newly full blocks (when ``cache``),
        then release what no token from ``n`` on attends to (cached if committed)."""
        table = self.tables[key]
        gone = self._released[key]
        kind = self.kind
        prompt = self._prompts[key]
        if cache and kind.prefix_cached:  # a duplicate stays private; released positions are never indexed
            stop = kind.cached_stop(n, self.block_size, prompt)
            self._index(self.keys(hashes), table, gone, before // self.block_size, stop)
        now = kind.released(n, self.block_size, self.span, prompt)
        if not now or now == gone:
            return
        first = now[0]
        if len(now) == 1 and not first.start and (not gone or (len(gone) == 1 and not gone[0].start)):
            done = gone[0].stop if gone else 0  # a window's case: one leading run, longer now
            if first.stop > done:
                leaving = table[done : first.stop]  # unless a role cut them back, none is released yet
                if PLACEHOLDER in leaving:
                    leaving = [b for b in leaving if b != PLACEHOLDER]
                self.pool._release_valid(leaving)  # oldest first: they leave the window in that order
                table[done : first.stop] = [PLACEHOLDER] * (first.stop - done)
                self._released[key] = now
        elif not covers(gone, now):
            leaving = []
            for r in minus(now, gone):
                leaving += [b for b in table[r.start : r.stop] if b != PLACEHOLDER]
                table[r.start : r.stop] = [PLACEHOLDER] * len(r)
            self.pool._release_valid(leaving)
            self._released[key] = union(gone, now)

    def index_committed(self, key: int, hashes: Sequence[BlockHash], committed: int) -> None:
        """Make the sequence's held blocks below ``committed`` tokens findable (a tier's copies landed)."""
        if self.kind.prefix_cached:
            stop = self.kind.cached_stop(committed, self.block_size, self._prompts[key])
            self._index(self.keys(hashes), self.tables[key], self._released[key], 0, stop)

    def _index(self, keys: Sequence[BlockHash], table: list[int], gone: Positions, start: int, stop: int) -> None:
        """Index the held positions of ``[start, stop)``."""
        if start >= stop:
            return
        if not gone or gone[-1].stop <= start:
            self.index.insert_run(keys, table, start, stop)
            return
        for r in minus(range(start, stop), gone):
            self.index.insert_run(keys, table, r.start, r.stop)

    def release(self, key: int) -> None:
        """The sequence leaves: the blocks it still holds go back, tail first."""
        gone = self._released[key]
        table = self.pop_table(key)
        held = table[gone[0].stop :] if gone and gone[0].start == 0 else table  # the leading run is released
        held = [b for b in held if b != PLACEHOLDER]
        held.reverse()
        self.pool._release_valid(held)

    # ------------------------------------------------------------------ checks

    def check_integrity(
        self,
        live: dict[int, tuple[object, int, int]],
        other_holders: Callable[[list[int]], None],
    ) -> None:
        """Pool and index agree, references equal the tables (plus ``other_holders``), every table is as long
        as the kind says for the full one, it holds PLACEHOLDER exactly where the group released, and no block
        the kind releases is held. ``live``: id(sequence) -> (sequence id, full-attention table length, the
        token its window is placed at)."""
        number = self.number
        pool = self.pool
        pool.check_integrity()
        self.index.check_integrity()
        if not self.kind.prefix_cached and len(self.index):
            raise IntegrityError(f"group {number} is never prefix-cached but its index holds blocks")
        expected = [0] * pool.num_blocks
        if not set(self.tables) == set(live) == set(self._released) == set(self._prompts) >= set(self._inflight):
            raise IntegrityError(f"group {number} has tables for other sequences than the admitted ones")
        for key, table in self.tables.items():
            seq_id, chain_blocks, window_token = live[key]
            if len(table) != self.table_length(chain_blocks):
                raise IntegrityError(f"group {number}: {seq_id!r}'s table has {len(table)} positions")
            gone = _placeholders(table)
            if gone != self._released[key]:
                raise IntegrityError(
                    f"group {number}: {seq_id!r} released {self._released[key]}, its table is {PLACEHOLDER} at {gone}"
                )
            now = self.kind.released(window_token, self.block_size, self.span, self._prompts[key])
            lost = minus(gone, union(now, self._inflight.get(key, ())))
            if lost:
                raise IntegrityError(f"group {number}: {seq_id!r} lost position {lost[0].start} in its window")
            outside = minus(_clip(now, len(table)), gone)
            if outside:
                raise IntegrityError(f"group {number}: {seq_id!r} holds position {outside[0].start} outside its window")
            for block in table:
                if block != PLACEHOLDER:
                    expected[block] += 1
        other_holders(expected)
        for block in range(pool.num_blocks):
            if pool.ref_count(block) != expected[block]:
                raise IntegrityError(f"group {number}: block {block} has {pool.ref_count(block)} references")


def _clip(positions: Positions, length: int) -> Positions:
    """``positions`` below ``length``."""
    if not positions or positions[-1].stop <= length:
        return positions
    return tuple(r for r in (range(r.start, min(r.stop, length)) for r in positions) if r)


def _placeholders(table: list[int]) -> Positions:
    """The positions where ``table`` holds :data:`PLACEHOLDER`."""
    out: list[range] = []
    start = -1
    for position, block in enumerate(table):
        if block == PLACEHOLDER:
            if start < 0:
                start = position
        elif start >= 0:
            out.append(range(start, position))
            start = -1
    if start >= 0:
        out.append(range(start, len(table)))
    return tuple(out)
