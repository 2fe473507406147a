"""KVCacheManager: the request-level API an engine's scheduler calls.

One sequence, block size 4, a 10-token prompt whose first 8 tokens are cached::

    tokens              | a b c d | e f g h | i j . . |
    lookup(s)           |<---- 8 cached --->|              never the last token: its logits are needed
    allocate(s, 2)      [ hit     , hit     , new     ]    the table covers 8 + 2 = 10 tokens
    commit(s, 10)       only full blocks below the line enter the tree; block 2 is partial
    append_tokens(s, [k]); allocate(s, 1); commit(s, 11)   ...one decode step
    free(s)             references drop tail first, so the tail is evicted before the head

``commit`` is the only way a block becomes findable: a block whose KV the engine
has not reported written is never handed to another sequence.

When two sequences compute the same block at once (both allocated before either
committed), the first commit makes its block the tree node. The second keeps its
own copy private -- the engine already wrote KV into it -- and *pins* the node, so
that the prefix it builds on stays cached while it lives; the private copy goes
back to the fresh queue when the sequence is freed. A sequence therefore holds a
reference on every block of its table plus every pinned node, and a holder of a
node always holds the node's ancestors.

The manager is not thread-safe: call it from the scheduler's thread.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import ClassVar, overload

from kvblocks.accounting import BlockLifetimes, CachedTokens, CacheStats, HitCounters
from kvblocks.config import CacheConfig
from kvblocks.errors import (
    CommitOutOfRangeError,
    DoubleFreeError,
    DuplicateSequenceError,
    IntegrityError,
    InvalidArgumentError,
    InvalidTokenError,
    SequenceStateError,
    UnknownSequenceError,
)
from kvblocks.events import EventSink
from kvblocks.hashing import (
    DEFAULT_SCHEME,
    BlockExtras,
    BlockHash,
    BlockHasher,
    HashedTokens,
    Namespace,
    PrecomputedHashes,
)
from kvblocks.pool import BlockPool
from kvblocks.radix import PrefixTree

__all__ = ["BlockTable", "KVCacheManager"]

_FREED_MEMORY = 8192  # how many freed ids are remembered to tell a double free from an unknown id


class BlockTable(Sequence[int]):
    """A read-only view of a sequence's block ids, position ``i`` holding tokens ``[i*B, (i+1)*B)``.

    The view follows the table while the sequence is admitted (later allocations
    show up in it) and stops changing when the sequence is freed or preempted.
    """

    __slots__ = ("_ids",)

    def __init__(self, ids: list[int]) -> None:
        self._ids = ids

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._ids[index]

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockTable):
            return self._ids == other._ids
        if isinstance(other, (list, tuple)):
            return self._ids == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BlockTable({self._ids!r})"


class _TimedTree(PrefixTree):
    """The device prefix tree, recording evicted blocks' lifetime and idle time when it evicts them.

    A subclass rather than a hook in :meth:`KVCacheManager._take`, so that every eviction of
    the device tier -- the tiered and disaggregated managers' own ``_take`` included -- is seen.
    It costs nothing off the eviction path and allocates nothing per block on it. It relies on
    the manager's release order (children before parents; ``check_integrity`` checks it): the
    tree then evicts exactly the idle LRU's first blocks, so their stamps are read there first.
    """

    __slots__ = ("lifetimes",)

    def __init__(self, pool: BlockPool, *, events: EventSink | None) -> None:
        super().__init__(pool, tier="device", events=events)
        self.lifetimes = BlockLifetimes()

    def evict(self, count: int, removed_hashes: list[BlockHash] | None = None) -> list[int]:
        pool = self.pool
        idle = pool._idle  # block -> when it became idle; the tree deletes the evicted ones: read them first
        if type(count) is int and count > 0 and idle:
            self.lifetimes.observe(pool.clock(), pool._taken_at, idle.items(), min(count, len(idle)))
        return super().evict(count, removed_hashes)


class _Sequence:
    """Everything the manager keeps about one sequence. ``table is None`` means not admitted."""

    __slots__ = (
        "content",
        "num_committed",
        "num_covered",
        "pins",
        "preempted",
        "table",
        "view",
    )

    def __init__(self, content: HashedTokens | PrecomputedHashes) -> None:
        self.content = content
        self.table: list[int] | None = None
        self.view: BlockTable | None = None
        self.pins: dict[int, int] | None = None  # position -> tree node pinned instead of a private duplicate
        self.num_covered = 0  # tokens the table has slots for
        self.num_committed = 0  # tokens whose KV is written (cached prefix included)
        self.preempted = False


def _count_arg(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{what} must be an int, got bool")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(f"{what} must be an int, got {type(value).__name__}") from None
    if number < 0:
        raise InvalidArgumentError(f"{what} must be >= 0, got {number}")
    return number


class KVCacheManager:
    """Prefix-caching block manager for one tier of device blocks.

    >>> m = KVCacheManager(num_blocks=8, block_size=4)
    >>> m.add_sequence("a", list(range(10)))
    >>> m.lookup("a").device                      # nothing cached yet
    0
    >>> list(m.allocate("a", 10))                 # 10 tokens -> 3 blocks
    [0, 1, 2]
    >>> m.commit("a", 10)                         # KV written: blocks 0 and 1 are full, enter the tree
    >>> m.free("a")
    >>> m.add_sequence("b", list(range(10)) + [99])
    >>> m.lookup("b").device                      # b shares a's two full blocks
    8
    """

    role: ClassVar[str] = "mixed"
    """The node's role in prefill/decode disaggregation (see :mod:`kvblocks.disagg`)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        hash_scheme: str = DEFAULT_SCHEME,
        namespace: str | Namespace = "default",
        enable_prefix_caching: bool = True,
        event_sink: EventSink | None = None,
    ) -> None:
        config = CacheConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            hash_scheme=hash_scheme,
            namespace=namespace,
            enable_prefix_caching=enable_prefix_caching,
        )
        self._setup(config, event_sink)

    @classmethod
    def from_config(cls, config: CacheConfig, *, event_sink: EventSink | None = None) -> KVCacheManager:
        manager = cls.__new__(cls)
        manager._setup(config, event_sink)
        return manager

    def _setup(self, config: CacheConfig, event_sink: EventSink | None) -> None:
        if not isinstance(config, CacheConfig):
            raise InvalidArgumentError(f"config must be a CacheConfig, got {type(config).__name__}")
        self.config = config
        self._block_size = config.block_size
        self._caching = config.enable_prefix_caching
        self._hasher = BlockHasher(config.block_size, config.hash_scheme, config.namespace)
        self._pool = BlockPool(config.num_blocks)
        self._tree = _TimedTree(self._pool, events=event_sink)
        self._seqs: dict[Hashable, _Sequence] = {}
        self._freed: OrderedDict[Hashable, None] = OrderedDict()
        self._counters = HitCounters()

    # ------------------------------------------------------------------ properties

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can obtain now (fresh plus evictable)."""
        return self._pool.num_free

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    @property
    def pool(self) -> BlockPool:
        """The block pool (read it; change it only through the manager)."""
        return self._pool

    @property
    def tree(self) -> PrefixTree:
        """The prefix tree (read it; change it only through the manager)."""
        return self._tree

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    # ------------------------------------------------------------------ registration

    def add_sequence(
        self,
        seq_id: Hashable,
        token_ids: Iterable[int] | None = None,
        *,
        extras: BlockExtras | None = None,
        block_hashes: Iterable[BlockHash] | None = None,
        num_tokens: int | None = None,
    ) -> None:
        """Register a sequence by its token ids (copied), or by precomputed block hashes.

        With ``block_hashes`` (one per full block, as a router or trace has them),
        ``num_tokens`` gives the prompt length and ``token_ids`` must be None; such a
        sequence cannot :meth:`append_tokens`.
        """
        try:
            registered = seq_id in self._seqs
        except TypeError:
            raise InvalidArgumentError(f"sequence id must be hashable, got {type(seq_id).__name__}") from None
        if registered:
            raise DuplicateSequenceError(f"sequence {seq_id!r} is already registered")
        if extras is not None and not isinstance(extras, BlockExtras):
            raise InvalidArgumentError(f"extras must be a BlockExtras, got {type(extras).__name__}")
        content: HashedTokens | PrecomputedHashes
        if block_hashes is not None:
            if token_ids is not None or extras is not None:
                raise InvalidArgumentError("give either token_ids (and extras) or block_hashes, not both")
            if num_tokens is None:
                raise InvalidArgumentError("block_hashes needs num_tokens, the prompt length")
            content = PrecomputedHashes(block_hashes, num_tokens, self._block_size)
        else:
            if token_ids is None:
                raise InvalidArgumentError("add_sequence needs token_ids or block_hashes")
            if num_tokens is not None:
                raise InvalidArgumentError("num_tokens is only for sequences given by block_hashes")
            content = HashedTokens(self._hasher, token_ids, extras)
        if content.num_tokens == 0:
            raise InvalidTokenError(f"sequence {seq_id!r} has no tokens; a prompt needs at least one")
        self._seqs[seq_id] = _Sequence(content)
        self._freed.pop(seq_id, None)

    def append_tokens(self, seq_id: Hashable, token_ids: Iterable[int]) -> None:
        """Append tokens (decode output); full blocks they complete are hashed now, once."""
        self._get(seq_id).content.extend(token_ids)

    # ------------------------------------------------------------------ pure queries

    def lookup(self, seq_id: Hashable) -> CachedTokens:
        """How many leading tokens are cached now. Pure: no references, no eviction, no statistics.

        The last token is never counted: the engine must compute it to get logits.
        """
        s = self._get(seq_id)
        return CachedTokens(device=self._match_length(s) * self._block_size, num_prompt_tokens=s.content.num_tokens)

    def blocks_short(self, seq_id: Hashable, num_new_tokens: int) -> int:
        """How many blocks ``allocate(seq_id, num_new_tokens)`` would lack now (0: it would succeed). Pure."""
        s = self._get(seq_id)
        n = _count_arg(num_new_tokens, "num_new_tokens")
        size = self._block_size
        pool = self._pool
        if s.table is not None:
            need = (s.num_covered + n + size - 1) // size - len(s.table)
            available = pool.num_free
        else:
            matched = self._match(s)
            need = (len(matched) * size + n + size - 1) // size - len(matched)
            available = pool.num_free - pool.count_idle(matched)
        return max(0, need - available)

    def can_allocate(self, seq_id: Hashable, num_new_tokens: int) -> bool:
        """Whether :meth:`allocate` would succeed now. Pure: never evicts."""
        return self.blocks_short(seq_id, num_new_tokens) == 0

    def block_table(self, seq_id: Hashable) -> BlockTable:
        """The sequence's block table (empty when it is not admitted)."""
        view = self._get(seq_id).view
        return view if view is not None else BlockTable([])

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._get(seq_id).content.num_tokens

    def num_computed_tokens(self, seq_id: Hashable) -> int:
        """Tokens whose KV is written (the last commit, or the cached prefix at admission)."""
        return self._get(seq_id).num_committed

    def token_ids(self, seq_id: Hashable) -> tuple[int, ...] | None:
        """The sequence's tokens (None for a sequence given by block hashes)."""
        return self._get(seq_id).content.token_ids

    def block_hashes(self, seq_id: Hashable) -> tuple[BlockHash, ...]:
        """Hashes of the sequence's full blocks so far."""
        return tuple(self._get(seq_id).content.hashes)

    def is_admitted(self, seq_id: Hashable) -> bool:
        return self._get(seq_id).table is not None

    # ------------------------------------------------------------------ lifecycle

    def allocate(self, seq_id: Hashable, num_new_tokens: int) -> BlockTable | None:
        """Grant blocks for ``num_new_tokens`` more tokens, or change nothing and return None.

        The first call (admission) starts the table with the cached prefix -- as
        :meth:`lookup` reports it now -- and records the admission's hit statistics.
        New blocks come from the fresh queue first, then by evicting idle leaves.
        """
        s = self._get(seq_id)
        n = num_new_tokens
        if type(n) is not int or n < 0:
            n = _count_arg(n, "num_new_tokens")
        table = s.table
        if table is None:
            return self._admit(seq_id, s, n)
        size = self._block_size
        covered = s.num_covered + n
        need = (covered + size - 1) // size - len(table)
        if need > 0:
            if need > self._pool.num_free:
                return None
            table += self._take(need)
        s.num_covered = covered
        return s.view

    def _admit(self, seq_id: Hashable, s: _Sequence, n: int) -> BlockTable | None:
        size = self._block_size
        pool = self._pool
        matched = self._match(s)
        hits = len(matched)
        covered = hits * size + n
        need = (covered + size - 1) // size - hits
        if need > pool.num_free - pool.count_idle(matched):
            return None
        if hits:
            pool._acquire_valid(matched)  # nodes the tree just matched: valid by construction
        if need:
            matched += self._take(need)
        s.table = matched
        s.view = BlockTable(matched)
        s.num_covered = covered
        s.num_committed = hits * size
        self._admitted(seq_id, CachedTokens(device=hits * size, num_prompt_tokens=s.content.num_tokens), s.preempted)
        return s.view

    def _admitted(self, seq_id: Hashable, cached: CachedTokens, readmission: bool) -> None:
        """An admission's hits are final (at once here; once its copies settle with tiers): count them.

        The one place admissions are counted, so a role can also keep the figure per request.
        """
        self._counters.record(cached, readmission=readmission)

    def _cacheable_blocks(self, num_tokens: int) -> int:
        """Full blocks a prefix hit may cover: never the one holding the last token, whose logits are needed."""
        return (num_tokens - 1) // self._block_size

    def _match_length(self, s: _Sequence) -> int:
        """How many leading blocks of ``s`` the tree holds now (the device hit). Pure."""
        if not self._caching:
            return 0
        content = s.content
        return self._tree.match_length(content.hashes, self._cacheable_blocks(content.num_tokens))

    def _match(self, s: _Sequence) -> list[int]:
        if not self._caching:
            return []
        content = s.content
        return self._tree.matched_blocks(content.hashes, self._cacheable_blocks(content.num_tokens))

    def _take(self, count: int) -> list[int]:
        pool = self._pool
        short = count - pool.num_fresh
        if short > 0:
            self._tree.evict(short)
        return pool.take_fresh(count)

    def commit(self, seq_id: Hashable, num_computed_tokens: int) -> None:
        """Report that the first ``num_computed_tokens`` tokens' KV is written.

        Full blocks below that line become findable by other sequences. The value
        counts from the sequence's start (cached prefix included), never decreases,
        and cannot pass the allocated slots or the known tokens.
        """
        s = self._get(seq_id)
        table = s.table
        if table is None:
            raise SequenceStateError(f"sequence {seq_id!r} is not admitted: allocate before commit")
        n = num_computed_tokens
        if type(n) is not int:
            n = _count_arg(n, "num_computed_tokens")
        content = s.content
        if n < s.num_committed or n > s.num_covered or n > content.num_tokens:
            raise CommitOutOfRangeError(
                f"commit({seq_id!r}, {n}): must be within [{s.num_committed}, "
                f"{min(s.num_covered, content.num_tokens)}] (last commit {s.num_committed}, "
                f"{s.num_covered} tokens allocated, {content.num_tokens} tokens known)"
            )
        # Blocks fully below the old line are already in the tree (inserted, hit or pinned);
        # those newly below the new line go in now.
        start = s.num_committed // self._block_size
        full = n // self._block_size
        if full > start and self._caching:
            existing = self._tree.insert(content.hashes, table, start, full)
            if existing:
                self._pin_duplicates(s, start, existing)
        s.num_committed = n

    def _pin_duplicates(self, s: _Sequence, start: int, existing: list[int]) -> None:
        table = s.table
        pins = s.pins if s.pins is not None else {}
        nodes = []
        for position, node in enumerate(existing, start):
            if node != table[position]:  # type: ignore[index]
                pins[position] = node
                nodes.append(node)
        self._pool.acquire(nodes)
        s.pins = pins

    def free(self, seq_id: Hashable) -> None:
        """Release the sequence's blocks (tail first) and forget it."""
        try:
            s = self._seqs.pop(seq_id)
        except KeyError:
            if seq_id in self._freed:
                raise DoubleFreeError(f"sequence {seq_id!r} was already freed") from None
            raise UnknownSequenceError(seq_id) from None
        self._release(s)
        freed = self._freed
        freed[seq_id] = None
        if len(freed) > _FREED_MEMORY:
            freed.popitem(last=False)

    def preempt(self, seq_id: Hashable) -> None:
        """Release the sequence's blocks but keep it registered; its next admission counts apart."""
        s = self._get(seq_id)
        if s.table is None:
            raise SequenceStateError(f"sequence {seq_id!r} is not admitted; there is nothing to preempt")
        self._release(s)
        s.preempted = True
        self._counters.preemptions += 1

    def _release(self, s: _Sequence) -> None:
        if s.table is None:
            return
        self._pool._release_valid(self._release_order(s))  # the manager's own table: valid by construction
        self._clear_table(s)

    @staticmethod
    def _release_order(s: _Sequence) -> Iterable[int]:
        """The sequence's references, tail first (a pinned node right before its private copy's position)."""
        table = s.table
        if table is None:
            return ()
        pins = s.pins
        if not pins:
            return reversed(table)
        order = []
        for position in range(len(table) - 1, -1, -1):
            pinned = pins.get(position)
            if pinned is not None:
                order.append(pinned)
            order.append(table[position])
        return order

    @staticmethod
    def _clear_table(s: _Sequence) -> None:
        s.table = None
        s.view = None
        s.pins = None
        s.num_covered = s.num_committed = 0

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (after a weight update, say). Refused (False) while any block is in use."""
        if self._pool.num_in_use:
            return False
        self._tree.clear()
        return True

    # ------------------------------------------------------------------ statistics and checks

    @property
    def stats(self) -> CacheStats:
        pool = self._pool
        return CacheStats(
            **self._counters.as_dict(),
            evicted_blocks=self._tree.num_evicted,
            num_blocks=pool.num_blocks,
            blocks_in_use=pool.num_in_use,
            blocks_cached=len(self._tree),
            blocks_fresh=pool.num_fresh,
        )

    @property
    def block_lifetimes(self) -> BlockLifetimes:
        """Histograms of evicted device blocks' lifetime (allocation to eviction) and idle time (last release to
        eviction), in seconds of ``pool.clock``. Live objects: read them, do not change them."""
        return self._tree.lifetimes

    def check_integrity(self) -> None:
        """Raise :class:`IntegrityError` on any broken invariant of the pool, the tree or the sequences."""
        pool = self._pool
        tree = self._tree
        pool.check_integrity()
        tree.check_integrity()
        size = self._block_size
        expected = [0] * pool.num_blocks
        for seq_id, s in self._seqs.items():
            table = s.table
            if table is None:
                if s.pins or s.num_covered or s.num_committed:
                    raise IntegrityError(f"sequence {seq_id!r} is not admitted but carries table state")
                continue
            hashes = s.content.hashes
            if len(table) != -(-s.num_covered // size):
                raise IntegrityError(f"sequence {seq_id!r}: {len(table)} blocks for {s.num_covered} tokens")
            if len(set(table)) != len(table):
                raise IntegrityError(f"sequence {seq_id!r} holds a block twice: {table}")
            if not s.num_committed <= min(s.num_covered, s.content.num_tokens):
                raise IntegrityError(f"sequence {seq_id!r} committed {s.num_committed} beyond its tokens or slots")
            registered = s.num_committed // size if self._caching else 0  # blocks the tree must hold for it
            pins = s.pins or {}
            for position, block in enumerate(table):
                expected[block] += 1
                pinned = pins.get(position)
                if pinned is not None:
                    expected[pinned] += 1
                if position < registered:
                    node = tree.block_of(hashes[position])
                    if node is None or node != (block if pinned is None else pinned):
                        raise IntegrityError(f"sequence {seq_id!r} position {position}: cached node is {node}")
            if any(p >= registered for p in pins):
                raise IntegrityError(f"sequence {seq_id!r} pins a position beyond its registered blocks")
        self._count_other_holders(expected)
        for block in range(pool.num_blocks):
            if pool.ref_count(block) != expected[block]:
                raise IntegrityError(
                    f"block {block} has ref count {pool.ref_count(block)} but {expected[block]} holders"
                )
        self._check_release_order()

    def _count_other_holders(self, expected: list[int]) -> None:
        """Add references held by something other than sequences' tables and pins (none here)."""

    def _check_release_order(self) -> None:
        """A node in use has its parent in use; an idle node was released before its idle parent."""
        pool = self._pool
        tree = self._tree
        position = {b: i for i, b in enumerate(pool.idle_lru())}
        for b in range(pool.num_blocks):
            parent = tree.parent_of(b) if tree.hash_of(b) is not None else None
            if parent is None:
                continue
            if pool.ref_count(b) and not pool.ref_count(parent):
                raise IntegrityError(f"cached block {b} is in use but its parent {parent} is not")
            if b in position and parent in position and position[parent] < position[b]:
                raise IntegrityError(f"idle block {parent} was released before its idle child {b}")

    # ------------------------------------------------------------------ internals

    def _get(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            detail = "it was freed" if seq_id in self._freed else ""
            raise UnknownSequenceError(seq_id, detail) from None
        except TypeError:
            raise InvalidArgumentError(f"sequence id must be hashable, got {type(seq_id).__name__}") from None
