"""One attention group's tiers below its device blocks: a host tier and a storage tier, and their policies.

Every attention group of a tiered manager (full attention, and each sliding-window or chunked-local
group) owns one :class:`TierStack`, fed by that group's evictions and commits::

    device eviction  -> write-back: a copy to host (a swap-out), or a save to storage without host room
    host eviction    -> write-back: a save to storage, before the swap-out overwrites the host block
    commit           -> write-through: a copy to host and/or a save, as the block is committed

Every copy goes into the group's part of the step's plan (:class:`~kvblocks.tiers.TransferPlan`);
the stack never moves data and never waits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvblocks.config import CacheConfig
from kvblocks.core.groups.local_group import LocalGroupManager
from kvblocks.core.groups.sources import HOST, STORED, EvictingIndex
from kvblocks.errors import ConfigError, IntegrityError
from kvblocks.event_codec import BlockStored
from kvblocks.events import EventSink
from kvblocks.hashing import BlockHash, Namespace
from kvblocks.tiers.config import TierConfig
from kvblocks.tiers.entry import group_tag, namespace_tag
from kvblocks.tiers.host import HostTier
from kvblocks.tiers.pending import _Counts, _GroupPlan
from kvblocks.tiers.storage_tier import StorageTier
from kvblocks.tiers.transfers import BlockSave

__all__ = ["TierStack", "tier_stacks"]


class TierStack:
    """Group ``number``'s host tier and storage tier (each optional) and what moves between them.

    ``plan`` is the group's part of the open step plan, set by whoever opens plans; ``counts`` are
    shared by every stack of a manager; with ``events`` a call that changed a tier publishes its events.
    """

    __slots__ = (
        "counts",
        "events",
        "host",
        "host_back",
        "host_through",
        "number",
        "plan",
        "save_back",
        "save_through",
        "storage",
        "wants_evicted",
        "writes_through",
    )

    def __init__(
        self,
        number: int,
        host: HostTier | None,
        storage: StorageTier | None,
        *,
        host_policy: str,
        storage_policy: str,
        counts: _Counts,
    ) -> None:
        self.number = number
        self.host = host
        self.storage = storage
        self.host_back = host is not None and host_policy == "write-back"
        self.host_through = host is not None and host_policy == "write-through"
        self.save_back = storage is not None and storage_policy == "write-back"
        self.save_through = storage is not None and storage_policy == "write-through"
        self.wants_evicted = host is not None or self.save_back  # something below takes evicted content
        self.writes_through = self.host_through or self.save_through
        self.counts = counts
        self.plan = _GroupPlan()
        self.events = (host is not None and host.events is not None) or (
            storage is not None and storage.events is not None
        )

    # ------------------------------------------------------------------ what the tiers hold

    def where(self, key: BlockHash) -> tuple[int, int] | None:
        """``(HOST, host block)`` or ``(STORED, -1)`` (:mod:`~kvblocks.core.groups.sources`) for a block the group
        does not hold on device; None when neither tier has it (storage: known stored, and answering reads). Pure."""
        host = self.host
        if host is not None:
            block = host.block_of(key)
            if block is not None:
                return HOST, block
        storage = self.storage
        if storage is not None and storage.healthy and storage.is_known(key):
            return STORED, -1
        return None

    def holds(self, key: BlockHash) -> bool:
        """Whether the host tier or (known, healthy) storage holds ``key``. Pure."""
        return self.where(key) is not None

    def host_tier(self) -> HostTier:
        """The host tier (the caller knows the group has one: a plan moves blocks through it)."""
        if self.host is None:
            raise IntegrityError(f"group {self.number} has no host tier")
        return self.host

    def storage_tier(self) -> StorageTier:
        """The storage tier (the caller knows the group has one: a plan saves or loads through it)."""
        if self.storage is None:
            raise IntegrityError(f"group {self.number} has no storage tier")
        return self.storage

    def acquire_host(self, blocks: list[int]) -> None:
        """Hold host blocks a swap-in reads (an eviction cannot take them until the plan completes)."""
        if self.host is not None:
            self.host.acquire(blocks)

    def host_run(self, hashes: Sequence[BlockHash], start: int, stop: int) -> list[int]:
        """Host blocks of the run of ``hashes[start:stop]`` the host tier holds, from ``start``. Pure."""
        return self.host.run(hashes, start, stop) if self.host is not None else []

    def stored_run(self, hashes: Sequence[BlockHash], start: int, stop: int) -> int:
        """How many of ``hashes[start:stop]``, from ``start``, storage is known to hold. Pure."""
        return self.storage.known_run(hashes, start, stop) if self.storage is not None else 0

    # ------------------------------------------------------------------ what moves down

    def evict_from(self, index: EvictingIndex, count: int) -> None:
        """Evict ``count`` idle blocks from the group's device index; their content moves down (write-back)."""
        if not self.wants_evicted:
            index.evict(count)
            return
        hashes: list[BlockHash] = []
        evicted = index.evict(count, hashes)
        if not evicted:
            return
        host = self.host
        for block, block_hash in zip(evicted, hashes, strict=True):
            if host is not None:
                if block_hash in host:
                    host.touch(block_hash)
                    continue
                if self.host_back:
                    if self.copy_to_host(block, block_hash):
                        continue
                    self.counts.write_backs_without_host_room += 1
            if self.save_back:
                self.plan_save("device", block, block_hash)
        if self.events:
            self.publish()

    def written(
        self, block_of: Callable[[BlockHash], int | None], keys: Sequence[BlockHash], start: int, stop: int
    ) -> None:
        """Write-through: positions ``[start, stop)`` were just committed; copy their cached blocks down."""
        host = self.host
        for position in range(start, stop):
            block_hash = keys[position]
            block = block_of(block_hash)
            if block is None:
                continue
            absent = self.host_through and host is not None and block_hash not in host
            if absent and not self.copy_to_host(block, block_hash):
                self.counts.write_backs_without_host_room += 1
            if self.save_through:
                self.plan_save("device", block, block_hash)
        if self.events:
            self.publish()

    def copy_to_host(self, block: int, block_hash: BlockHash) -> bool:
        """Plan a swap-out of device ``block`` into a host block (an evicted host entry is saved first)."""
        host = self.host
        reserved = host.reserve(block_hash) if host is not None else None
        if reserved is None:
            return False
        host_block, evicted = reserved
        if evicted is not None and self.save_back:
            self.plan_save("host", host_block, evicted)  # saved before the swap-out overwrites it
        self.plan.swap_outs.append((block, host_block, block_hash))
        return True

    def plan_save(self, tier: str, block: int, block_hash: BlockHash) -> bool:
        """Queue ``block`` for storage in the open plan unless known stored; True if the open plan saves it."""
        storage = self.storage
        plan = self.plan
        if storage is None or storage.is_known(block_hash):
            return False
        if block_hash not in plan.queued:
            plan.saves.append(BlockSave(tier, block, block_hash))
            plan.queued.add(block_hash)
            self.counts.saves_planned += 1
        return True

    # ------------------------------------------------------------------ events and maintenance

    def publish(self) -> None:
        """Emit what the group's host and storage tiers noted (with a sink only, on the manager's thread)."""
        if self.host is not None:
            self.host.publish()
        if self.storage is not None:
            self.storage.publish()

    def snapshot_events(self) -> list[BlockStored]:
        """The host tier's ready entries and the hashes storage is known to hold, as events. Pure."""
        events: list[BlockStored] = []
        if self.host is not None:
            events += self.host.snapshot_events()
        if self.storage is not None:
            events += self.storage.snapshot_events()
        return events


