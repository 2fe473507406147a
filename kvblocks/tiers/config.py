"""Configuration of the host and storage tiers below a device cache, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from kvblocks.core.eviction import DEFAULT_EVICTION, check_eviction
from kvblocks.errors import ConfigError
from kvblocks.tiers.entry import EntryFormat
from kvblocks.tiers.storage import StorageBackend

__all__ = ["HOST_POLICIES", "STORAGE_POLICIES", "TierConfig"]

HOST_POLICIES = ("write-back", "write-through", "off")
"""write-back: a committed device block is copied to host when it is evicted; write-through: on commit."""

STORAGE_POLICIES = ("write-back", "write-through", "off")
"""write-back: a block is written when it leaves the node (evicted from host, or from device when there is
no host tier); write-through: on commit; off: only preemption snapshots (``save_on_preempt``)."""


def _int_at_least(value: object, low: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{what} must be an int >= {low}, got {value!r}")


@dataclass(frozen=True)
class TierConfig:
    """The tiers under a :class:`~kvblocks.tiers.TieredKVCacheManager`'s device blocks.

    >>> TierConfig(num_host_blocks=256).host_policy
    'write-back'
    >>> TierConfig(host_policy="sometimes")
    Traceback (most recent call last):
    ...
    kvblocks.errors.ConfigError: host_policy must be one of write-back, write-through, off; got 'sometimes'
    """

    num_host_blocks: int = 0
    """Blocks in the host tier (0: no host tier)."""
    host_policy: str = "write-back"
    storage: StorageBackend | None = None
    """The shared, persistent tier (None: no storage tier)."""
    entry_format: EntryFormat | None = None
    """Header of every stored block (``EntryFormat.for_spec``); required with ``storage``."""
    storage_policy: str = "write-back"
    save_on_preempt: bool = False
    """``preempt`` snapshots the sequence's committed blocks to storage before they can be reused."""
    storage_timeout_s: float = 5.0
    """Longest wait for a storage read; a load that takes longer is a miss, and storage hits stop
    being reported until the backend answers again."""
    max_pending_writes: int = 1024
    """Entries the background writer queues before it drops the oldest."""
    ranks: tuple[int, ...] = ()
    """Tensor-parallel ranks whose shards are stored under their own keys (empty: one unsharded entry)."""
    storage_index_size: int = 1 << 20
    """Block hashes remembered as stored (what ``lookup`` reports without asking the backend)."""
    group_host_blocks: tuple[int, ...] = ()
    """A hybrid manager's host blocks per local group, in group order (groups 1, 2, ...); empty: the
    local groups have no host tier. ``host_policy`` applies to them."""
    group_entry_formats: tuple[EntryFormat, ...] = ()
    """A hybrid manager's entry format per local group, in group order (``EntryFormat.for_spec`` of the
    group's own spec): each local group then stores its blocks under keys of its own in ``storage``,
    with ``storage_policy``. Empty: storage serves group 0 only. Ignored without ``storage``."""
    host_eviction: str = DEFAULT_EVICTION
    """Which idle host block goes first when the host tier is full: ``"lru"`` or ``"s3fifo"``."""
    kinds: tuple[str, ...] = ("host", "storage")
    """Each attention group's tiers, top to bottom, by registered kind (:mod:`kvblocks.tiers.kinds`): at most
    one slot tier (host-like) above at most one keyed tier (storage-like). A kind builds nothing in a group
    the rest of this configuration gives it nothing in."""

    def __post_init__(self) -> None:
        _int_at_least(self.num_host_blocks, 0, "num_host_blocks")
        if self.host_policy not in HOST_POLICIES:
            raise ConfigError(f"host_policy must be one of {', '.join(HOST_POLICIES)}; got {self.host_policy!r}")
        check_eviction(self.host_eviction, "host_eviction")
        if self.storage_policy not in STORAGE_POLICIES:
            raise ConfigError(
                f"storage_policy must be one of {', '.join(STORAGE_POLICIES)}; got {self.storage_policy!r}"
            )
        if self.storage is not None:
            missing = [
                m for m in ("put", "get", "exists", "delete", "close") if not callable(getattr(self.storage, m, None))
            ]
            if missing:
                raise ConfigError(f"storage {type(self.storage).__name__} lacks {', '.join(missing)}")
            if not isinstance(self.entry_format, EntryFormat):
                raise ConfigError("a storage tier needs entry_format (EntryFormat.for_spec(spec, scheme))")
        elif self.save_on_preempt:
            raise ConfigError("save_on_preempt needs a storage backend")
        if not isinstance(self.save_on_preempt, bool):
            raise ConfigError(f"save_on_preempt must be a bool, got {self.save_on_preempt!r}")
        timeout = self.storage_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"storage_timeout_s must be a number > 0, got {timeout!r}")
        _int_at_least(self.max_pending_writes, 1, "max_pending_writes")
        _int_at_least(self.storage_index_size, 1, "storage_index_size")
        ranks = tuple(self.ranks)
        for rank in ranks:
            _int_at_least(rank, 0, "every rank")
        if len(set(ranks)) != len(ranks):
            raise ConfigError(f"ranks must be distinct, got {ranks}")
        object.__setattr__(self, "ranks", ranks)
        if isinstance(self.group_host_blocks, (str, bytes)):
            raise ConfigError("group_host_blocks must be a sequence of ints")
        try:
            per_group = tuple(self.group_host_blocks)
        except TypeError:
            raise ConfigError(f"group_host_blocks must be a sequence of ints, got {self.group_host_blocks!r}") from None
        for count in per_group:
            _int_at_least(count, 0, "every group_host_blocks entry")
        object.__setattr__(self, "group_host_blocks", per_group)
        object.__setattr__(self, "group_entry_formats", self._group_formats())
        kinds = self.kinds
        if isinstance(kinds, str) or not isinstance(kinds, (tuple, list)) or not kinds:
            raise ConfigError(f"kinds must be a non-empty sequence of tier kind names, got {kinds!r}")
        if not all(isinstance(k, str) and k for k in kinds) or len(set(kinds)) != len(kinds):
            raise ConfigError(f"kinds must be distinct tier kind names, got {kinds!r}")
        object.__setattr__(self, "kinds", tuple(kinds))

    def _group_formats(self) -> tuple[EntryFormat, ...]:
        """``group_entry_formats`` as a tuple of formats; raises :class:`ConfigError` for anything else."""
        given = self.group_entry_formats
        if isinstance(given, (str, bytes)):
            raise ConfigError("group_entry_formats must be a sequence of EntryFormat")
        try:
            formats = tuple(given)
        except TypeError:
            raise ConfigError(f"group_entry_formats must be a sequence of EntryFormat, got {given!r}") from None
        for entry_format in formats:
            if not isinstance(entry_format, EntryFormat):
                raise ConfigError(
                    f"every group_entry_formats entry must be an EntryFormat, got {type(entry_format).__name__}"
                )
        return formats

    @property
    def host_enabled(self) -> bool:
        return self.num_host_blocks > 0 and self.host_policy != "off"
