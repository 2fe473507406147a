"""One attention group's tiers below its device blocks (a slot tier such as host memory, a keyed tier such as
storage; :mod:`~kvblocks.tiers.protocol`), and their policies.

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
from typing import cast

from kvblocks.config import CacheConfig
from kvblocks.core.groups.local_group import LocalGroupManager
from kvblocks.core.groups.sources import HOST, STORED, EvictingIndex
from kvblocks.errors import ConfigError, IntegrityError
from kvblocks.event_codec import BlockStored
from kvblocks.events import EventSink
from kvblocks.hashing import BlockHash, Namespace
from kvblocks.hashing.tokens import block_token_bytes
from kvblocks.tiers.config import TierConfig
from kvblocks.tiers.kinds import TIER_KINDS, TierPlace
from kvblocks.tiers.pending import _Counts, _GroupPlan
from kvblocks.tiers.protocol import KEYED, SLOT, KeyedTier, SlotTier, Tier
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
        "tiers",
        "wants_evicted",
        "writes_through",
    )

    def __init__(self, number: int, tiers: Sequence[Tier], *, counts: _Counts, policies: TierConfig) -> None:
        """``tiers`` top to bottom: at most one :data:`SLOT` tier, above at most one :data:`KEYED` tier;
        ``policies``' host and storage policies say when each receives copies."""
        media = [tier.medium for tier in tiers]
        if media not in ([], [SLOT], [KEYED], [SLOT, KEYED]):
            raise ConfigError(f"group {number}: tiers of media {media}; a stack holds one slot tier above one keyed")
        self.number = number
        self.tiers = tuple(tiers)
        host = self.host = cast("SlotTier", tiers[0]) if media[:1] == [SLOT] else None
        storage = self.storage = cast("KeyedTier", tiers[-1]) if media[-1:] == [KEYED] else None
        host_policy, storage_policy = policies.host_policy, policies.storage_policy
        self.host_back = host is not None and host_policy == "write-back"
        self.host_through = host is not None and host_policy == "write-through"
        self.save_back = storage is not None and storage_policy == "write-back"
        self.save_through = storage is not None and storage_policy == "write-through"
        self.wants_evicted = host is not None or self.save_back  # something below takes evicted content
        self.writes_through = self.host_through or self.save_through
        self.counts = counts
        self.plan = _GroupPlan()
        self.events = any(tier.events is not None for tier in tiers)

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
        return (STORED, -1) if storage is not None and storage.holds(key) else None

    def holds(self, key: BlockHash) -> bool:
        """Whether the host tier or (known, healthy) storage holds ``key``. Pure."""
        return self.where(key) is not None

    def host_tier(self) -> SlotTier:
        """The host tier (the caller knows the group has one: a plan moves blocks through it)."""
        if self.host is None:
            raise IntegrityError(f"group {self.number} has no host tier")
        return self.host

    def storage_tier(self) -> KeyedTier:
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
        host = self.host
        # a host tier's events name each written-back block's parent and tokens: the index says them
        chains: list[tuple[BlockHash | None, bytes | None]] | None = (
            [] if host is not None and host.events is not None else None
        )
        evicted = index.evict(count, hashes, chains)
        if not evicted:
            return
        for i, (block, block_hash) in enumerate(zip(evicted, hashes, strict=True)):
            if host is not None:
                if block_hash in host:
                    host.touch(block_hash)
                    continue
                if self.host_back:
                    parent, tokens = chains[i] if chains is not None else (None, None)
                    if self.copy_to_host(block, block_hash, parent, tokens):
                        continue
                    self.counts.write_backs_without_host_room += 1
            if self.save_back:
                self.plan_save("device", block, block_hash)
        if self.events:
            self.publish()

    def written(
        self,
        block_of: Callable[[BlockHash], int | None],
        keys: Sequence[BlockHash],
        start: int,
        stop: int,
        tokens: Sequence[int] | None = None,
    ) -> None:
        """Write-through: positions ``[start, stop)`` were just committed; copy their cached blocks down.
        ``tokens`` (the sequence's, from its first) go into the host tier's events with each block's parent."""
        host = self.host
        size = getattr(host, "block_size", None) if host is not None and host.events is not None else None
        for position in range(start, stop):
            block_hash = keys[position]
            block = block_of(block_hash)
            if block is None:
                continue
            if self.host_through and host is not None and block_hash not in host:
                parent, own = None, None
                if size is not None:  # the host tier's events chain it
                    parent, own = (keys[position - 1] if position else None), block_token_bytes(tokens, position, size)
                if not self.copy_to_host(block, block_hash, parent, own):
                    self.counts.write_backs_without_host_room += 1
            if self.save_through:
                self.plan_save("device", block, block_hash)
        if self.events:
            self.publish()

    def copy_to_host(
        self, block: int, block_hash: BlockHash, parent: BlockHash | None = None, tokens: bytes | None = None
    ) -> bool:
        """Plan a swap-out of device ``block`` into a host block (an evicted host entry is saved first);
        ``parent`` / ``tokens`` name its chain in the host tier's events."""
        host = self.host
        if host is None:
            return False
        reserved = (
            host.reserve(block_hash) if parent is None and tokens is None else host.reserve(block_hash, parent, tokens)
        )
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
        """Emit what the group's tiers noted (with a sink only, on the manager's thread)."""
        for tier in self.tiers:
            tier.publish()

    def snapshot_events(self) -> list[BlockStored]:
        """What the group's tiers hold, as events, top tier first. Pure."""
        return [event for tier in self.tiers for event in tier.snapshot_events()]