def tier_stacks(
    tiers: TierConfig,
    config: CacheConfig,
    locals_: Sequence[LocalGroupManager],
    counts: _Counts,
    *,
    events: EventSink | None,
    tag: tuple[int | None, str | None],
) -> list[TierStack]:
    """One stack per attention group from ``tiers``: group 0 (full attention, ``config``'s blocks, its events
    tagged ``tag``), then each local group with its own host blocks (``group_host_blocks``) and, with
    ``group_entry_formats``, its own storage keys and entry format in the same backend."""
    if not isinstance(tiers, TierConfig):
        raise ConfigError(f"tiers must be a TierConfig, got {type(tiers).__name__}")
    per_group = tiers.group_host_blocks
    if per_group and len(per_group) != len(locals_):
        raise ConfigError(
            f"group_host_blocks names {len(per_group)} groups, the manager has {len(locals_)} local groups"
        )
    formats = tiers.group_entry_formats if tiers.storage is not None else ()
    if formats and len(formats) != len(locals_):
        raise ConfigError(
            f"group_entry_formats names {len(formats)} groups, the manager has {len(locals_)} local groups"
        )
    policies = {"host_policy": tiers.host_policy, "storage_policy": tiers.storage_policy}
    group, kind = tag
    namespace = Namespace.of(config.namespace)
    scheme, size, eviction = config.hash_scheme, config.block_size, tiers.host_eviction
    first_host = (
        HostTier(tiers.num_host_blocks, events=events, group=group, group_kind=kind, block_size=size, eviction=eviction)
        if tiers.host_enabled
        else None
    )
    first_storage = (
        StorageTier(tiers, namespace, scheme, size, events=events, group=group, group_kind=kind)
        if tiers.storage is not None
        else None
    )
    stacks = [TierStack(0, first_host, first_storage, counts=counts, **policies)]
    on = tiers.host_policy != "off"
    base = namespace_tag(namespace, scheme, size)
    for number, local in enumerate(locals_, 1):
        count = per_group[number - 1] if per_group else 0
        kind_name = local.kind.event_name
        local_host = (
            HostTier(count, events=events, group=number, group_kind=kind_name, block_size=local.block_size)
            if on and count
            else None
        )
        local_storage = (
            StorageTier(
                tiers,
                namespace,
                scheme,
                local.block_size,
                entry_format=formats[number - 1],
                tag=group_tag(base, number, kind_name, local.block_size, local.span),
                owns_backend=False,  # group 0's tier closes the backend, after the local groups' tiers
                events=events,
                group=number,
                group_kind=kind_name,
            )
            if formats
            else None
        )
        stacks.append(TierStack(number, local_host, local_storage, counts=counts, **policies))
    return stacks
