"""Where an admission finds each block a group keeps, and how a group takes new blocks.

A block an admission needs is on device (kept), in the group's host tier (a swap-in), known stored (a
load), or, for a handoff, on the prefill node (a copy). New blocks come from the group's pool: fresh
ones first, then idle cached ones its index evicts, whose content moves down to the group's tiers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from kvblocks.core.pool import BlockPool

if TYPE_CHECKING:  # annotations only
    from kvblocks.hashing import BlockHash

__all__ = ["DEVICE", "HOST", "REMOTE", "STORED", "EvictingIndex", "GroupTiers", "take_blocks"]

DEVICE, HOST, STORED, REMOTE = 0, 1, 2, 3


class EvictingIndex(Protocol):
    """A group's device index (the prefix tree, a flat index): it evicts idle blocks, naming their hashes."""

    def evict(
        self,
        count: int,
        removed_hashes: list[BlockHash] | None = None,
        removed_chains: list[tuple[BlockHash | None, bytes | None]] | None = None,
    ) -> list[int]: ...


class GroupTiers(Protocol):
    """What a group asks of its tiers (:class:`~kvblocks.tiers.stack.TierStack`, which sits above the groups)."""

    writes_through: bool
    """Whether committed blocks are copied down as they are committed."""

    def where(self, key: BlockHash) -> tuple[int, int] | None:
        """``(HOST, host block)``, ``(STORED, -1)``, or None: where the tiers hold ``key``."""
        ...

    def holds(self, key: BlockHash) -> bool: ...

    def acquire_host(self, blocks: list[int]) -> None:
        """Hold host blocks a swap-in reads (an eviction cannot take them until the plan completes)."""
        ...

    def evict_from(self, index: EvictingIndex, count: int) -> None:
        """Evict ``count`` idle blocks from the group's index; their content moves down (write-back)."""
        ...

    def written(
        self,
        block_of: Callable[[BlockHash], int | None],
        keys: Sequence[BlockHash],
        start: int,
        stop: int,
        tokens: Sequence[int] | None = None,
    ) -> None:
        """Positions ``[start, stop)`` were just committed (write-through); ``tokens``: the sequence's, if known."""
        ...


def take_blocks(pool: BlockPool, index: EvictingIndex, tiers: GroupTiers | None, count: int) -> list[int]:
    """``count`` fresh blocks of a group's ``pool``, evicting idle cached ones from its ``index`` first when the
    fresh ones fall short (what they held moves down to ``tiers``, when the group has some)."""
    short = count - len(pool._fresh)  # package-private: once per block a decoding sequence fills
    if short > 0:
        if tiers is None:
            index.evict(short)
        else:
            tiers.evict_from(index, short)
    return pool.take_fresh(count)
