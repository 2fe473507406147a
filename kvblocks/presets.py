"""The previous release's manager classes, kept one release as names that build the composed manager.

There is one manager, :class:`~kvblocks.KVCacheManager`, given tiers (``tiers=``), layer groups
(``groups=``) and a role (the :class:`~kvblocks.PrefillManager` / :class:`~kvblocks.DecodeManager`
facades); :func:`~kvblocks.manager_for_role` builds any of the combinations from configuration. Each
name here builds that manager with the arguments it used to take, and ``isinstance`` against it asks
whether a manager has those parts::

    TieredKVCacheManager(64, 16, tiers=t)               == KVCacheManager(64, 16, tiers=t)
    HybridKVCacheManager(64, 16, local_groups=[w])      == KVCacheManager(64, 16, groups=[w])
    TieredHybridDecodeManager(64, 16, tiers=t, local_groups=[w])
                                                        == DecodeManager(64, 16, tiers=t, groups=[w])

None of them is a class of its own: ``type(TieredKVCacheManager(...))`` is ``KVCacheManager``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvblocks.config import CacheConfig
from kvblocks.core.groups.cross_group import CrossAttentionGroup
from kvblocks.core.groups.local_group import LocalGroup
from kvblocks.core.groups.recurrent_group import RecurrentGroup
from kvblocks.core.manager import KVCacheManager
from kvblocks.disagg.decode import DecodeManager
from kvblocks.disagg.prefill import PrefillManager
from kvblocks.errors import ConfigError
from kvblocks.events import EventSink

__all__ = [
    "HybridDecodeManager",
    "HybridKVCacheManager",
    "HybridPrefillManager",
    "TieredDecodeManager",
    "TieredHybridDecodeManager",
    "TieredHybridKVCacheManager",
    "TieredHybridPrefillManager",
    "TieredKVCacheManager",
    "TieredPrefillManager",
]


_GROUP_KEYWORDS = (
    ("local_groups", LocalGroup),
    ("recurrent_groups", RecurrentGroup),
    ("cross_groups", CrossAttentionGroup),
)


class _Preset(type):
    """The metaclass of a preset name: ``isinstance(m, Name)`` asks whether ``m`` has the name's parts."""

    def __instancecheck__(cls, obj: object) -> bool:
        has_parts = getattr(cls, "_has_parts")  # noqa: B009  # every class of this metaclass is a _Parts
        return bool(has_parts(obj))


class _Parts(metaclass=_Preset):
    facade: ClassVar[type[KVCacheManager]] = KVCacheManager
    tiered: ClassVar[bool] = False
    hybrid: ClassVar[bool] = False

    @classmethod
    def _has_parts(cls, obj: object) -> bool:
        return (
            isinstance(obj, cls.facade)
            and (not cls.tiered or obj.tiers is not None)
            and (not cls.hybrid or obj.num_groups > 1)
        )

    @classmethod
    def _build(
        cls,
        args: tuple[Any, ...],
        options: dict[str, Any],
        *,
        config: CacheConfig | None = None,
    ) -> Any:
        groups: list[object] = []
        for keyword, kind in _GROUP_KEYWORDS:
            given = options.pop(keyword, ())
            if isinstance(given, (str, bytes)) or not all(isinstance(g, kind) for g in given):
                raise ConfigError(f"{keyword} must be a sequence of {kind.__name__}, got {given!r}")
            groups += given
        if cls.tiered and options.get("tiers") is None:
            raise ConfigError(f"{cls.__name__} needs tiers (a TierConfig)")
        if config is not None:
            manager = cls.facade.from_config(config, groups=groups, **options)
        else:
            manager = cls.facade(*args, groups=groups, **options)  # its own checks first (the pool's size)
        if cls.hybrid and not groups:
            manager.close()
            raise ConfigError(
                "a hybrid manager needs a local, recurrent or cross-attention group (else KVCacheManager)"
            )
        return manager

    def __new__(cls, *args: Any, **options: Any) -> Any:
        return cls._build(args, options)

    @classmethod
    def from_config(cls, config: CacheConfig, *, event_sink: EventSink | None = None, **options: Any) -> Any:
        return cls._build((), {"event_sink": event_sink, **options}, config=config)


class TieredKVCacheManager(_Parts):
    """``KVCacheManager(num_blocks, block_size, tiers=...)``: a manager whose evicted blocks live on in host
    memory and storage (:mod:`kvblocks.tiers.tiering`).

    >>> from kvblocks.tiers import TierConfig
    >>> m = TieredKVCacheManager(5, 4, tiers=TierConfig(num_host_blocks=8))
    >>> type(m).__name__, isinstance(m, TieredKVCacheManager)
    ('KVCacheManager', True)
    """

    tiered = True


class HybridKVCacheManager(_Parts):
    """``KVCacheManager(num_blocks, block_size, groups=[...])``: full attention and the given ``local_groups``,
    ``recurrent_groups``, ``cross_groups`` (at least one).

    >>> from kvblocks.core.groups.local_group import LocalGroup
    >>> m = HybridKVCacheManager(16, 4, local_groups=[LocalGroup("sliding_window", span=6, num_blocks=16)])
    >>> m.add_sequence("a", list(range(17)))
    >>> list(m.allocate("a", 17)), m.group_block_table("a", 1)
    ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4])
    >>> m.commit("a", 17)                      # token 17 attends to 12..17: blocks 0-2 leave the window
    >>> m.group_block_table("a", 1)
    [-1, -1, -1, 3, 4]
    """

    hybrid = True


class TieredHybridKVCacheManager(_Parts):
    """``KVCacheManager(..., tiers=..., groups=[...])``: a hybrid manager whose every attention group has tiers."""

    tiered = True
    hybrid = True


class TieredPrefillManager(_Parts):
    """``PrefillManager(..., tiers=...)``: the prefill role over host and storage tiers."""

    facade = PrefillManager
    tiered = True


class TieredDecodeManager(_Parts):
    """``DecodeManager(..., tiers=...)``: the decode role over host and storage tiers."""

    facade = DecodeManager
    tiered = True


class HybridPrefillManager(_Parts):
    """``PrefillManager(..., groups=[...])``: the prefill role of a hybrid model."""

    facade = PrefillManager
    hybrid = True


class HybridDecodeManager(_Parts):
    """``DecodeManager(..., groups=[...])``: the decode role of a hybrid model."""

    facade = DecodeManager
    hybrid = True


class TieredHybridPrefillManager(_Parts):
    """``PrefillManager(..., tiers=..., groups=[...])``."""

    facade = PrefillManager
    tiered = True
    hybrid = True


class TieredHybridDecodeManager(_Parts):
    """``DecodeManager(..., tiers=..., groups=[...])``."""

    facade = DecodeManager
    tiered = True
    hybrid = True
