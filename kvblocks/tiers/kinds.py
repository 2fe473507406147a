"""The registry of tier kinds: how each named tier is built for one attention group.

``TierConfig.kinds`` names a group's tiers top to bottom (default ``("host", "storage")``); each name is
looked up here and its factory builds that group's tier from a :class:`TierPlace`, or returns None when the
configuration does not ask for it in that group (no host blocks, no storage backend). Adding a tier is one
module with a class that meets :class:`~kvblocks.tiers.protocol.SlotTier` or
:class:`~kvblocks.tiers.protocol.KeyedTier`, plus one :func:`register_tier_kind` call::

    register_tier_kind("peer", lambda place: PeerTier(place.block_size) if place.number == 0 else None)
    KVCacheManager(config, tiers=TierConfig(kinds=("host", "peer")))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvblocks.core.eviction import DEFAULT_EVICTION
from kvblocks.errors import ConfigError
from kvblocks.events import EventSink
from kvblocks.hashing import Namespace
from kvblocks.tiers.config import TierConfig
from kvblocks.tiers.entry import group_tag, namespace_tag
from kvblocks.tiers.host import HostTier
from kvblocks.tiers.protocol import KeyedTier, SlotTier
from kvblocks.tiers.storage_tier import StorageTier

__all__ = ["TIER_KINDS", "TierFactory", "TierPlace", "register_tier_kind", "unregister_tier_kind"]


@dataclass(frozen=True)
class TierPlace:
    """Where a tier goes: attention group ``number`` (0: full attention) of a manager configured by ``tiers``.

    ``block_size`` / ``span``: the group's tokens per block and per key; ``namespace`` / ``scheme`` /
    ``chain_block_size``: its chain's; ``events`` / ``group`` / ``group_kind``: the sink and the tag its
    device index emits under.
    """

    tiers: TierConfig
    number: int
    block_size: int
    span: int
    namespace: Namespace
    scheme: str
    chain_block_size: int
    events: EventSink | None
    group: int | None
    group_kind: str | None


TierFactory = Callable[[TierPlace], SlotTier | KeyedTier | None]
"""Builds one group's tier, or None when the configuration asks for none there."""


def _host(place: TierPlace) -> HostTier | None:
    """Group 0: ``num_host_blocks`` (with ``host_eviction``); a local group: its ``group_host_blocks`` entry."""
    tiers = place.tiers
    if place.number == 0:
        count, eviction = (tiers.num_host_blocks if tiers.host_enabled else 0), tiers.host_eviction
    else:
        per_group = tiers.group_host_blocks
        count = per_group[place.number - 1] if per_group and tiers.host_policy != "off" else 0
        eviction = DEFAULT_EVICTION
    if not count:
        return None
    return HostTier(
        count,
        events=place.events,
        group=place.group,
        group_kind=place.group_kind,
        block_size=place.block_size,
        eviction=eviction,
    )


def _storage(place: TierPlace) -> StorageTier | None:
    """Group 0: the configured backend and format; a local group: only with ``group_entry_formats``, under keys
    of its own in the same backend (group 0's tier closes it)."""
    tiers = place.tiers
    if tiers.storage is None:
        return None
    number, formats = place.number, tiers.group_entry_formats
    if number and not formats:
        return None
    tag = None  # group 0: the namespace's own key space, and the config's format
    if number:
        base = namespace_tag(place.namespace, place.scheme, place.chain_block_size)
        tag = group_tag(base, number, place.group_kind or "", place.block_size, place.span)
    return StorageTier(
        tiers,
        place.namespace,
        place.scheme,
        place.block_size,
        entry_format=formats[number - 1] if number else None,
        tag=tag,
        owns_backend=not number,
        events=place.events,
        group=place.group,
        group_kind=place.group_kind,
    )


TIER_KINDS: dict[str, TierFactory] = {"host": _host, "storage": _storage}
"""Tier kind name -> its factory. Extend with :func:`register_tier_kind`."""


def register_tier_kind(name: str, factory: TierFactory) -> None:
    """Make ``name`` a tier kind ``TierConfig.kinds`` may list. Raises :class:`ConfigError` for a name
    already registered or a factory that is not callable."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a tier kind's name must be a non-empty str, got {name!r}")
    if name in TIER_KINDS:
        raise ConfigError(f"tier kind {name!r} is already registered")
    if not callable(factory):
        raise ConfigError(f"tier kind {name!r}: the factory must be callable")
    TIER_KINDS[name] = factory


def unregister_tier_kind(name: str) -> None:
    """Remove a kind :func:`register_tier_kind` added (the built-in ``host`` and ``storage`` stay)."""
    if name in ("host", "storage") or name not in TIER_KINDS:
        raise ConfigError(f"{name!r} is not a registered tier kind that may be removed")
    del TIER_KINDS[name]
