"""The tier component's state: its counters, the step plans and the pending admissions, one entry per group."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kvblocks.core.groups.protocol import GroupCopies
from kvblocks.core.sequence import _Sequence
from kvblocks.errors import IntegrityError
from kvblocks.hashing import BlockHash
from kvblocks.tiers.storage_tier import StorageTierStats
from kvblocks.tiers.transfers import BlockSave, GroupTransfers, TransferPlan
from kvblocks.tiers.writer import WriterStats

__all__ = ["TierStats"]


@dataclass(frozen=True)
class TierStats:
    """A snapshot of the tiers' counters (blocks, every group's) next to :attr:`KVCacheManager.stats`;
    ``storage`` and ``writer`` are group 0's."""

    host_blocks: int
    host_blocks_cached: int
    host_evicted: int
    swap_outs: int
    swap_out_failures: int
    swap_ins: int
    swap_in_failures: int
    write_backs_without_host_room: int
    saves_planned: int
    saves_without_payload: int
    storage: StorageTierStats | None
    writer: WriterStats | None


@dataclass
class _Counts:
    swap_outs: int = 0
    swap_out_failures: int = 0
    swap_ins: int = 0
    swap_in_failures: int = 0
    write_backs_without_host_room: int = 0
    saves_planned: int = 0
    saves_without_payload: int = 0


class _Pending:
    """One group's copies of a pending admission, and what landed of them."""

    __slots__ = ("copies", "loaded", "request", "swapped")

    def __init__(self, copies: GroupCopies) -> None:
        self.copies = copies
        self.swapped: set[int] | None = None if copies.swaps else set()  # positions whose swap-in landed
        self.loaded: set[int] | None = None if copies.loads else set()  # positions the storage read filled
        self.request = -1  # the group's storage read, while it is outstanding

    @property
    def settled(self) -> bool:
        return self.swapped is not None and self.loaded is not None


class _Admission:
    """An admitted sequence whose cached prefix beyond the device is still being copied in.

    ``hit`` chain blocks are what every group serves once the copies land; group 0 holds its first
    ``device`` of them on device already. ``groups[g]`` is group ``g``'s copies (None: none).
    """

    __slots__ = (
        "cancelled",
        "deadline",
        "device",
        "groups",
        "hit",
        "load_plan",
        "readmission",
        "seq",
        "seq_id",
        "swap_plan",
    )

    def __init__(
        self, seq_id: Hashable, seq: _Sequence, hit: int, device: int, copies: Sequence[GroupCopies | None]
    ) -> None:
        self.seq_id = seq_id
        self.seq = seq
        self.hit = hit
        self.device = device
        self.groups = [None if c is None else _Pending(c) for c in copies]
        self.readmission = seq.preempted
        self.swap_plan = -1  # the plan holding its swap-ins (-1: none)
        self.load_plan = -1  # the plan open when its storage reads were queued
        self.deadline = 0.0
        self.cancelled = False

    def part(self, number: int) -> _Pending:
        """Group ``number``'s copies (the caller knows it has some)."""
        pending = self.groups[number]
        if pending is None:
            raise IntegrityError(f"pending admission of {self.seq_id!r} has no copies in group {number}")
        return pending

    @property
    def swaps_reported(self) -> bool:
        return all(p is None or p.swapped is not None for p in self.groups)

    @property
    def settled(self) -> bool:
        return all(p is None or p.settled for p in self.groups)


class _GroupPlan:
    """One group's part of a step's plan."""

    __slots__ = ("deferred", "queued", "saves", "swap_ins", "swap_outs")

    def __init__(self) -> None:
        self.saves: list[BlockSave] = []
        self.swap_outs: list[tuple[int, int, BlockHash]] = []  # device, host, hash
        self.swap_ins: list[tuple[int, int, _Admission, int]] = []  # host, device, admission, position
        self.deferred: list[list[int]] = []  # device release orders to run when the plan completes
        self.queued: set[BlockHash] = set()  # hashes with a save in this plan

    def busy(self) -> bool:
        return bool(self.saves or self.swap_outs or self.swap_ins or self.deferred)

    def frozen(self, number: int) -> GroupTransfers:
        return GroupTransfers(
            number,
            tuple((d, h) for d, h, _ in self.swap_outs),
            tuple((h, d) for h, d, _, _ in self.swap_ins),
            tuple(self.saves),
        )


class _Plan:
    """The mutable plan of one step (open while scheduling, in flight once taken): one part per group."""

    __slots__ = ("groups", "id")

    def __init__(self, plan_id: int, num_groups: int) -> None:
        self.id = plan_id
        self.groups = [_GroupPlan() for _ in range(num_groups)]

    def busy(self) -> bool:
        """Whether completing this plan changes anything (else it is never tracked as in flight)."""
        return any(group.busy() for group in self.groups)

    def frozen(self) -> TransferPlan:
        return TransferPlan(self.id, self.frozen_groups())

    def frozen_groups(self) -> tuple[GroupTransfers, ...]:
        return tuple(group.frozen(number) for number, group in enumerate(self.groups))
