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

What is left for later (issue 14): recurrent and cross-attention groups, different block sizes per
group, events, tiers and handoffs for local groups, and ``drop_last_matched_block``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from kvblocks.config import CacheConfig
from kvblocks.errors import ConfigError, IntegrityError, StaleLookupError
from kvblocks.events import EventSink
from kvblocks.hashing import DEFAULT_SCHEME, BlockHash, Namespace
from kvblocks.hybrid.block_index import FlatBlockIndex
from kvblocks.hybrid.hits import GroupHitRule, longest_common_hit, longest_group_hit, needed_blocks
from kvblocks.manager import KVCacheManager, _Sequence
from kvblocks.pool import BlockPool

__all__ = ["PLACEHOLDER", "HybridKVCacheManager", "LocalGroup"]

PLACEHOLDER = -1
"""A local group's table entry for a position that left the window (the block was released)."""


@dataclass(frozen=True)
class LocalGroup:
    """One sliding-window or chunked-local layer group: its kind, window or chunk (tokens), and pool size."""

    kind: str
    span: int
    num_blocks: int

    def __post_init__(self) -> None:
        if self.kind not in ("sliding_window", "chunked_local"):
            raise ConfigError(f"a local group is 'sliding_window' or 'chunked_local', got {self.kind!r}")
        for what in ("span", "num_blocks"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"a local group's {what} must be a positive int, got {value!r}")


