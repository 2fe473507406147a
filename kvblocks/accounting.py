"""Cached-token accounting: the per-request breakdown and the hit counters.

Two rules from other engines' bug reports are enforced here, in code:

* A :class:`CachedTokens` can never claim more cached tokens than the prompt has
  (SGLang's decode node once reported 128 cached tokens for an 87-token prompt):
  the constructor refuses.
* Hits are counted once per *admitted* request, not per lookup, and re-admissions
  of preempted requests are counted apart, so neither a scheduler that polls
  ``lookup`` nor a preemption storm can inflate the hit rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvblocks.errors import AccountingError

__all__ = ["CacheStats", "CachedTokens", "HitCounters"]


def _check_count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise AccountingError(f"{what} must be an int, got {type(value).__name__}")
    if value < 0:
        raise AccountingError(f"{what} must be >= 0, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class CachedTokens:
    """How many leading prompt tokens are cached, per tier.

    Tiers stack: ``device`` tokens are the first ones, ``host`` tokens follow them and
    ``storage`` tokens follow those::

        prompt   |<- device ->|<- host ->|<- storage ->|<- to compute ->|
                 0                                      total        num_prompt_tokens

    >>> CachedTokens(16, 32, num_prompt_tokens=100).total
    48
    >>> CachedTokens(64, 64, num_prompt_tokens=100)
    Traceback (most recent call last):
    ...
    kvblocks.errors.AccountingError: cached tokens (device 64 + host 64 + storage 0 = 128) exceed the prompt's ...
    """

    device: int = 0
    host: int = 0
    storage: int = 0
    num_prompt_tokens: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        device, host, storage, prompt = self.device, self.host, self.storage, self.num_prompt_tokens
        if not (type(device) is int and type(host) is int and type(storage) is int and type(prompt) is int):
            _check_count(device, "device cached tokens")  # raises with a message naming the culprit
            _check_count(host, "host cached tokens")
            _check_count(storage, "storage cached tokens")
            _check_count(prompt, "num_prompt_tokens")
        if device < 0 or host < 0 or storage < 0 or prompt < 0:
            raise AccountingError(f"cached-token counts must be >= 0, got {device}, {host}, {storage} of {prompt}")
        total = device + host + storage
        if total > prompt:
            raise AccountingError(
                f"cached tokens (device {self.device} + host {self.host} + storage {self.storage} = {total}) "
                f"exceed the prompt's {self.num_prompt_tokens} tokens"
            )

    @property
    def total(self) -> int:
        return self.device + self.host + self.storage

    @property
    def to_compute(self) -> int:
        """Prompt tokens whose KV must still be computed."""
        return self.num_prompt_tokens - self.total


class HitCounters:
    """Monotonic counters of admissions and their cache hits, first admissions and re-admissions apart."""

    __slots__ = (
        "admissions",
        "hit_tokens_device",
        "hit_tokens_host",
        "hit_tokens_storage",
        "queried_tokens",
        "readmission_hit_tokens_device",
        "readmission_hit_tokens_host",
        "readmission_hit_tokens_storage",
        "readmission_queried_tokens",
        "readmissions",
    )

    def __init__(self) -> None:
        self.admissions = 0
        self.queried_tokens = 0
        self.hit_tokens_device = 0
        self.hit_tokens_host = 0
        self.hit_tokens_storage = 0
        self.readmissions = 0
        self.readmission_queried_tokens = 0
        self.readmission_hit_tokens_device = 0
        self.readmission_hit_tokens_host = 0
        self.readmission_hit_tokens_storage = 0

    def record(self, cached: CachedTokens, *, readmission: bool) -> None:
        """Count one admitted request and what was cached for it at admission."""
        if readmission:
            self.readmissions += 1
            self.readmission_queried_tokens += cached.num_prompt_tokens
            self.readmission_hit_tokens_device += cached.device
            self.readmission_hit_tokens_host += cached.host
            self.readmission_hit_tokens_storage += cached.storage
        else:
            self.admissions += 1
            self.queried_tokens += cached.num_prompt_tokens
            self.hit_tokens_device += cached.device
            self.hit_tokens_host += cached.host
            self.hit_tokens_storage += cached.storage

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of a manager's counters and usage.

    ``hit_rate`` covers first admissions only: the share of admitted prompt tokens
    that were served from cache. Re-admissions after preemption are reported apart.
    """

    admissions: int
    queried_tokens: int
    hit_tokens_device: int
    hit_tokens_host: int
    hit_tokens_storage: int
    readmissions: int
    readmission_queried_tokens: int
    readmission_hit_tokens_device: int
    readmission_hit_tokens_host: int
    readmission_hit_tokens_storage: int
    evicted_blocks: int
    num_blocks: int
    blocks_in_use: int
    blocks_cached: int
    blocks_fresh: int

    @property
    def hit_tokens(self) -> int:
        return self.hit_tokens_device + self.hit_tokens_host + self.hit_tokens_storage

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    @property
    def readmission_hit_tokens(self) -> int:
        return (
            self.readmission_hit_tokens_device + self.readmission_hit_tokens_host + self.readmission_hit_tokens_storage
        )

    @property
    def usage(self) -> float:
        """Share of blocks held by sequences."""
        return self.blocks_in_use / self.num_blocks
