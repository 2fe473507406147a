"""A manager for models whose attention layers are full *and* local (sliding window, chunked local).

:class:`HybridKVCacheManager` is :class:`~kvblocks.manager.KVCacheManager` -- whose pool, prefix tree
and block tables serve the full-attention layers -- plus one *local group* per sliding-window or
chunked-local layer group. Every group sees the same hash chain and the same block positions; a local
group has its own pool, a :class:`~kvblocks.hybrid.block_index.FlatBlockIndex` and, per sequence, a
table whose positions outside its window hold :data:`PLACEHOLDER` once released::

    block size 4, window 6; a sequence committed up to token 14 (next token: 14, attends 9..14)
    positions           0    1    2    3
    full table          5    6    7    8
    window table        -1   -1   3    9       blocks 0 and 1 left the window: released, still cached

* ``lookup`` / admission take the longest prefix every group can serve
  (:func:`kvblocks.hybrid.hits.longest_common_hit`): the full group its leading run, a local group only
  the blocks its window needs at the hit.
* A commit caches the newly full blocks in every group, then each local group releases the blocks no
  later token can attend to. Released blocks whose KV was committed stay cached and evictable.
* Growth (``allocate`` of a running sequence, ``step``) takes one block per new position in every
  group, or nothing: a sequence grows only when every group has room.

* Recurrent groups (:mod:`kvblocks.hybrid.recurrent`) hold one running state slot per admitted
  sequence and cache state checkpoints at block boundaries; the manager plans the state copies
  (:meth:`HybridKVCacheManager.take_state_plan`) and a hit needs a checkpoint exactly at its end.

Groups are numbered 0 (full attention), then the local groups in the order given, then the recurrent
groups. A local group's blocks may be a multiple of the manager's block size (:class:`LocalGroup`).
Cross-attention groups (:mod:`kvblocks.hybrid.cross`) hold each sequence's encoder K/V blocks,
never cached; they come after the recurrent groups. Every group's events are tagged with its index and
kind. Attention groups have host and storage tiers (:mod:`kvblocks.hybrid.tiers`); recurrent groups
have none yet.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from functools import partial

from kvblocks.config import CacheConfig
from kvblocks.core.groups.cross_group import CrossAttentionGroup, _Cross
from kvblocks.core.groups.hits import longest_common_hit, longest_group_hit, needed_blocks
from kvblocks.core.groups.local_group import PLACEHOLDER, LocalGroup, LocalGroupManager
from kvblocks.core.groups.protocol import GroupManager
from kvblocks.core.groups.recurrent_group import RecurrentGroup, StateCopy, _Recurrent
from kvblocks.errors import ConfigError, IntegrityError, InvalidArgumentError, SequenceStateError, StaleLookupError
from kvblocks.events import BlockStored, EventSink
from kvblocks.hashing import DEFAULT_SCHEME, BlockHash, Namespace
from kvblocks.manager import _NEVER, KVCacheManager, _count_arg, _Sequence
from kvblocks.pool import BlockPool

__all__ = ["PLACEHOLDER", "HybridKVCacheManager", "LocalGroup"]


class HybridKVCacheManager(KVCacheManager):
    """Full-attention layers in the base manager's tree and tables, local layer groups beside them.

    >>> m = HybridKVCacheManager(16, 4, local_groups=[LocalGroup("sliding_window", span=6, num_blocks=16)])
    >>> m.add_sequence("a", list(range(17)))
    >>> list(m.allocate("a", 17)), m.group_block_table("a", 1)
    ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4])
    >>> m.commit("a", 17)                      # token 17 attends to 12..17: blocks 0-2 leave the window
    >>> m.group_block_table("a", 1)
    [-1, -1, -1, 3, 4]
    """

    _tree_group = (0, "full")

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        local_groups: Sequence[LocalGroup] = (),
        recurrent_groups: Sequence[RecurrentGroup] = (),
        cross_groups: Sequence[CrossAttentionGroup] = (),
        hash_scheme: str = DEFAULT_SCHEME,
        namespace: str | Namespace = "default",
        enable_prefix_caching: bool = True,
        event_sink: EventSink | None = None,
        reserved_blocks: int = 0,
        drop_last_matched_block: bool = False,
    ) -> None:
        super().__init__(
            num_blocks,
            block_size,
            hash_scheme=hash_scheme,
            namespace=namespace,
            enable_prefix_caching=enable_prefix_caching,
            event_sink=event_sink,
            reserved_blocks=reserved_blocks,
            drop_last_matched_block=drop_last_matched_block,
        )
        self._setup_groups(local_groups, recurrent_groups, cross_groups)

    @classmethod
    def from_config(
        cls,
        config: CacheConfig,
        *,
        local_groups: Sequence[LocalGroup] = (),
        recurrent_groups: Sequence[RecurrentGroup] = (),
        cross_groups: Sequence[CrossAttentionGroup] = (),
        event_sink: EventSink | None = None,
    ) -> HybridKVCacheManager:
        manager = cls.__new__(cls)
        manager._setup(config, event_sink)
        manager._setup_groups(local_groups, recurrent_groups, cross_groups)
        return manager

    def _setup_groups(
        self,
        local_groups: Sequence[LocalGroup],
        recurrent_groups: Sequence[RecurrentGroup],
        cross_groups: Sequence[CrossAttentionGroup] = (),
    ) -> None:
        given = (local_groups, recurrent_groups, cross_groups)
        if any(isinstance(groups, (str, bytes)) for groups in given):
            raise ConfigError("local_groups, recurrent_groups and cross_groups must be sequences of groups")
        locals_ = list(local_groups)
        recurrents = list(recurrent_groups)
        crosses = list(cross_groups)
        for groups, kind in ((locals_, LocalGroup), (recurrents, RecurrentGroup), (crosses, CrossAttentionGroup)):
            if not all(isinstance(g, kind) for g in groups):
                raise ConfigError(f"a group list holds something other than {kind.__name__} instances")
        if not locals_ and not recurrents and not crosses:
            raise ConfigError(
                "a hybrid manager needs a local, recurrent or cross-attention group (else KVCacheManager)"
            )
        size = self._block_size
        events = self._tree.events
        self._locals = [LocalGroupManager(g, size, number, events) for number, g in enumerate(locals_, 1)]
        for index, local in enumerate(self._locals):  # new blocks through the manager's hook (tiers write back)
            local.take_blocks = partial(self._take_local, index)
        first = 1 + len(locals_)
        self._recurrents = [_Recurrent(g, first + i, size, events) for i, g in enumerate(recurrents)]
        first = 1 + len(locals_) + len(recurrents)
        self._crosses = [_Cross(g, first + i, size) for i, g in enumerate(crosses)]
        self._groups: list[GroupManager] = [*self._locals, *self._recurrents, *self._crosses]  # group order
        self._committing: list[LocalGroupManager | _Recurrent] = [
            *self._locals,
            *self._recurrents,
        ]  # a commit caches in
        self._encoder_tokens: dict[int, int] = {}  # id(_Sequence) -> encoder tokens, for sequences with any
        self._kinds = (
            "full",
            *(g.kind for g in locals_),
            *("recurrent" for _ in recurrents),
            *("cross_attention" for _ in crosses),
        )
        self._checkpoint_step = math.lcm(*(r.step for r in self._recurrents)) if self._recurrents else 0
        self._hit_step = math.lcm(size, *(g.block_size for g in self._locals), *(r.step for r in self._recurrents))

    @property
    def hit_step(self) -> int:
        """Every hit is a multiple of this many tokens: each group's block size and checkpoint spacing divide it."""
        return self._hit_step

    def _expected_hit(self, num_cached_tokens: object) -> int | None:
        hit = super()._expected_hit(num_cached_tokens)
        if hit is not None and hit * self._block_size % self._hit_step:
            raise InvalidArgumentError(
                f"num_cached_tokens must be a multiple of {self._hit_step} (every group's block boundary and "
                f"checkpoint spacing), got {hit * self._block_size}"
            )
        return hit

    # ------------------------------------------------------------------ queries

    @property
    def num_groups(self) -> int:
        """Groups of layers: full attention (0), the local groups (1, 2, ...), then the recurrent groups."""
        return len(self._kinds)

    @property
    def group_kinds(self) -> tuple[str, ...]:
        """Each group's kind, by group index."""
        return self._kinds

    def group_block_table(self, seq_id: Hashable, group: int) -> list[int]:
        """Group ``group``'s table of ``seq_id`` (0: the full-attention table); PLACEHOLDER where released.

        A recurrent group has no table (:meth:`state_slot` is its per-sequence state).
        """
        s = self._get(seq_id)
        number = self._group(group)
        if number == 0:
            return list(s.table or ())
        if number <= len(self._locals):
            return list(self._locals[number - 1].tables.get(id(s), ()))
        if self._kinds[number] == "cross_attention":
            return list(self._cross(number).tables.get(id(s), ()))
        raise InvalidArgumentError(f"group {number} is recurrent: it has a state slot, not a block table")

    def block_tables(self, seq_id: Hashable) -> tuple[list[int], ...]:
        """One entry per group, group 0 first: an attention group's table (PLACEHOLDER where released), a
        recurrent group's running state slot as a one-entry list (empty lists when not admitted)."""
        s = self._get(seq_id)
        tables = []
        for number, kind in enumerate(self._kinds):
            if kind != "recurrent":
                tables.append(self.group_block_table(seq_id, number))
            else:
                slot = self._recurrent(number).slots.get(id(s))
                tables.append([] if slot is None else [slot])
        return tuple(tables)

    def group_pool(self, group: int) -> BlockPool:
        """The block pool of group ``group``: group 0's is :attr:`pool`; a recurrent group's holds its checkpoints."""
        number = self._group(group)
        if number == 0:
            return self._pool
        if number <= len(self._locals):
            return self._locals[number - 1].pool
        if self._kinds[number] == "cross_attention":
            return self._cross(number).pool
        return self._recurrent(number).pool

    def set_encoder_tokens(self, seq_id: Hashable, num_encoder_tokens: int) -> None:
        """How many encoder outputs ``seq_id``'s cross-attention layers attend to (0 by default).

        Give it before the admission: the cross-attention groups take their blocks then.
        """
        s = self._get(seq_id)
        count = _count_arg(num_encoder_tokens, "num_encoder_tokens")
        if s.table is not None:
            raise SequenceStateError(f"sequence {seq_id!r} is admitted: its encoder tokens are fixed until it leaves")
        if not self._crosses and count:
            raise InvalidArgumentError("this manager has no cross-attention group")
        if count:
            self._encoder_tokens[id(s)] = count
        else:
            self._encoder_tokens.pop(id(s), None)

    def free(self, seq_id: Hashable) -> None:
        s = self._seqs.get(seq_id) if self._crosses else None
        super().free(seq_id)
        if s is not None:
            self._encoder_tokens.pop(id(s), None)

    def _cross(self, number: int) -> _Cross:
        return self._crosses[number - 1 - len(self._locals) - len(self._recurrents)]

    def state_slot(self, seq_id: Hashable, group: int) -> int:
        """The running state id of admitted ``seq_id`` in recurrent group ``group`` (what its forward pass updates)."""
        s = self._get(seq_id)
        recurrent = self._recurrent(self._group(group))
        slot = recurrent.slots.get(id(s))
        if slot is None:
            raise InvalidArgumentError(f"sequence {seq_id!r} is not admitted: it has no state slot")
        return slot

    def num_state_slots(self, group: int) -> int:
        """Running slots of recurrent group ``group``; its state ids ``num_state_slots(g) + c`` are checkpoints."""
        return self._recurrent(self._group(group)).num_slots

    def next_checkpoint(self, seq_id: Hashable) -> int | None:
        """The first token count after ``seq_id``'s committed line at which every recurrent group checkpoints.

        A scheduler that ends a prefill chunk there gets the prompt's state cached (a commit elsewhere
        takes no checkpoint). None without recurrent groups.
        """
        s = self._get(seq_id)
        step = self._checkpoint_step
        return (s.num_committed // step + 1) * step if step else None

    def take_state_plan(self) -> list[StateCopy]:
        """The state operations planned since the last call, to run in order before the next forward pass.

        Call it once per step, after the scheduling calls and before the forward pass, and run what it
        returns first: calling it again is what tells the manager the previous plan has run, so the
        checkpoints that plan saved become findable then (never earlier). See :mod:`kvblocks.hybrid.recurrent`.
        """
        plan: list[StateCopy] = []
        for recurrent in self._recurrents:
            plan += recurrent.take_plan()
        return plan

    def state_plan_done(self) -> None:
        """Say that the plan :meth:`take_state_plan` handed out last has run, so that its checkpoints are
        findable at once (the next :meth:`take_state_plan` says it too; calling both is harmless).

        Without this call a checkpoint saved by the plan of step ``t`` is first findable by the admissions
        after the next ``take_state_plan``: a step later than it could be.
        """
        for recurrent in self._recurrents:
            recurrent.plan_ran()

    @property
    def checkpoints_skipped(self) -> int:
        """Checkpoints not taken because every checkpoint of the group was being written or restored from."""
        return sum(r.skipped for r in self._recurrents)

    def _recurrent(self, number: int) -> _Recurrent:
        if self._kinds[number] != "recurrent":
            raise InvalidArgumentError(f"group {number} is {self._kinds[number]!r}, not recurrent")
        return self._recurrents[number - 1 - len(self._locals)]

    def _group(self, group: object) -> int:
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < self.num_groups:
            raise ConfigError(f"group must be an int in [0, {self.num_groups}), got {group!r}")
        return group

    # ------------------------------------------------------------------ the hit every group serves

    def _hit_blocks(self, s: _Sequence) -> int:
        """How many leading blocks of ``s`` every group can serve now. Pure.

        With ``drop_last_matched_block`` the hit is the largest one every group serves below the
        common hit (the last block's tokens are computed again, as EAGLE needs their hidden states).
        """
        if not self._caching or s.skip_read:
            return 0
        content = s.content
        hashes = content.hashes
        return self._hit_within(hashes, self._tree.match_length(hashes, self._cacheable_blocks(content.num_tokens)))

    def _hit_within(self, hashes: Sequence[BlockHash], run: int) -> int:
        """The hit (blocks) every group serves within full attention's leading ``run`` of cached blocks. Pure."""
        if not run:
            return 0
        size = self._block_size
        hit = self._common_hit(hashes, run * size)
        if hit and self._drop_last:
            hit = self._common_hit(hashes, hit - size)
        return hit // size

    def _common_hit(self, hashes: Sequence[BlockHash], limit: int) -> int:
        """The largest hit (tokens) at or below ``limit`` that every group other than full attention serves."""
        locals_ = self._locals
        if len(locals_) == 1 and not self._recurrents:  # one local group: its answer below the run is the fixed point
            local = locals_[0]
            if local.ratio == 1 and not limit % self._hit_step:  # the common case first, checked in C:
                window = needed_blocks(local.rule, limit)  # the group holds the whole window below the limit
                if all(map(local.index._block_of.__contains__, hashes[window.start : window.stop])):
                    return limit
            return longest_group_hit(local.rule, limit, self._hit_step, local.served(hashes))
        rules = [local.rule for local in locals_]
        answers = [local.served(hashes) for local in locals_]
        for recurrent in self._recurrents:
            rules.append(recurrent.rule)
            answers.append(_checkpointed(recurrent, hashes))
        return longest_common_hit(rules, limit, answers, self._hit_step)

    def _match_length(self, s: _Sequence) -> int:
        return self._hit_blocks(s)

    def _match(self, s: _Sequence) -> list[int]:
        if not self._caching or s.skip_read:
            return []
        content = s.content
        matched = self._tree.matched_blocks(content.hashes, self._cacheable_blocks(content.num_tokens))
        del matched[self._hit_within(content.hashes, len(matched)) :]  # one walk of the tree, not two
        return matched

    # ------------------------------------------------------------------ admission and growth

    def blocks_short(self, seq_id: Hashable, num_new_tokens: int, *, num_lookahead_tokens: int = 0) -> int:
        """The most blocks any group lacks for ``allocate(seq_id, num_new_tokens, ...)`` now. Pure."""
        short = super().blocks_short(seq_id, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens)
        s = self._get(seq_id)
        size = self._block_size
        if s.table is not None:
            total = (s.num_covered + num_new_tokens + num_lookahead_tokens + size - 1) // size
            key = id(s)
            return max(short, 0, *(local.growth_short(key, total) for local in self._locals))
        hit = self._hit_blocks(s)
        total = (hit * size + num_new_tokens + num_lookahead_tokens + size - 1) // size
        for answer in self._group_answers(s, hit, total):
            if answer is not None:
                short = max(short, answer[0])
        return max(0, short)

    def _group_answers(self, s: _Sequence, hits: int, total: int) -> list[tuple[int, object] | None]:
        """Every group's answer to an admission of ``hits`` cached blocks growing to ``total`` (see
        :class:`~kvblocks.core.groups.protocol.GroupManager`). Pure."""
        hashes = s.content.hashes
        tokens = hits * self._block_size
        encoder = self._encoder_tokens.get(id(s), 0)
        return [group.admission(hashes, hits, total, tokens, encoder) for group in self._groups]

    def _admit_beside(self, seq_id: Hashable, s: _Sequence, hits: int, need: int) -> bool:
        """Two phases: every group says what it lacks for the hit (raising :class:`StaleLookupError` when one
        no longer serves it), then -- only when none lacks anything -- every group takes."""
        total = hits + need
        answers = self._group_answers(s, hits, total)
        if None in answers:  # only when the caller named a shorter hit than every group serves
            raise StaleLookupError(
                f"sequence {seq_id!r}: a group no longer holds what the {hits * self._block_size}-token hit seen needs"
            )
        if any(answer[0] > 0 for answer in answers):  # type: ignore[index]
            return False
        key = id(s)
        tokens = hits * self._block_size
        for group, answer in zip(self._groups, answers, strict=True):
            group.take_admission(key, hits, total, tokens, answer[1])  # type: ignore[index]
        self._watch(s, tokens)
        return True

    def _take_local(self, index: int, count: int) -> list[int]:
        """``count`` fresh blocks of ``self._locals[index]``, evicting idle ones (a tiered manager moves them down)."""
        return self._locals[index].take(count)

    def _room_to_grow(self, s: _Sequence, need: int) -> bool:
        if need > self._pool.num_free:
            return False
        total = len(s.table) + need  # type: ignore[arg-type]
        key = id(s)
        return all(local.growth_short(key, total) <= 0 for local in self._locals)

    def _grow(self, s: _Sequence, covered: int, lookahead: int) -> bool:
        if not super()._grow(s, covered, lookahead):
            return False
        total = len(s.table)  # type: ignore[arg-type]
        key = id(s)
        for local in self._locals:
            local.resize(key, total)
        return True

    # ------------------------------------------------------------------ commit and release

    def _commit(self, s: _Sequence, n: int) -> None:
        size = self._block_size
        before = s.num_committed
        full = n // size
        if full > before // size or n > s.num_covered:
            super()._commit(s, n)
        else:
            s.num_committed = n  # no block newly full: nothing to cache in any group
        cache = full > before // size and self._caching
        key = id(s)
        hashes = s.content.hashes
        for group in self._committing:
            group.committed(key, hashes, before, n, cache)
        self._watch(s, n)

    def _watch(self, s: _Sequence, n: int) -> None:
        """Ask the step to call :meth:`_commit` again when a window may move past a block boundary."""
        locals_ = self._locals
        if len(locals_) == 1:
            s.watch = locals_[0].next_move(n)
        else:
            s.watch = min((local.next_move(n) for local in locals_), default=_NEVER)

    def _release(self, s: _Sequence) -> None:
        if s.table is not None:
            key = id(s)
            for group in self._groups:
                group.release(key)
        super()._release(s)

    def reset_prefix_cache(self) -> bool:
        """As the base's; also refused while a state plan has not run (a checkpoint it saves would come back)."""
        if any(r.busy for r in self._recurrents) or not super().reset_prefix_cache():
            return False
        for local in self._locals:
            local.index.clear()
        for recurrent in self._recurrents:
            recurrent.index.clear()
        return True

    # ------------------------------------------------------------------ events

    def snapshot_events(self) -> list[BlockStored]:
        """Every group's cached blocks as tagged ``BlockStored`` events (for an ``EventPublisher`` snapshot).

        Needs the manager's ``event_sink`` (a local group records chain parents only with one).
        """
        events = self._tree.snapshot_events()
        for local in self._locals:
            events += local.index.snapshot_events()
        for recurrent in self._recurrents:
            events += recurrent.index.snapshot_events()
        return events

    # ------------------------------------------------------------------ checks

    def _window_tokens(self, s: _Sequence) -> int:
        """The token the windows of ``s`` are placed at: its committed line (a decode node receiving a
        prompt holds the window at the prompt's end before it commits it)."""
        return s.num_committed

    def _count_other_local_holders(self, index: int, expected: list[int]) -> None:
        """Add references on ``self._locals[index]``'s blocks held by something other than the tables (none here;
        a tiered manager's in-flight copies)."""

    def check_integrity(self) -> None:
        """The base checks, then every group's own (see each group's ``check_integrity``)."""
        super().check_integrity()
        admitted = {id(s): (seq_id, s) for seq_id, s in self._seqs.items() if s.table is not None}
        live = {key: (seq_id, len(s.table), self._window_tokens(s)) for key, (seq_id, s) in admitted.items()}  # type: ignore[arg-type]
        for index, local in enumerate(self._locals):
            local.check_integrity(live, partial(self._count_other_local_holders, index))
        for recurrent in self._recurrents:
            recurrent.check_integrity(set(admitted))
        encoder = {key: self._encoder_tokens.get(key, 0) for key in admitted}
        for cross in self._crosses:
            cross.check_integrity(encoder)
        if not set(self._encoder_tokens) <= {id(s) for s in self._seqs.values()}:
            raise IntegrityError("encoder token counts are kept for a sequence that left")


def _checkpointed(recurrent: _Recurrent, hashes: Sequence[BlockHash]) -> Callable[[int], bool]:
    """Whether ``recurrent`` has a findable checkpoint at token ``hit``."""
    return lambda hit: recurrent.checkpoint_at(hashes, hit) is not None
