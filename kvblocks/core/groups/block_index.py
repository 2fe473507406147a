"""The cached blocks of one sliding-window or chunked-local group: hash -> block, any idle block evictable.

Full attention keeps its cached blocks in a :class:`~kvblocks.core.prefix_tree.PrefixTree`: a hit needs every block
before it, so a suffix is worthless without its prefix and eviction takes leaves only. A window group
needs only the blocks of its window (:func:`kvblocks.core.groups.hits.needed_blocks`), so a block whose
predecessors are gone still serves hits, and a running sequence releases the blocks that fall out of
its window while it runs. Such a group's index is therefore flat, and eviction takes the least recently
released idle block wherever it sits in its sequence::

    sequence blocks       0    1    2    3    4    5      window of 2 blocks
    released while
    running (outside)     x    x    x    .    .    .      0, 1, 2 idle (still cached, evictable)
    evict(2)              -    -    x    .    .    .      0 and 1 go first: oldest released

The pool is the same :class:`~kvblocks.core.pool.BlockPool` every group uses; this index is its content
index, as the prefix tree is for a full-attention group. Only committed blocks are inserted (the
manager's commit rule), so nothing unwritten is ever found here.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from kvblocks.core.pool import BlockPool
from kvblocks.errors import (
    IntegrityError,
    InvalidArgumentError,
    InvalidBlockHashError,
    InvalidBlockIdError,
    SequenceStateError,
)
from kvblocks.events import EventSink
from kvblocks.events.codec import EVENT_GROUP_KINDS, BlockStored, is_group_tag, removed_event, stored_event
from kvblocks.hashing import BlockHash

__all__ = ["FlatBlockIndex"]


def _is_hash(value: object) -> bool:
    if isinstance(value, bytes):
        return bool(value)
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class FlatBlockIndex:
    """Block hash -> block for one group; idle blocks are evicted least recently released first.

    >>> from kvblocks.core.pool import BlockPool
    >>> pool = BlockPool(4)
    >>> index = FlatBlockIndex(pool)
    >>> blocks = pool.take_fresh(2)
    >>> index.insert(b"h0", blocks[0]), index.insert(b"h1", blocks[1])
    (0, 1)
    >>> pool.release([blocks[0]])             # block 0 left the window: idle, still findable
    >>> index.block_of(b"h0"), index.evict(1), index.block_of(b"h0")
    (0, [0], None)
    """

    __slots__ = (
        "_block_of",
        "_events",
        "_hash_of",
        "_parent_of",
        "_removed_event",
        "_stored_event",
        "group",
        "group_kind",
        "num_evicted",
        "pool",
        "tier",
    )

    def __init__(
        self,
        pool: BlockPool,
        *,
        events: EventSink | None = None,
        group: int | None = None,
        group_kind: str | None = None,
        tier: str = "device",
    ) -> None:
        """``events`` receives this index's events, tagged ``group`` / ``group_kind`` (the group's index in
        its manager and its kind; both None: untagged) and ``tier``."""
        if not isinstance(pool, BlockPool):
            raise InvalidArgumentError(f"pool must be a BlockPool, got {type(pool).__name__}")
        if events is not None and not isinstance(events, EventSink):
            raise InvalidArgumentError(f"events must be an EventSink or None, got {type(events).__name__}")
        if not is_group_tag(group, group_kind):
            raise InvalidArgumentError(
                f"group must be an int >= 0 and group_kind one of {', '.join(EVENT_GROUP_KINDS)}, both or neither; "
                f"got {group!r}, {group_kind!r}"
            )
        if type(tier) is not str:
            raise InvalidArgumentError(f"tier must be a str, got {tier!r}")
        self.pool = pool
        self.tier = tier
        self.group = group
        self.group_kind = group_kind
        self._events = events
        # what its events are built with, off the hot path (EventSink.record)
        self._stored_event = partial(stored_event, tier, group, group_kind, None)
        self._removed_event = partial(removed_event, tier, group, group_kind)
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: list[BlockHash | None] = [None] * pool.num_blocks
        # The chain parent of each indexed block, for snapshot_events: kept only with a sink (no cost without).
        self._parent_of: list[BlockHash | None] | None = None if events is None else [None] * pool.num_blocks
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._block_of)

    def __contains__(self, block_hash: object) -> bool:
        try:
            return block_hash in self._block_of
        except TypeError:
            return False

    def block_of(self, block_hash: BlockHash) -> int | None:
        """The block cached under ``block_hash``, or None. Pure (a hit is taken by acquiring it)."""
        return self._block_of.get(block_hash)

    def hash_of(self, block: int) -> BlockHash | None:
        self.pool._check_id(block)
        return self._hash_of[block]

    @property
    def events(self) -> EventSink | None:
        """The sink this index emits to (None: it emits nothing)."""
        return self._events

    def insert(self, block_hash: BlockHash, block: int, *, parent_hash: BlockHash | None = None) -> int:
        """Index held ``block`` under ``block_hash``; return the block now cached under it.

        When another block already holds that hash (two sequences computed the same block), that one
        stays the cached copy and is returned; ``block`` stays private to its sequence. ``parent_hash``
        is the chain's previous hash (None: the chain's first block), carried by the ``BlockStored``
        this emits when the hash is new.
        """
        valid = _is_hash(block_hash)
        if not valid or not (parent_hash is None or _is_hash(parent_hash)) or parent_hash == block_hash:
            raise InvalidBlockHashError(
                f"a block hash (and a parent hash, unless None) must be non-empty bytes or an int >= 0, and they "
                f"must differ; got {block_hash!r}, parent {parent_hash!r}"
            )
        pool = self.pool
        pool._check_id(block)
        existing = self._block_of.get(block_hash)
        if existing is not None:
            return existing
        if self._hash_of[block] is not None:
            raise InvalidBlockIdError(f"block {block} already caches another hash")
        pool.mark_cached(block, block_hash)  # raises unless the block is held
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        if self._parent_of is not None:
            self._parent_of[block] = parent_hash
            self._stored((block_hash,), parent_hash)
        return block

    def _stored(self, hashes: tuple[BlockHash, ...], parent_hash: BlockHash | None) -> None:
        self._events.record(self._stored_event, hashes, parent_hash, None, None)  # type: ignore[union-attr]

    def insert_run(self, hashes: Sequence[BlockHash], blocks: Sequence[int], start: int, stop: int) -> None:
        """Index ``blocks[p]`` under ``hashes[p]`` for ``start <= p < stop``: a manager's commit of held blocks.

        The manager's own hashes and held blocks are valid by construction, so this skips
        :meth:`insert`'s argument checks; a hash already cached keeps its block (ours stays private).
        With a sink, each run of consecutive newly indexed positions is one ``BlockStored`` whose
        parent is the hash before the run (see the module docstring).
        """
        if self._parent_of is not None:
            self._insert_run_emitting(hashes, blocks, start, stop)
            return
        block_of = self._block_of
        hash_of = self._hash_of
        key = self.pool._key
        for position in range(start, stop):
            h = hashes[position]
            if h not in block_of:
                b = blocks[position]
                block_of[h] = b
                hash_of[b] = h
                key[b] = h

    def _insert_run_emitting(self, hashes: Sequence[BlockHash], blocks: Sequence[int], start: int, stop: int) -> None:
        block_of = self._block_of
        hash_of = self._hash_of
        parent_of = self._parent_of
        key = self.pool._key
        run: list[BlockHash] = []
        run_parent: BlockHash | None = None
        for position in range(start, stop):
            h = hashes[position]
            if h in block_of:
                if run:
                    self._stored(tuple(run), run_parent)
                    run = []
                continue
            parent = hashes[position - 1] if position else None
            if not run:
                run_parent = parent
            run.append(h)
            b = blocks[position]
            block_of[h] = b
            hash_of[b] = h
            key[b] = h
            parent_of[b] = parent  # type: ignore[index]  # kept with a sink
        if run:
            self._stored(tuple(run), run_parent)

    def snapshot_events(self) -> list[BlockStored]:
        """The whole index as ``BlockStored`` events, parents (when indexed) before their children. Pure.

        Consecutive hashes of one chain share an event while each has exactly one indexed child, as in
        :meth:`kvblocks.core.prefix_tree.PrefixTree.snapshot_events`; a chain whose parent is not indexed here starts
        an event of its own with that parent hash. Needs a sink: the parents are kept only with one.
        """
        parent_of = self._parent_of
        if parent_of is None:
            raise SequenceStateError("an index without an event sink keeps no chain parents: no snapshot")
        children: dict[BlockHash | None, list[BlockHash]] = {}
        for h, b in self._block_of.items():
            children.setdefault(parent_of[b], []).append(h)
        block_of = self._block_of
        roots = [h for h, b in block_of.items() if parent_of[b] is None or parent_of[b] not in block_of]
        out: list[BlockStored] = []
        left = dict(block_of)
        stack = roots[::-1]
        while stack or left:
            # what no root reaches (parents claimed in a cycle through insert's parent_hash) goes alone
            h = stack.pop() if stack else next(iter(left))
            chain = [h]
            del left[h]
            kids = children.get(h)
            while kids is not None and len(kids) == 1 and kids[0] in left:
                chain.append(kids[0])
                del left[kids[0]]
                kids = children.get(kids[0])
            parent = parent_of[block_of[h]]
            out.append(BlockStored(tuple(chain), parent, self.tier, None, self.group, self.group_kind))
            if kids:
                stack.extend(k for k in reversed(kids) if k in left)
        return out

    def evict(
        self,
        count: int,
        removed_hashes: list[BlockHash] | None = None,
        removed_chains: list[tuple[BlockHash | None, bytes | None]] | None = None,
    ) -> list[int]:
        """Evict up to ``count`` idle blocks in the pool's eviction order (LRU: least recently released first);
        they become fresh. Returns them. ``removed_hashes`` / ``removed_chains`` as the prefix tree's: this
        index keeps no chains, so each chain is ``(None, None)``."""
        if type(count) is not int or count < 0:
            raise InvalidArgumentError(f"cannot evict {count!r} blocks")
        pool = self.pool
        # the pool's policy chooses and drops them from the idle set; IDLE -> FRESH is inlined on this hot path
        evicted = pool._policy.victims(count)
        removed = removed_hashes if removed_hashes is not None or self._events is None else []
        hash_of = self._hash_of
        block_of = self._block_of
        key = pool._key
        fresh_append = pool._fresh.append
        for b in evicted:
            h = hash_of[b]
            if h is None:  # pragma: no cover - an idle block is always indexed (check_integrity)
                raise IntegrityError(f"idle block {b} is not in the index")
            key[b] = None
            fresh_append(b)
            del block_of[h]
            hash_of[b] = None
            if removed is not None:
                removed.append(h)
        self.num_evicted += len(evicted)
        if removed_chains is not None:
            removed_chains.extend([(None, None)] * len(evicted))
        if evicted and self._events is not None:
            # our own list when the caller gave none (nobody changes it later), else the batch's part of theirs
            mine = removed if removed_hashes is None else removed[-len(evicted) :]  # type: ignore[index]
            self._events.record(self._removed_event, mine)
        return evicted

    def clear(self) -> list[int]:
        """Drop every idle cached block (blocks in use keep their content until released). Returns them."""
        return self.evict(self.pool.num_idle)

    def check_integrity(self) -> None:
        """The index and the pool agree: every indexed block is cached under its hash, every idle block indexed."""
        pool = self.pool
        for h, b in self._block_of.items():
            if self._hash_of[b] != h or pool.content_key(b) != h:
                raise IntegrityError(f"block {b} is indexed under {h!r} but holds {self._hash_of[b]!r}")
            if not pool.ref_count(b) and not pool.is_idle(b):
                raise IntegrityError(f"indexed block {b} is neither in use nor idle")
        if sum(h is not None for h in self._hash_of) != len(self._block_of):
            raise IntegrityError("the block -> hash table and the hash -> block table differ in size")
        for b in pool.idle_order():
            if self._hash_of[b] is None:
                raise IntegrityError(f"idle block {b} is not indexed")
