"""Runs a tiered manager's copies on KV tensors this process owns.

An engine that keeps its own copy engine executes :class:`TransferPlan` s itself; one
that lets kvblocks own the caches calls :meth:`TransferExecutor.step` once per
scheduling step, after its scheduling calls and before its forward pass::

    manager.allocate(...) / free(...) / preempt(...)     # scheduling: no I/O, no copies
    loads = executor.step()                               # saves, swap-outs, swap-ins, loads
    model.forward(...); manager.commit(...)

Importing this module imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvblocks.backends._torch import torch
from kvblocks.backends.base import Backend
from kvblocks.backends.cache import KVCache
from kvblocks.backends.registry import get_backend
from kvblocks.errors import ConfigError
from kvblocks.tiers.storage_tier import StorageTier
from kvblocks.tiers.transfers import GroupTransfers, LoadResult, TransferPlan

if TYPE_CHECKING:
    from kvblocks.core.manager import KVCacheManager

__all__ = ["TransferExecutor"]


class TransferExecutor:
    """Carries out plans and storage loads between a device cache, a host cache and the storage tier."""

    def __init__(
        self,
        manager: KVCacheManager,
        backend: Backend,
        device_cache: KVCache,
        host_cache: KVCache | None = None,
    ) -> None:
        if manager.num_groups != 1:  # a plan's groups would be reported done without running
            raise ConfigError(
                "TransferExecutor runs one group's copies; a hybrid manager's plan.group_transfers need one cache each"
            )
        if manager.host is not None:
            if host_cache is None:
                raise ConfigError("the manager has a host tier: give the host cache")
            if host_cache.num_blocks < manager.host.pool.num_blocks:
                raise ConfigError(
                    f"host cache has {host_cache.num_blocks} blocks, the host tier {manager.host.pool.num_blocks}"
                )
        if device_cache.num_blocks < manager.num_blocks:
            raise ConfigError(f"device cache has {device_cache.num_blocks} blocks, the manager {manager.num_blocks}")
        storage = manager.storage
        if storage is not None and not isinstance(storage, StorageTier):
            raise ConfigError(f"TransferExecutor reads storage entries; {type(storage).__name__} is another kind")
        if storage is not None and storage.num_shards != 1:
            raise ConfigError("TransferExecutor moves one rank's shard; run one per rank with its own manager")
        self.manager = manager
        self.backend = backend
        self.device_cache = device_cache
        self.host_cache = host_cache
        self._host_backend = get_backend("cpu")

    def run(self, plan: TransferPlan) -> None:
        """Execute ``plan`` in its order, wait for the copies, and report it complete."""
        if not plan.group_transfers:
            self.manager.complete_transfers(plan)
            return
        (copies,) = plan.group_transfers  # one group: checked at construction
        saved = {0: self._snapshot(copies)} if copies.saves else None
        if copies.swap_outs:
            source, target = zip(*copies.swap_outs, strict=True)
            self.backend.transfer(self.device_cache, self.host_cache, list(source), list(target)).wait()  # type: ignore[arg-type]
        if copies.swap_ins:
            source, target = zip(*copies.swap_ins, strict=True)
            self.backend.transfer(self.host_cache, self.device_cache, list(source), list(target)).wait()  # type: ignore[arg-type]
        self.manager.complete_transfers(plan, saved=saved)

    def _snapshot(self, plan: GroupTransfers) -> list[memoryview]:
        """The bytes of every block to save, copied now (before anything can overwrite the blocks)."""
        rows: list[memoryview] = [memoryview(b"")] * len(plan.saves)
        for tier, backend, cache in (
            ("device", self.backend, self.device_cache),
            ("host", self._host_backend, self.host_cache),
        ):
            positions = [i for i, save in enumerate(plan.saves) if save.tier == tier]
            if not positions:
                continue
            if cache is None:
                raise ConfigError(f"a plan saves {tier} blocks but there is no {tier} cache")
            data = backend.gather(cache, [plan.saves[i].block for i in positions]).cpu().numpy()
            for row, i in enumerate(positions):
                rows[i] = memoryview(data[row])
        return rows

    def apply(self, loads: list[LoadResult]) -> None:
        """Write finished storage reads into their device blocks."""
        for result in loads:
            if not result.blocks:
                continue
            data = torch.frombuffer(bytearray(b"".join(p[0] for p in result.payloads)), dtype=torch.uint8)
            data = data.view(len(result.blocks), -1).to(self.device_cache.device)
            self.backend.scatter(self.device_cache, list(result.blocks), data)

    def step(self) -> list[LoadResult]:
        """One scheduling step's data movement: take and run the plan, then apply finished loads."""
        self.run(self.manager.take_transfers())
        loads = self.manager.poll_loads()
        self.apply(loads)
        return loads
