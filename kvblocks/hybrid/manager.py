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
from dataclasses import dataclass

from kvblocks.config import CacheConfig
from kvblocks.core.groups import GROUP_KIND_RULES, kind_rules
from kvblocks.errors import ConfigError, IntegrityError, InvalidArgumentError, SequenceStateError, StaleLookupError
from kvblocks.events import BlockStored, EventSink
from kvblocks.hashing import DEFAULT_SCHEME, BlockHash, Namespace
from kvblocks.hybrid.block_index import FlatBlockIndex
from kvblocks.hybrid.cross import CrossAttentionGroup, _Cross
from kvblocks.hybrid.hits import GroupHitRule, longest_common_hit, longest_group_hit, needed_blocks
from kvblocks.hybrid.recurrent import RecurrentGroup, StateCopy, _Recurrent
from kvblocks.manager import _NEVER, KVCacheManager, _count_arg, _Sequence
from kvblocks.pool import BlockPool

__all__ = ["PLACEHOLDER", "HybridKVCacheManager", "LocalGroup"]

PLACEHOLDER = -1
"""A local group's table entry for a position that left the window (the block was released)."""


@dataclass(frozen=True)
class LocalGroup:
    """One sliding-window or chunked-local layer group: its kind, window or chunk (tokens), and pool size.

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
        if not kind_rules(self.kind).releases:
            local = ", ".join(repr(name) for name, rules in GROUP_KIND_RULES.items() if rules.releases)
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


class _Local:
    """A local group's state: its rule, pool, index and the tables of admitted sequences."""

    __slots__ = ("block_size", "index", "kind", "pool", "ratio", "released", "rule", "span", "tables")

    def __init__(self, group: LocalGroup, chain_block_size: int, number: int, events: EventSink | None) -> None:
        block_size = group.block_size or chain_block_size
        if block_size % chain_block_size:
            raise ConfigError(
                f"a local group's block_size {block_size} must be a multiple of the manager's {chain_block_size}"
            )
        self.rule = GroupHitRule(group.kind, block_size, group.span)  # type: ignore[arg-type]
        self.kind = self.rule.kind_rules  # the window formulas, once, in the kind
        self.span = group.span
        self.block_size = block_size
        self.ratio = block_size // chain_block_size  # chain blocks per group block
        self.pool = BlockPool(group.num_blocks)
        self.index = FlatBlockIndex(self.pool, events=events, group=number, group_kind=self.kind.event_name)
        self.tables: dict[int, list[int]] = {}  # id(_Sequence) -> table
        self.released: dict[int, int] = {}  # id(_Sequence) -> leading positions already released

    def keys(self, hashes: Sequence[BlockHash]) -> Sequence[BlockHash]:
        """The group's block keys: position ``p`` -> the chain hash its block ends with."""
        return hashes if self.ratio == 1 else _EveryNth(hashes, self.ratio)

    def blocks_for(self, chain_blocks: int) -> int:
        """The group's table length when the full-attention table has ``chain_blocks`` blocks."""
        return -(-chain_blocks // self.ratio)

    def first_needed(self, next_token: int) -> int:
        """The first block position any token from ``next_token`` on attends to (its window's or chunk's start)."""
        return self.kind.first_needed(next_token, self.block_size, self.span)

    def next_move(self, next_token: int) -> int:
        """The smallest token count from which :meth:`first_needed` may exceed its value at ``next_token``."""
        return self.kind.next_move(next_token, self.block_size, self.span)

    def take(self, count: int) -> list[int]:
        pool = self.pool
        short = count - pool.num_fresh
        if short > 0:
            self.index.evict(short)
        return pool.take_fresh(count)


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
        self._locals = [_Local(g, size, number, events) for number, g in enumerate(locals_, 1)]
        first = 1 + len(locals_)
        self._recurrents = [_Recurrent(g, first + i, size, events) for i, g in enumerate(recurrents)]
        first = 1 + len(locals_) + len(recurrents)
        self._crosses = [_Cross(g, first + i, size) for i, g in enumerate(crosses)]
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
            keys = local.keys(hashes)
            return longest_group_hit(local.rule, limit, self._hit_step, _indexed(local.index, keys))
        rules = [local.rule for local in locals_]
        answers = [_indexed(local.index, local.keys(hashes)) for local in locals_]
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
            for local in self._locals:
                need = local.blocks_for(total) - len(local.tables[id(s)])
                short = max(short, need - local.pool.num_free)
            return max(short, 0)
        hit = self._hit_blocks(s)
        total = (hit * size + num_new_tokens + num_lookahead_tokens + size - 1) // size
        for local in self._locals:
            kept = self._local_hit(local, s, hit) or []
            need = local.blocks_for(total) - hit // local.ratio
            short = max(short, need - (local.pool.num_free - local.pool.count_idle(kept)))
        if any(not r.free_slots for r in self._recurrents):
            short = max(short, 1)  # no running slot: counted as one block short, so preempting one sequence helps
        encoder = self._encoder_tokens.get(id(s), 0)
        for cross in self._crosses:
            short = max(short, cross.blocks_for(encoder) - cross.pool.num_free)
        return max(0, short)

    def _local_hit(self, local: _Local, s: _Sequence, hit: int) -> list[int] | None:
        """The blocks of ``local`` a hit of ``hit`` blocks keeps (those its window needs there), or None
        when the group does not hold them all."""
        window = needed_blocks(local.rule, hit * self._block_size)
        block_of = local.index._block_of.get  # the package's own index, read directly on the admission path
        if local.ratio == 1:  # keys are the chain's hashes: one C-level pass over the window
            kept = list(map(block_of, s.content.hashes[window.start : window.stop]))
        else:
            keys = local.keys(s.content.hashes)
            kept = [block_of(keys[p]) for p in window]
        return None if None in kept else kept  # type: ignore[return-value]

    def _admit_beside(self, seq_id: Hashable, s: _Sequence, hits: int, need: int) -> bool:
        """Each local group keeps the window blocks the hit needs and takes ``need`` new ones, and each
        recurrent group gives a slot holding the state at the hit -- or no group changes."""
        found = [self._local_hit(local, s, hits) for local in self._locals]
        hashes = s.content.hashes
        hit_tokens = hits * self._block_size
        slots = [recurrent.can_admit(hashes, hit_tokens) for recurrent in self._recurrents]
        if None in found or None in slots:  # only when the caller named a shorter hit than every group serves
            raise StaleLookupError(
                f"sequence {seq_id!r}: a group no longer holds what the {hit_tokens}-token hit seen needs"
            )
        if not all(slots):
            return False
        encoder = self._encoder_tokens.get(id(s), 0)
        if any(cross.blocks_for(encoder) > cross.pool.num_free for cross in self._crosses):
            return False
        kept: list[list[int]] = found  # type: ignore[assignment]
        total = hits + need
        for local, blocks in zip(self._locals, kept, strict=True):
            if local.blocks_for(total) - hits // local.ratio > local.pool.num_free - local.pool.count_idle(blocks):
                return False
        for recurrent in self._recurrents:
            recurrent.admit(id(s), hashes, hit_tokens)
        for cross in self._crosses:
            cross.admit(id(s), encoder)
        for number, (local, blocks) in enumerate(zip(self._locals, kept, strict=True)):
            local.pool._acquire_valid(blocks)
            cached = hits // local.ratio  # a hit ends on a boundary of every group (hit_step)
            first = cached - len(blocks)
            table = [PLACEHOLDER] * first + blocks
            new = local.blocks_for(total) - cached
            if new:
                table += self._take_local(number, new)
            local.tables[id(s)] = table
            local.released[id(s)] = first
        self._watch(s, hits * self._block_size)
        return True

    def _take_local(self, index: int, count: int) -> list[int]:
        """``count`` fresh blocks of ``self._locals[index]``, evicting idle ones (a tiered manager moves them down)."""
        return self._locals[index].take(count)

    def _room_to_grow(self, s: _Sequence, need: int) -> bool:
        if need > self._pool.num_free:
            return False
        total = len(s.table) + need  # type: ignore[arg-type]
        key = id(s)
        for local in self._locals:
            grow = (total if local.ratio == 1 else local.blocks_for(total)) - len(local.tables[key])
            if grow > local.pool.num_free:
                return False
        return True

    def _grow(self, s: _Sequence, covered: int, lookahead: int) -> bool:
        if not super()._grow(s, covered, lookahead):
            return False
        total = len(s.table)  # type: ignore[arg-type]
        for number, local in enumerate(self._locals):
            table = local.tables[id(s)]
            after = local.blocks_for(total)
            if after > len(table):
                table += self._take_local(number, after - len(table))
            elif after < len(table):  # a smaller lookahead: the surplus tail goes back, as in the full table
                surplus = table[after:]
                del table[after:]
                local.pool._release_valid(reversed(surplus))
        return True

    # ------------------------------------------------------------------ commit and release

    def _commit(self, s: _Sequence, n: int) -> None:
        size = self._block_size
        before = s.num_committed
        start = before // size
        full = n // size
        if full > start or n > s.num_covered:
            super()._commit(s, n)
        else:
            s.num_committed = n  # no block newly full: nothing to cache in any group
        key = id(s)
        cache = full > start and self._caching
        if cache and self._recurrents:
            for recurrent in self._recurrents:
                recurrent.committed(key, s.content.hashes, n)
        for local in self._locals:
            table = local.tables[key]
            released = local.released
            done = released[key]
            if cache:  # a duplicate stays private; released positions are never indexed
                group_size = local.block_size
                first_new = before // group_size
                local.index.insert_run(
                    local.keys(s.content.hashes), table, first_new if first_new > done else done, n // group_size
                )
            first = local.first_needed(n)
            if first > done:  # release what no token from n on attends to (cached if committed)
                leaving = table[done:first]  # blocks from `done` on (check_integrity), unless a role cut it back
                if PLACEHOLDER in leaving:
                    leaving = [b for b in leaving if b != PLACEHOLDER]
                local.pool._release_valid(leaving)  # oldest first: they leave the window in that order
                table[done:first] = [PLACEHOLDER] * (first - done)
                released[key] = first
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
            for local in self._locals:
                table = local.tables.pop(key)
                held = table[local.released.pop(key) :]  # positions before are released (placeholders)
                if PLACEHOLDER in held:
                    held = [b for b in held if b != PLACEHOLDER]
                held.reverse()  # tail first
                local.pool._release_valid(held)
            for recurrent in self._recurrents:
                recurrent.release(id(s))
            for cross in self._crosses:
                cross.release(id(s))
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
        """The base checks, and per local group: pool and index agree, references equal the tables,
        every table is as long as the full one, and no block outside the window is held."""
        super().check_integrity()
        for number, local in enumerate(self._locals, 1):
            local.pool.check_integrity()
            local.index.check_integrity()
            expected = [0] * local.pool.num_blocks
            live = {id(s): (seq_id, s) for seq_id, s in self._seqs.items() if s.table is not None}
            if set(local.tables) != set(live):
                raise IntegrityError(f"group {number} has tables for other sequences than the admitted ones")
            for key, table in local.tables.items():
                seq_id, s = live[key]
                if len(table) != local.blocks_for(len(s.table)):  # type: ignore[arg-type]
                    raise IntegrityError(f"group {number}: {seq_id!r}'s table has {len(table)} positions")
                first = local.first_needed(self._window_tokens(s))
                for position, block in enumerate(table):
                    if block == PLACEHOLDER:
                        if position >= first:
                            raise IntegrityError(f"group {number}: {seq_id!r} lost position {position} in its window")
                        continue
                    if position < first:
                        raise IntegrityError(f"group {number}: {seq_id!r} holds position {position} outside its window")
                    expected[block] += 1
            self._count_other_local_holders(number - 1, expected)
            for block in range(local.pool.num_blocks):
                if local.pool.ref_count(block) != expected[block]:
                    raise IntegrityError(f"group {number}: block {block} has {local.pool.ref_count(block)} references")
        admitted = {id(s) for s in self._seqs.values() if s.table is not None}
        for recurrent in self._recurrents:
            recurrent.check_integrity(admitted)
        encoder = {key: self._encoder_tokens.get(key, 0) for key in admitted}
        for cross in self._crosses:
            cross.check_integrity(encoder)
        if not set(self._encoder_tokens) <= {id(s) for s in self._seqs.values()}:
            raise IntegrityError("encoder token counts are kept for a sequence that left")


def _checkpointed(recurrent: _Recurrent, hashes: Sequence[BlockHash]) -> Callable[[int], bool]:
    """Whether ``recurrent`` has a findable checkpoint at token ``hit``."""
    return lambda hit: recurrent.checkpoint_at(hashes, hit) is not None


def _indexed(index: FlatBlockIndex, hashes: Sequence[BlockHash]) -> Callable[[int], bool]:
    """Whether block position ``p`` is cached in ``index`` (a hash past the known ones never is)."""
    count = len(hashes)
    block_of = index._block_of  # the package's own index: read its table directly on this hot path

    def cached(position: int) -> bool:
        return position < count and hashes[position] in block_of

    return cached