def tier_stacks(
    tiers: TierConfig,
    config: CacheConfig,
    locals_: Sequence[LocalGroupManager],
    counts: _Counts,
    *,
    events: EventSink | None,
    tag: tuple[int | None, str | None],
) -> list[TierStack]:
    """One stack per attention group, each holding the tiers ``tiers.kinds`` builds there (:mod:`kinds`):
    group 0 (full attention, ``config``'s blocks, its events tagged ``tag``), then each local group (host
    blocks from ``group_host_blocks``; storage, under keys of its own, with ``group_entry_formats``)."""
    if not isinstance(tiers, TierConfig):
        raise ConfigError(f"tiers must be a TierConfig, got {type(tiers).__name__}")
    lengths: list[tuple[str, tuple[object, ...]]] = [("group_host_blocks", tiers.group_host_blocks)]
    if tiers.storage is not None:  # without storage, group_entry_formats is ignored
        lengths.append(("group_entry_formats", tiers.group_entry_formats))
    for what, given in lengths:
        if given and len(given) != len(locals_):
            raise ConfigError(f"{what} names {len(given)} groups, the manager has {len(locals_)} local groups")
    unknown = [kind for kind in tiers.kinds if kind not in TIER_KINDS]
    if unknown:
        raise ConfigError(f"unknown tier kinds {unknown}; registered: {sorted(TIER_KINDS)}")
    namespace = Namespace.of(config.namespace)
    group, kind = tag
    places = [
        TierPlace(tiers, 0, config.block_size, 1, namespace, config.hash_scheme, config.block_size, events, group, kind)
    ]
    places += [
        TierPlace(
            tiers,
            n,
            local.block_size,
            local.span,
            namespace,
            config.hash_scheme,
            config.block_size,
            events,
            n,
            local.kind.event_name,
        )
        for n, local in enumerate(locals_, 1)
    ]
    stacks: list[TierStack] = []
    built: list[Tier] = []  # every tier made so far: closed again if the configuration is refused halfway
    try:
        for place in places:
            mine: list[Tier] = []
            for name in tiers.kinds:
                tier = TIER_KINDS[name](place)
                if tier is None:
                    continue
                medium = getattr(tier, "medium", None)
                if not isinstance(tier, SlotTier if medium == SLOT else KeyedTier):
                    raise ConfigError(
                        f"tier kind {name!r} built a {type(tier).__name__}, which is neither a SlotTier nor a KeyedTier"
                    )
                built.append(tier)
                mine.append(tier)
            stacks.append(TierStack(place.number, mine, counts=counts, policies=tiers))
    except BaseException:
        for made in reversed(built):  # local groups' first: group 0's storage tier closes the shared backend
            made.close(0)
        raise
    return stacks
