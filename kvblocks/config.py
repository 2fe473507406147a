"""Configuration of a :class:`kvblocks.KVCacheManager`, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from kvblocks.core.eviction import DEFAULT_EVICTION, check_eviction
from kvblocks.errors import ConfigError
from kvblocks.hashing import DEFAULT_SCHEME, HASH_SCHEMES, Namespace

__all__ = ["ROLES", "CacheConfig", "DisaggConfig"]


def _positive_int(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{what} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    """What a manager needs to know, checked once here rather than deep inside.

    >>> CacheConfig(num_blocks=1024, block_size=16).namespace
    Namespace(model='default', salt=None)
    >>> CacheConfig(num_blocks=0, block_size=16)
    Traceback (most recent call last):
    ...
    kvblocks.errors.ConfigError: num_blocks must be a positive int, got 0
    """

    num_blocks: int
    block_size: int
    hash_scheme: str = DEFAULT_SCHEME
    namespace: Namespace | str = "default"
    enable_prefix_caching: bool = True
    """When False, nothing is ever cached or matched: every request computes its whole prompt."""
    reserved_blocks: int = 0
    """Free blocks an admission must leave, so that running sequences can grow (vLLM's watermark)."""
    drop_last_matched_block: bool = False
    """A hit gives up its last matched block (EAGLE / MTP drafters need that block's hidden states)."""
    eviction: str = DEFAULT_EVICTION
    """Which idle device block goes first: a name in :data:`kvblocks.core.eviction.EVICTION_POLICIES` (``"lru"``,
    ``"s3fifo"``)."""

    def __post_init__(self) -> None:
        _positive_int(self.num_blocks, "num_blocks")
        _positive_int(self.block_size, "block_size")
        if not isinstance(self.hash_scheme, str) or self.hash_scheme not in HASH_SCHEMES:
            raise ConfigError(f"unknown hash scheme {self.hash_scheme!r}; known: {', '.join(sorted(HASH_SCHEMES))}")
        if HASH_SCHEMES[self.hash_scheme].lookahead:
            raise ConfigError(
                f"hash scheme {self.hash_scheme!r} covers tokens past each block (it names blocks for routing); "
                "a cache manager hashes a block once it is full"
            )
        object.__setattr__(self, "namespace", Namespace.of(self.namespace))
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        reserve = self.reserved_blocks
        if isinstance(reserve, bool) or not isinstance(reserve, int) or not 0 <= reserve < self.num_blocks:
            raise ConfigError(f"reserved_blocks must be an int in [0, num_blocks), got {reserve!r}")
        if not isinstance(self.drop_last_matched_block, bool):
            raise ConfigError(f"drop_last_matched_block must be a bool, got {self.drop_last_matched_block!r}")
        check_eviction(self.eviction)


ROLES = ("mixed", "prefill", "decode")
"""The built-in roles; :func:`kvblocks.disagg.register_role` adds one."""
_ROLE_NAMES = list(ROLES)  # every known role (the built-in ones first), the one list DisaggConfig checks


@dataclass(frozen=True)
class DisaggConfig:
    """A node's role, validated once.

    >>> DisaggConfig(role="decode", reserve_blocks_per_sequence=2).role
    'decode'
    >>> DisaggConfig(role="both")
    Traceback (most recent call last):
    ...
    kvblocks.errors.ConfigError: role must be one of mixed, prefill, decode; got 'both'
    """

    role: str = "mixed"
    reserve_blocks_per_sequence: int = 1
    """Decode: blocks kept free for each running sequence's growth; a handoff may not use them."""

    def __post_init__(self) -> None:
        if self.role not in _ROLE_NAMES:
            raise ConfigError(f"role must be one of {', '.join(_ROLE_NAMES)}; got {self.role!r}")
        reserve = self.reserve_blocks_per_sequence
        if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
            raise ConfigError(f"reserve_blocks_per_sequence must be an int >= 0, got {reserve!r}")
