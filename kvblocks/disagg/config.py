"""A node's role in prefill/decode disaggregation: :class:`DisaggConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from kvblocks.errors import ConfigError

__all__ = ["ROLES", "DisaggConfig"]

ROLES = ("mixed", "prefill", "decode")


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
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {', '.join(ROLES)}; got {self.role!r}")
        reserve = self.reserve_blocks_per_sequence
        if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
            raise ConfigError(f"reserve_blocks_per_sequence must be an int >= 0, got {reserve!r}")
