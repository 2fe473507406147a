"""BlockPool: the fixed set of block ids ``0..N-1`` and who holds them.

Every block is in exactly one of three states::

    FRESH   ref 0, holds nothing findable      -> in the fresh queue, handed out first
    IN USE  ref > 0, held by one or more owners
    IDLE    ref 0, holds cached content         -> known to the eviction policy, evictable

    take_fresh:  FRESH -> IN USE          acquire: IDLE -> IN USE (a cache hit)
    release:     IN USE -> IDLE if the block is marked cached, else -> FRESH
    evict:       IDLE -> FRESH (the content index dropped it)

The pool knows nothing about hashes or tensors. The content index above it
(:class:`kvblocks.core.prefix_tree.PrefixTree`) records an opaque *content key* on a block when
its content becomes findable (a block with a key is "cached") and chooses which
idle block to evict, among those its :class:`~kvblocks.core.eviction.EvictionPolicy` offers (LRU by
default: least recently released first); the pool keeps the states, the reference counts, the keys
and the fresh queue, and tells the policy about every block that becomes idle or leaves idle. Every
operation is O(1) per block, and a batch either applies completely or raises and leaves the pool as
it was.

The content index is the pool's one privileged user: for speed it reads and
writes ``_ref``, ``_key``, ``_fresh`` and ``_idle`` (the policy's mapping of idle blocks) and asks
``_policy`` for victims directly, keeping the states
above. The manager may call the unchecked ``_acquire_valid`` / ``_release_valid``
for ids that are valid by construction. Nothing else may do either.

For the block lifetime statistics (:class:`kvblocks.accounting.BlockLifetimes`) the pool
stamps each block, with its ``clock``, when it is handed out fresh (``_taken_at``) and
when it becomes idle (its value in the policy's ``idle`` mapping, which costs nothing more than the
``None`` it would hold): one clock reading per batch, at transitions that already walk the block.
The policy hands the stamps of the blocks it evicts to whoever asks (``victims(..., stamps=)``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, KeysView, MutableMapping, Sequence

from kvblocks.core.eviction import DEFAULT_EVICTION, EvictionPolicy, check_eviction, make_policy
from kvblocks.errors import ConfigError, DoubleFreeError, IntegrityError, InvalidArgumentError, InvalidBlockIdError

__all__ = ["BYTES_PER_BLOCK", "BlockPool", "check_pool_size"]

BYTES_PER_BLOCK = 96
"""Host memory one block's bookkeeping takes, rounded up: the pool's lists and queues hold about 64 bytes a
block and a manager about 16 more (tracemalloc, 10**6 blocks). A pool that would need more than the memory
available is refused up front rather than killed by the OOM killer halfway through building it."""

_ASK_ABOVE = 1 << 28
"""Bookkeeping up to 256 MiB (about 2.8 million blocks) is created without asking the OS what is free."""


_CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
)


def _available_memory() -> int | None:
    """Bytes a new allocation can get: Linux's MemAvailable, lowered to a cgroup's remaining limit; None if unknown."""
    found: list[int] = []
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo", "rb") as meminfo:
        found += [int(line.split()[1]) * 1024 for line in meminfo if line.startswith(b"MemAvailable:")]
    for limit, usage in _CGROUP_FILES:
        with contextlib.suppress(OSError, ValueError), open(limit, "rb") as a, open(usage, "rb") as b:
            found.append(int(a.read()) - int(b.read()))  # "max" (no limit) is not an int: skipped
    if not found and hasattr(os, "sysconf"):
        with contextlib.suppress(OSError, ValueError):
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return min(found) if found else None


def check_pool_size(num_blocks: int) -> None:
    """Refuse (``ConfigError``, naming both figures) a pool whose bookkeeping would not fit the free memory."""
    needed = num_blocks * BYTES_PER_BLOCK
    if needed <= _ASK_ABOVE:
        return
    available = _available_memory()
    if available is not None and needed > available:
        raise ConfigError(
            f"num_blocks={num_blocks:,} needs about {needed / 2**30:,.1f} GiB of memory for its bookkeeping "
            f"({BYTES_PER_BLOCK} bytes a block), but {max(0, available) / 2**30:,.1f} GiB is available"
        )


class BlockPool:
    """Reference counts, a fresh queue and an eviction policy's idle order over block ids ``0..num_blocks-1``.

    ``eviction`` names the policy (:data:`~kvblocks.core.eviction.EVICTION_POLICIES`): ``"lru"`` (default)
    or ``"s3fifo"``.

    >>> pool = BlockPool(4)
    >>> pool.take_fresh(2)
    [0, 1]
    >>> pool.mark_cached(0, "h0")  # block 0's content became findable under key "h0"
    >>> pool.release([1, 0])       # 1 -> fresh (end of queue), 0 -> idle LRU
    >>> list(pool.fresh_order()), list(pool.idle_lru())
    ([2, 3, 1], [0])
    """

    __slots__ = ("_eviction", "_fresh", "_idle", "_key", "_policy", "_ref", "_taken_at", "clock", "num_blocks")

    def __init__(
        self, num_blocks: int, *, clock: Callable[[], float] = time.monotonic, eviction: str = DEFAULT_EVICTION
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ConfigError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not callable(clock):
            raise ConfigError(f"clock must be a callable returning seconds, got {clock!r}")
        check_eviction(eviction)
        check_pool_size(num_blocks)
        self.num_blocks = num_blocks
        self.clock = clock
        """Seconds, monotonic: stamps blocks for the lifetime statistics (replace it in tests)."""
        self._taken_at = [0.0] * num_blocks  # when each block was last handed out fresh
        self._ref = [0] * num_blocks
        self._fresh: deque[int] = deque(range(num_blocks))
        self._key: list[object | None] = [None] * num_blocks
        self._eviction = eviction
        self._policy: EvictionPolicy = make_policy(eviction, num_blocks, self._key)
        self._idle: MutableMapping[int, float] = self._policy.idle  # block -> when it became idle, policy's order

    # ------------------------------------------------------------------ queries

    @property
    def num_fresh(self) -> int:
        return len(self._fresh)

    @property
    def eviction(self) -> str:
        """The eviction policy as given (``"lru"``, ``"s3fifo:0.75"``, ...)."""
        return self._eviction

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy (read it; the pool and its content index change it)."""
        return self._policy

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
        return self._key[block] is not None

    def content_key(self, block: int) -> object | None:
        """The key the content index registered for ``block`` (None: it holds nothing findable)."""
        self._check_id(block)
        return self._key[block]

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def idle_since(self, block: int) -> float:
        """When idle ``block`` last became idle (the pool's ``clock``)."""
        if not self.is_idle(block):
            raise InvalidBlockIdError(f"block {block!r} is not idle")
        return self._idle[block]

    def count_idle(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` are idle (acquiring them would shrink the evictable supply)."""
        try:
            if blocks and min(blocks) < 0:
                raise IndexError
            return list(map(self._ref.__getitem__, blocks)).count(0)
        except (IndexError, TypeError):
            raise InvalidBlockIdError(f"block ids must be ints in 0..{self.num_blocks - 1}") from None

    def fresh_order(self) -> deque[int]:
        """The fresh queue, next-to-hand-out first (a live view; do not mutate)."""
        return self._fresh

    def idle_order(self) -> KeysView[int]:
        """The idle blocks in the policy's order, likely next victims first (LRU: least recently released
        first); a live view."""
        return self._idle.keys()

    def idle_lru(self) -> KeysView[int]:
        """:meth:`idle_order`: least recently released first with the LRU policy (a live view)."""
        return self._idle.keys()

    # ------------------------------------------------------------------ transitions

    def take_fresh(self, count: int) -> list[int]:
        """Hand out ``count`` fresh blocks (FRESH -> IN USE, ref 1), in queue order."""
        fresh = self._fresh
        if type(count) is not int or count < 0 or count > len(fresh):
            raise InvalidArgumentError(f"cannot take {count} fresh blocks: {len(fresh)} are fresh")
        ref = self._ref
        taken_at = self._taken_at
        now = self.clock()
        if count == 1:  # a decoding sequence's next block
            b = fresh.popleft()
            ref[b] = 1
            taken_at[b] = now
            return [b]
        popleft = fresh.popleft
        out = [popleft() for _ in range(count)]
        for b in out:
            ref[b] = 1
            taken_at[b] = now
        return out

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take one more reference on each block; idle blocks leave the idle set (a cache hit).

        Only IN USE or IDLE blocks can be acquired: a fresh block holds no content worth
        sharing and is obtained with :meth:`take_fresh`.
        """
        n = self.num_blocks
        ref = self._ref
        idle = self._idle
        for b in blocks:  # validate everything first: a position in the idle order could not be restored
            if not (type(b) is int and 0 <= b < n):
                raise InvalidBlockIdError(f"block id {b!r} is not an int in 0..{n - 1}")
            if not ref[b] and b not in idle:
                raise InvalidBlockIdError(f"block {b} is fresh; fresh blocks are handed out by take_fresh")
        self._acquire_valid(blocks)

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block, in order; blocks reaching 0 become IDLE or FRESH.

        The order matters: blocks reaching zero reach the eviction policy (or the back of the
        fresh queue) in the order given, so pass a sequence's blocks tail first to make
        its tail evictable before its head.
        """
        n = self.num_blocks
        ref = self._ref
        for b in blocks:  # validate everything first
            if not (type(b) is int and 0 <= b < n):
                raise InvalidBlockIdError(f"block id {b!r} is not an int in 0..{n - 1}")
        for b, times in Counter(blocks).items():
            if ref[b] < times:
                raise DoubleFreeError(f"block {b} released more often than it was taken (ref count {ref[b]})")
        self._release_valid(blocks)

    # The unchecked halves of acquire/release: for callers inside kvblocks whose block ids are valid
    # by construction (the manager releasing its own table, acquiring blocks the tree just matched).

    def _acquire_valid(self, blocks: Iterable[int]) -> None:
        ref = self._ref
        idle = self._idle  # the policy's: deleting an entry is a hit
        for b in blocks:
            r = ref[b]
            if not r:
                del idle[b]
            ref[b] = r + 1

    def _release_valid(self, blocks: Iterable[int]) -> None:
        ref = self._ref
        idle = self._idle  # the policy's: setting an entry makes the block evictable
        fresh_append = self._fresh.append
        key = self._key
        now = None  # the clock is read once, and only when a block turns idle (most releases do not)
        for b in blocks:
            r = ref[b] - 1
            ref[b] = r
            if not r:
                if key[b] is None:
                    fresh_append(b)
                else:
                    if now is None:
                        now = self.clock()
                    idle[b] = now

    def mark_cached(self, block: int, key: object = True) -> None:
        """Record that ``block`` (in use) now holds content findable under ``key``: at ref 0 it becomes IDLE."""
        self._check_id(block)
        if self._ref[block] == 0:
            raise InvalidBlockIdError(f"block {block} is not in use; only a held block can become cached")
        if key is None:
            raise InvalidArgumentError("a content key cannot be None")
        self._key[block] = key

    def evict(self, block: int) -> None:
        """IDLE -> FRESH: the content index dropped this block's content. Joins the back of the fresh queue."""
        try:
            self._policy.remove(block)
        except (KeyError, IndexError, TypeError):
            raise InvalidBlockIdError(f"block {block!r} is not idle and cannot be evicted") from None
        self._key[block] = None
        self._fresh.append(block)

    # ------------------------------------------------------------------ checks

    def check_integrity(self) -> None:
        """Raise :class:`IntegrityError` unless every block is in exactly one state."""
        fresh = set(self._fresh)
        idle = set(self._idle)
        if len(idle) != len(self._idle):
            raise IntegrityError(
                f"the {self._policy.name} policy counts {len(self._idle)} idle blocks, lists {len(idle)}"
            )
        self._policy.check_integrity()
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
            if b in fresh and self._key[b] is not None:
                raise IntegrityError(f"fresh block {b} is marked cached")
            if b in idle and self._key[b] is None:
                raise IntegrityError(f"idle block {b} is not marked cached")

    # ------------------------------------------------------------------ internals

    def _check_id(self, block: int) -> None:
        if not (type(block) is int and 0 <= block < self.num_blocks):
            raise InvalidBlockIdError(f"block id {block!r} is not an int in 0..{self.num_blocks - 1}")
