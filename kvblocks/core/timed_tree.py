"""The device prefix tree that records evicted blocks' lifetimes (moved from :mod:`kvblocks.manager`)."""

from __future__ import annotations

from kvblocks.accounting import BlockLifetimes
from kvblocks.core.pool import BlockPool
from kvblocks.core.prefix_tree import PrefixTree
from kvblocks.events import EventSink

__all__: list[str] = []


class _TimedTree(PrefixTree):
    """The device prefix tree, recording evicted blocks' lifetime and idle time when it evicts them.

    A subclass rather than a hook in :meth:`KVCacheManager._take`, so that every eviction of
    the device tier -- the tiered and disaggregated managers' own ``_take`` included -- is seen.
    It costs nothing off the eviction path and allocates nothing per block on it: the eviction
    policy hands over the victims' idle stamps as it drops them.
    """

    __slots__ = ("lifetimes",)

    def __init__(
        self,
        pool: BlockPool,
        *,
        events: EventSink | None,
        group: int | None = None,
        group_kind: str | None = None,
        block_size: int | None = None,
    ) -> None:
        super().__init__(pool, tier="device", events=events, group=group, group_kind=group_kind, block_size=block_size)
        self.lifetimes = BlockLifetimes()

    def _victims(self, count: int) -> list[int]:
        pool = self.pool
        stamps: list[float] = []  # when each victim became idle
        evicted = pool._policy.victims(count, self._num_children, self._parent_of, stamps)
        if evicted and not self.lifetimes.passes_over(len(evicted)):
            self.lifetimes.observe(pool.clock(), pool._taken_at, zip(evicted, stamps), len(evicted))
        return evicted