class _Local:
    """A local group's state: its rule, pool, index and the tables of admitted sequences."""

    __slots__ = ("block_size", "index", "pool", "released", "rule", "sliding", "span", "tables")

    def __init__(self, group: LocalGroup, block_size: int) -> None:
        self.rule = GroupHitRule(group.kind, block_size, group.span)  # type: ignore[arg-type]
        self.sliding = group.kind == "sliding_window"
        self.span = group.span
        self.block_size = block_size
        self.pool = BlockPool(group.num_blocks)
        self.index = FlatBlockIndex(self.pool)
        self.tables: dict[int, list[int]] = {}  # id(_Sequence) -> table
        self.released: dict[int, int] = {}  # id(_Sequence) -> leading positions already released

    def first_needed(self, next_token: int) -> int:
        """The first block position any token from ``next_token`` on attends to (its window's or chunk's start)."""
        span = self.span
        start = max(0, next_token - span + 1) if self.sliding else next_token - next_token % span
        return start // self.block_size

    def next_move(self, next_token: int) -> int:
        """The smallest token count from which :meth:`first_needed` may exceed its value at ``next_token``."""
        span = self.span
        if self.sliding:  # the window's first block moves when n - W + 1 reaches the next block start
            return (self.first_needed(next_token) + 1) * self.block_size + span - 1
        return (next_token // span + 1) * span  # the chunk start moves at the next chunk

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

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        local_groups: Sequence[LocalGroup],
        hash_scheme: str = DEFAULT_SCHEME,
        namespace: str | Namespace = "default",
        enable_prefix_caching: bool = True,
        event_sink: EventSink | None = None,
        reserved_blocks: int = 0,
    ) -> None:
        super().__init__(
            num_blocks,
            block_size,
            hash_scheme=hash_scheme,
            namespace=namespace,
            enable_prefix_caching=enable_prefix_caching,
            event_sink=event_sink,
            reserved_blocks=reserved_blocks,
        )
        self._setup_locals(local_groups)

    @classmethod
    def from_config(  # type: ignore[override]
        cls, config: CacheConfig, *, local_groups: Sequence[LocalGroup], event_sink: EventSink | None = None
    ) -> HybridKVCacheManager:
        manager = cls.__new__(cls)
        manager._setup(config, event_sink)
        manager._setup_locals(local_groups)
        return manager

    def _setup_locals(self, local_groups: Sequence[LocalGroup]) -> None:
        groups = list(local_groups)
        if not groups or not all(isinstance(g, LocalGroup) for g in groups):
            raise ConfigError("local_groups must be a non-empty sequence of LocalGroup (else use KVCacheManager)")
        if self._drop_last:
            raise ConfigError("drop_last_matched_block is not supported with local groups yet")
        self._locals = [_Local(g, self._block_size) for g in groups]

    # ------------------------------------------------------------------ queries

    @property
    def num_groups(self) -> int:
        """Groups of layers: the full-attention group (0) and the local groups (1, 2, ...)."""
        return 1 + len(self._locals)

    def group_block_table(self, seq_id: Hashable, group: int) -> list[int]:
        """Group ``group``'s table of ``seq_id`` (0: the full-attention table); PLACEHOLDER where released."""
        s = self._get(seq_id)
        if self._group(group) == 0:
            return list(s.table or ())
        return list(self._locals[group - 1].tables.get(id(s), ()))

    def group_pool(self, group: int) -> BlockPool:
        """The block pool of local group ``group`` (1, 2, ...); group 0's is :attr:`pool`."""
        return self._pool if self._group(group) == 0 else self._locals[group - 1].pool

    def _group(self, group: object) -> int:
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < self.num_groups:
            raise ConfigError(f"group must be an int in [0, {self.num_groups}), got {group!r}")
        return group

    # ------------------------------------------------------------------ the hit every group serves

    def _hit_blocks(self, s: _Sequence) -> int:
        """How many leading blocks of ``s`` every group can serve now. Pure."""
        if not self._caching or s.skip_read:
            return 0
        content = s.content
        hashes = content.hashes
        limit = self._cacheable_blocks(content.num_tokens)
        run = self._tree.match_length(hashes, limit)  # full attention serves exactly the hits up to its run
        if not run:
            return 0
        size = self._block_size
        locals_ = self._locals
        if len(locals_) == 1:  # one local group: its own answer below the run is the fixed point
            local = locals_[0]
            return longest_group_hit(local.rule, run * size, size, _indexed(local.index, hashes)) // size
        rules = [local.rule for local in locals_]
        answers = [_indexed(local.index, hashes) for local in locals_]
        return longest_common_hit(rules, run * size, answers) // size

    def _match_length(self, s: _Sequence) -> int:
        return self._hit_blocks(s)

    def _match(self, s: _Sequence) -> list[int]:
        hit = self._hit_blocks(s)
        return self._tree.matched_blocks(s.content.hashes, hit) if hit else []

    # ------------------------------------------------------------------ admission and growth

    def blocks_short(self, seq_id: Hashable, num_new_tokens: int, *, num_lookahead_tokens: int = 0) -> int:
        """The most blocks any group lacks for ``allocate(seq_id, num_new_tokens, ...)`` now. Pure."""
        short = super().blocks_short(seq_id, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens)
        s = self._get(seq_id)
        size = self._block_size
        if s.table is not None:
            need = (s.num_covered + num_new_tokens + num_lookahead_tokens + size - 1) // size - len(s.table)
            return max(short, *(need - local.pool.num_free for local in self._locals))
        hit = self._hit_blocks(s)
        need = (hit * size + num_new_tokens + num_lookahead_tokens + size - 1) // size - hit
        for local in self._locals:
            kept = self._local_hit(local, s, hit) or []
            short = max(short, need - (local.pool.num_free - local.pool.count_idle(kept)))
        return max(0, short)

    def _local_hit(self, local: _Local, s: _Sequence, hit: int) -> list[int] | None:
        """The blocks of ``local`` a hit of ``hit`` blocks keeps (those its window needs there), or None
        when the group does not hold them all."""
        hashes = s.content.hashes
        block_of = local.index.block_of
        kept = [block_of(hashes[p]) for p in needed_blocks(local.rule, hit * self._block_size)]
        return None if None in kept else kept  # type: ignore[return-value]

    def _admit_beside(self, seq_id: Hashable, s: _Sequence, hits: int, need: int) -> bool:
        """Each local group keeps the window blocks the hit needs and takes ``need`` new ones, or none does."""
        found = [self._local_hit(local, s, hits) for local in self._locals]
        if None in found:  # only when the caller named a shorter hit than every group serves together
            raise StaleLookupError(
                f"sequence {seq_id!r}: a local group no longer holds the window of the "
                f"{hits * self._block_size}-token hit seen"
            )
        kept: list[list[int]] = found  # type: ignore[assignment]
        for local, blocks in zip(self._locals, kept, strict=True):
            if need > local.pool.num_free - local.pool.count_idle(blocks):
                return False
        for local, blocks in zip(self._locals, kept, strict=True):
            local.pool._acquire_valid(blocks)
            first = hits - len(blocks)
            table = [PLACEHOLDER] * first + blocks
            if need:
                table += local.take(need)
            local.tables[id(s)] = table
            local.released[id(s)] = first
        self._watch(s, hits * self._block_size)
        return True

    def _free_for_growth(self) -> int:
        return min(self._pool.num_free, *(local.pool.num_free for local in self._locals))

    def _grow(self, s: _Sequence, covered: int, lookahead: int) -> bool:
        before = len(s.table or ())
        if not super()._grow(s, covered, lookahead):
            return False
        after = len(s.table)  # type: ignore[arg-type]
        for local in self._locals:
            table = local.tables[id(s)]
            if after > before:
                table += local.take(after - before)
            elif after < before:  # a smaller lookahead: the surplus tail goes back, as in the full table
                surplus = table[after:]
                del table[after:]
                local.pool._release_valid(reversed(surplus))
        return True

    # ------------------------------------------------------------------ commit and release

    def _commit(self, s: _Sequence, n: int) -> None:
        size = self._block_size
        start = s.num_committed // size
        full = n // size
        if full > start or n > s.num_covered:
            super()._commit(s, n)
        else:
            s.num_committed = n  # no block newly full: nothing to cache in any group
        key = id(s)
        for local in self._locals:
            table = local.tables[key]
            if full > start and self._caching:
                local.index.insert_run(s.content.hashes, table, start, full)  # a duplicate stays private
            done = local.released[key]
            first = local.first_needed(n)
            if first > done:  # release what no token from n on attends to (cached if committed)
                leaving = [b for b in table[done:first] if b != PLACEHOLDER]
                local.pool._release_valid(leaving)  # oldest first: they leave the window in that order
                table[done:first] = [PLACEHOLDER] * (first - done)
                local.released[key] = first
        self._watch(s, n)

    def _watch(self, s: _Sequence, n: int) -> None:
        """Ask the step to call :meth:`_commit` again when a window may move past a block boundary."""
        s.watch = min(local.next_move(n) for local in self._locals)

    def _release(self, s: _Sequence) -> None:
        if s.table is not None:
            for local in self._locals:
                table = local.tables.pop(id(s))
                del local.released[id(s)]
                local.pool._release_valid(b for b in reversed(table) if b != PLACEHOLDER)
        super()._release(s)

    def reset_prefix_cache(self) -> bool:
        if not super().reset_prefix_cache():
            return False
        for local in self._locals:
            local.index.clear()
        return True

    # ------------------------------------------------------------------ checks

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
                if len(table) != len(s.table):  # type: ignore[arg-type]
                    raise IntegrityError(f"group {number}: {seq_id!r}'s table has {len(table)} positions")
                first = local.first_needed(s.num_committed)
                for position, block in enumerate(table):
                    if block == PLACEHOLDER:
                        if position >= first:
                            raise IntegrityError(f"group {number}: {seq_id!r} lost position {position} in its window")
                        continue
                    if position < first:
                        raise IntegrityError(f"group {number}: {seq_id!r} holds position {position} outside its window")
                    expected[block] += 1
            for block in range(local.pool.num_blocks):
                if local.pool.ref_count(block) != expected[block]:
                    raise IntegrityError(f"group {number}: block {block} has {local.pool.ref_count(block)} references")


def _indexed(index: FlatBlockIndex, hashes: Sequence[BlockHash]) -> Callable[[int], bool]:
    """Whether block position ``p`` is cached in ``index`` (a hash past the known ones never is)."""
    count = len(hashes)
    block_of = index._block_of  # the package's own index: read its table directly on this hot path

    def cached(position: int) -> bool:
        return position < count and hashes[position] in block_of

    return cached
