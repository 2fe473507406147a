"""The cached blocks of one sliding-window or chunked-local group: hash -> block, any idle block evictable.

Full attention keeps its cached blocks in a :class:`~kvblocks.radix.PrefixTree`: a hit needs every block
before it, so a suffix is worthless without its prefix and eviction takes leaves only. A window group
needs only the blocks of its window (:func:`kvblocks.hybrid.hits.needed_blocks`), so a block whose
predecessors are gone still serves hits, and a running sequence releases the blocks that fall out of
its window while it runs. Such a group's index is therefore flat, and eviction takes the least recently
released idle block wherever it sits in its sequence::

    sequence blocks       0    1    2    3    4    5      window of 2 blocks
    released while
    running (outside)     x    x    x    .    .    .      0, 1, 2 idle (still cached, evictable)
    evict(2)              -    -    x    .    .    .      0 and 1 go first: oldest released

The pool is the same :class:`~kvblocks.pool.BlockPool` every group uses; this index is its content
index, as the prefix tree is for a full-attention group. Only committed blocks are inserted (the
manager's commit rule), so nothing unwritten is ever found here.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from kvblocks.errors import IntegrityError, InvalidArgumentError, InvalidBlockHashError, InvalidBlockIdError
from kvblocks.hashing import BlockHash
from kvblocks.pool import BlockPool

__all__ = ["FlatBlockIndex"]


class FlatBlockIndex:
    """Block hash -> block for one group; idle blocks are evicted least recently released first.

    >>> from kvblocks.pool import BlockPool
    >>> pool = BlockPool(4)
    >>> index = FlatBlockIndex(pool)
    >>> blocks = pool.take_fresh(2)
    >>> index.insert(b"h0", blocks[0]), index.insert(b"h1", blocks[1])
    (0, 1)
    >>> pool.release([blocks[0]])             # block 0 left the window: idle, still findable
    >>> index.block_of(b"h0"), index.evict(1), index.block_of(b"h0")
    (0, [0], None)
    """

    __slots__ = ("_block_of", "_hash_of", "num_evicted", "pool")

    def __init__(self, pool: BlockPool) -> None:
        if not isinstance(pool, BlockPool):
            raise InvalidArgumentError(f"pool must be a BlockPool, got {type(pool).__name__}")
        self.pool = pool
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: list[BlockHash | None] = [None] * pool.num_blocks
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

    def insert(self, block_hash: BlockHash, block: int) -> int:
        """Index held ``block`` under ``block_hash``; return the block now cached under it.

        When another block already holds that hash (two sequences computed the same block), that one
        stays the cached copy and is returned; ``block`` stays private to its sequence.
        """
        if isinstance(block_hash, bytes):
            valid = bool(block_hash)
        else:
            valid = isinstance(block_hash, int) and not isinstance(block_hash, bool) and block_hash >= 0
        if not valid:
            raise InvalidBlockHashError(f"a block hash must be non-empty bytes or an int >= 0, got {block_hash!r}")
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
        return block

    def insert_run(self, hashes: Sequence[BlockHash], blocks: Sequence[int], start: int, stop: int) -> None:
        """Index ``blocks[p]`` under ``hashes[p]`` for ``start <= p < stop``: a manager's commit of held blocks.

        The manager's own hashes and held blocks are valid by construction, so this skips
        :meth:`insert`'s argument checks; a hash already cached keeps its block (ours stays private).
        """
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

    def evict(self, count: int, removed_hashes: list[BlockHash] | None = None) -> list[int]:
        """Evict up to ``count`` idle blocks, least recently released first; they become fresh. Returns them."""
        if type(count) is not int or count < 0:
            raise InvalidArgumentError(f"cannot evict {count!r} blocks")
        pool = self.pool
        evicted = list(islice(pool.idle_lru(), count))
        for b in evicted:
            h = self._hash_of[b]
            if h is None:  # pragma: no cover - an idle block is always indexed (check_integrity)
                raise IntegrityError(f"idle block {b} is not in the index")
            pool.evict(b)
            del self._block_of[h]
            self._hash_of[b] = None
            if removed_hashes is not None:
                removed_hashes.append(h)
        self.num_evicted += len(evicted)
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
        for b in pool.idle_lru():
            if self._hash_of[b] is None:
                raise IntegrityError(f"idle block {b} is not indexed")
