"""Where an admission finds each block a group keeps, and how a group takes new blocks.

A block an admission needs is on device (kept), in the group's host tier (a swap-in), known stored (a
load), or, for a handoff, on the prefill node (a copy). New blocks come from the group's pool: fresh
ones first, then idle cached ones its index evicts, whose content moves down to the group's tiers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvblocks.pool import BlockPool

if TYPE_CHECKING:  # annotations only
    from kvblocks.hashing import BlockHash

__all__ = ["DEVICE", "HOST", "REMOTE", "STORED", "EvictingIndex", "take_blocks"]

DEVICE, HOST, STORED, REMOTE = 0, 1, 2, 3


class EvictingIndex(Protocol):
    """A group's device index (the prefix tree, a flat index): it evicts idle blocks, naming their hashes."""

    def evict(self, count: int, removed_hashes: list[BlockHash] | None = None) -> list[int]: ...


class _Tiers(Protocol):
    def evict_from(self, index: EvictingIndex, count: int) -> None: ...


def take_blocks(pool: BlockPool, index: EvictingIndex, tiers: _Tiers | None, count: int) -> list[int]:
    """``count`` fresh blocks of a group's ``pool``, evicting idle cached ones from its ``index`` first when the
    fresh ones fall short (what they held moves down to ``tiers``, when the group has some)."""
    short = count - pool.num_fresh
    if short > 0:
        if tiers is None:
            index.evict(short)
        else:
            tiers.evict_from(index, short)
    return pool.take_fresh(count)
