"""The tiered manager's state objects: its counters, the pending admissions and the step plans."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from kvblocks.hashing import BlockHash
from kvblocks.manager import _Sequence
from kvblocks.tiers.storage_tier import StorageTierStats
from kvblocks.tiers.transfers import BlockSave, GroupTransfers, TransferPlan
from kvblocks.tiers.writer import WriterStats

__all__ = ["TierStats"]


@dataclass(frozen=True)
class TierStats:
    """A snapshot of the tiers' counters (blocks) next to :attr:`KVCacheManager.stats`."""

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


class _Admission:
    """An admitted sequence whose cached prefix beyond the device is still being copied in."""

    __slots__ = (
        "cancelled",
        "deadline",
        "device",
        "host_blocks",
        "load_plan",
        "load_request",
        "loads_ok",
        "num_loads",
        "readmission",
        "seq",
        "seq_id",
        "swap_plan",
        "swaps_ok",
    )

    def __init__(self, seq_id: Hashable, seq: _Sequence, device: int, host_blocks: list[int], num_loads: int) -> None:
        self.seq_id = seq_id
        self.seq = seq
        self.device = device  # leading blocks already device-resident
        self.host_blocks = host_blocks  # swap-in sources, in table order after the device blocks
        self.num_loads = num_loads  # blocks read from storage after those
        self.readmission = seq.preempted
        self.swap_plan = -1
        self.swaps_ok: int | None = None if host_blocks else 0
        self.load_request = -1
        self.load_plan = -1
        self.deadline = 0.0
        self.loads_ok: int | None = None if num_loads else 0
        self.cancelled = False


class _Plan:
    """The mutable plan of one step (open while scheduling, in flight once taken)."""

    __slots__ = ("deferred", "id", "queued", "saves", "swap_ins", "swap_outs")

    def __init__(self, plan_id: int) -> None:
        self.id = plan_id
        self.saves: list[BlockSave] = []
        self.swap_outs: list[tuple[int, int, BlockHash]] = []  # device, host, hash
        self.swap_ins: list[tuple[int, int, _Admission]] = []  # host, device, admission
        self.deferred: list[list[int]] = []  # device release orders to run when the plan completes
        self.queued: set[BlockHash] = set()  # hashes with a save in this plan

    def busy(self) -> bool:
        """Whether completing this plan changes anything (else it is never tracked as in flight)."""
        return bool(self.saves or self.swap_outs or self.swap_ins or self.deferred)

    def frozen(self) -> TransferPlan:
        return TransferPlan(self.id, self.frozen_groups())

    def frozen_groups(self) -> tuple[GroupTransfers, ...]:
        """Group 0's copies (a hybrid plan adds its local groups')."""
        return (
            GroupTransfers(
                0,
                tuple((d, h) for d, h, _ in self.swap_outs),
                tuple((h, d) for h, d, _ in self.swap_ins),
                tuple(self.saves),
            ),
        )
