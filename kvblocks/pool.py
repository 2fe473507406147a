"""BlockPool: the fixed set of block ids ``0..N-1`` and who holds them.

Every block is in exactly one of three states::

    FRESH   ref 0, holds nothing findable      -> in the fresh queue, handed out first
    IN USE  ref > 0, held by one or more owners
    IDLE    ref 0, holds cached content         -> in the idle LRU (oldest first), evictable

    take_fresh:  FRESH -> IN USE          acquire: IDLE -> IN USE (a cache hit)
    release:     IN USE -> IDLE if the block is marked cached, else -> FRESH
    evict:       IDLE -> FRESH (the content index dropped it)

The pool knows nothing about hashes or tensors. The content index above it
(:class:`kvblocks.radix.PrefixTree`) marks blocks cached when their content becomes
findable and chooses which idle block to evict; the pool keeps the states, the
reference counts and the two orders. Every operation is O(1) per block, and a
batch either applies completely or raises and leaves the pool as it was.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import KeysView, Sequence

from kvblocks.errors import ConfigError, DoubleFreeError, IntegrityError, InvalidArgumentError, InvalidBlockIdError

__all__ = ["BlockPool"]


class BlockPool:
    """Reference counts, a fresh queue and an idle LRU over block ids ``0..num_blocks-1``.

    >>> pool = BlockPool(4)
    >>> pool.take_fresh(2)
    [0, 1]
    >>> pool.mark_cached(0)        # block 0's content became findable
    >>> pool.release([1, 0])       # 1 -> fresh (end of queue), 0 -> idle LRU
    >>> list(pool.fresh_order()), list(pool.idle_lru())
    ([2, 3, 1], [0])
    """

    __slots__ = ("num_blocks", "_ref", "_fresh", "_idle", "_cached")

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ConfigError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._fresh: deque[int] = deque(range(num_blocks))
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._cached = bytearray(num_blocks)

    # ------------------------------------------------------------------ queries

    @property
    def num_fresh(self) -> int:
        return len(self._fresh)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    @property
    def num_free(self) -> int:
        """Blocks that an allocation can obtain: fresh ones plus evictable idle ones."""
        return len(self._fresh) + len(self._idle)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - len(self._fresh) - len(self._idle)

    def ref_count(self, block: int) -> int:
        self._check_id(block)
        return self._ref[block]

    def is_cached(self, block: int) -> bool:
        self._check_id(block)
        return bool(self._cached[block])

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def count_idle(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` are idle (acquiring them would shrink the evictable supply)."""
        ref = self._ref
        return sum(1 for b in blocks if ref[b] == 0)

    def fresh_order(self) -> deque[int]:
        """The fresh queue, next-to-hand-out first (a live view; do not mutate)."""
        return self._fresh

    def idle_lru(self) -> KeysView[int]:
        """The idle blocks, least recently released first (a live view)."""
        return self._idle.keys()

    # ------------------------------------------------------------------ transitions

    def take_fresh(self, count: int) -> list[int]:
        """Hand out ``count`` fresh blocks (FRESH -> IN USE, ref 1), in queue order."""
        fresh = self._fresh
        if count < 0 or count > len(fresh):
            raise InvalidArgumentError(f"cannot take {count} fresh blocks: {len(fresh)} are fresh")
        ref = self._ref
        popleft = fresh.popleft
        out = [popleft() for _ in range(count)]
        for b in out:
            ref[b] = 1
        return out

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take one more reference on each block; idle blocks leave the LRU (a cache hit).

        Only IN USE or IDLE blocks can be acquired: a fresh block holds no content worth
        sharing and is obtained with :meth:`take_fresh`.
        """
        ref = self._ref
        idle = self._idle
        n = self.num_blocks
        for b in blocks:  # validate everything first: an LRU position cannot be restored
            if not (type(b) is int and 0 <= b < n) or (ref[b] == 0 and b not in idle):
                raise InvalidBlockIdError(self._acquire_problem(b))
        for b in blocks:
            if ref[b] == 0:
                del idle[b]
            ref[b] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block, in order; blocks reaching 0 become IDLE or FRESH.

        The order matters: blocks reaching zero join the back of the idle LRU (or of the
        fresh queue) in the order given, so pass a sequence's blocks tail first to make
        its tail evictable before its head.
        """
        ref = self._ref
        idle = self._idle
        fresh = self._fresh
        cached = self._cached
        n = self.num_blocks
        for i, b in enumerate(blocks):
            if not (type(b) is int and 0 <= b < n) or ref[b] == 0:
                self._undo_release(blocks, i)
                if type(b) is int and 0 <= b < n:
                    raise DoubleFreeError(f"block {b} released more often than it was taken (ref count is 0)")
                raise InvalidBlockIdError(f"block id {b!r} is not an int in 0..{n - 1}")
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                if cached[b]:
                    idle[b] = None
                else:
                    fresh.append(b)

    def mark_cached(self, block: int) -> None:
        """Record that ``block`` (in use) now holds findable content: at ref 0 it becomes IDLE."""
        self._check_id(block)
        if self._ref[block] == 0:
            raise InvalidBlockIdError(f"block {block} is not in use; only a held block can become cached")
        self._cached[block] = 1

    def evict(self, block: int) -> None:
        """IDLE -> FRESH: the content index dropped this block's content. Joins the back of the fresh queue."""
        try:
            del self._idle[block]
        except KeyError:
            raise InvalidBlockIdError(f"block {block!r} is not idle and cannot be evicted") from None
        self._cached[block] = 0
        self._fresh.append(block)

    # ------------------------------------------------------------------ checks

    def check_integrity(self) -> None:
        """Raise :class:`IntegrityError` unless every block is in exactly one state."""
        fresh = set(self._fresh)
        idle = set(self._idle)
        if len(fresh) != len(self._fresh):
            raise IntegrityError("a block appears twice in the fresh queue")
        if fresh & idle:
            raise IntegrityError(f"blocks both fresh and idle: {sorted(fresh & idle)}")
        for b in range(self.num_blocks):
            r = self._ref[b]
            if r < 0:
                raise IntegrityError(f"block {b} has negative ref count {r}")
            in_use = r > 0
            states = in_use + (b in fresh) + (b in idle)
            if states != 1:
                raise IntegrityError(f"block {b} is in {states} states (ref {r}, fresh {b in fresh}, idle {b in idle})")
            if b in fresh and self._cached[b]:
                raise IntegrityError(f"fresh block {b} is marked cached")
            if b in idle and not self._cached[b]:
                raise IntegrityError(f"idle block {b} is not marked cached")

    # ------------------------------------------------------------------ internals

    def _check_id(self, block: int) -> None:
        if not (type(block) is int and 0 <= block < self.num_blocks):
            raise InvalidBlockIdError(f"block id {block!r} is not an int in 0..{self.num_blocks - 1}")

    def _acquire_problem(self, b: object) -> str:
        if not (type(b) is int and 0 <= b < self.num_blocks):
            return f"block id {b!r} is not an int in 0..{self.num_blocks - 1}"
        return f"block {b} is fresh; fresh blocks are handed out by take_fresh, not acquired"

    def _undo_release(self, blocks: Sequence[int], upto: int) -> None:
        ref = self._ref
        for j in range(upto - 1, -1, -1):
            b = blocks[j]
            if ref[b] == 0:
                if self._cached[b]:
                    self._idle.popitem(last=True)
                else:
                    self._fresh.pop()
            ref[b] += 1
