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

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice

from kvblocks.errors import AccountingError

__all__ = ["LIFETIME_BUCKETS", "BlockLifetimes", "CacheStats", "CachedTokens", "HitCounters", "Histogram"]

DEFAULT_SAMPLE_EVERY = 32
"""One evicted block in this many is observed by :class:`BlockLifetimes` by default."""

LIFETIME_BUCKETS: tuple[float, ...] = (0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 600, 1800, 3600, math.inf)
"""Upper bounds (seconds) of the block lifetime and idle-before-eviction histograms' buckets."""


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

    @classmethod
    def counted(cls, device: int, num_prompt_tokens: int, host: int = 0, storage: int = 0) -> CachedTokens:
        """Counts the cache computed itself (ints >= 0, their sum within the prompt), taken as they are: what an
        admission and a lookup return, without the checks that guard values from outside (a third the time).

        >>> CachedTokens.counted(16, 100) == CachedTokens(16, num_prompt_tokens=100)
        True
        """
        tokens = object.__new__(cls)
        assign = object.__setattr__  # the class is frozen
        assign(tokens, "device", device)
        assign(tokens, "host", host)
        assign(tokens, "storage", storage)
        assign(tokens, "num_prompt_tokens", num_prompt_tokens)
        return tokens

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
        "preemptions",
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
        self.preemptions = 0  # sequences preempted (their next admission is a re-admission)

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
    preemptions: int = 0

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


class Histogram:
    """Counts of observed values per bucket (upper bounds inclusive, as Prometheus' ``le``), and their sum."""

    __slots__ = ("_bounds", "bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float] = LIFETIME_BUCKETS) -> None:
        if not bounds or bounds[-1] != math.inf or list(bounds) != sorted(set(bounds)):
            raise AccountingError(f"bucket bounds must increase and end with inf, got {bounds!r}")
        self.bounds = tuple(float(b) for b in bounds)
        self._bounds = self.bounds[:-1]  # the last bucket (+Inf) takes the rest
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self._bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[int]:
        """Counts of values <= each bound (what Prometheus exposes)."""
        out, running = [], 0
        for c in list(self.counts):  # a copy: a scrape may read while the scheduler observes
            running += c
            out.append(running)
        return out


class BlockLifetimes:
    """How long evicted blocks lived, and how long they sat idle before their eviction.

    Observed only when blocks are evicted, from two timestamps per block id the pool keeps
    anyway: when it was last handed out fresh (its allocation) and when it last became idle
    (its last release). One evicted block in ``sample_every`` is observed (every one with 1),
    as vLLM samples the same pair (``kv_block_lifetime_seconds``,
    ``kv_block_idle_before_evict_seconds``): the histograms describe the distribution, and
    ``count * sample_every`` is the number of evictions to within ``sample_every``. Skipping
    is done by ``islice`` in C, so an evicted block that is not sampled costs nothing.
    """

    __slots__ = ("_skip", "idle", "lifetime", "sample_every")

    def __init__(self, bounds: Sequence[float] = LIFETIME_BUCKETS, sample_every: int = DEFAULT_SAMPLE_EVERY) -> None:
        if isinstance(sample_every, bool) or not isinstance(sample_every, int) or sample_every < 1:
            raise AccountingError(f"sample_every must be an int >= 1, got {sample_every!r}")
        self.lifetime = Histogram(bounds)
        self.idle = Histogram(bounds)
        self.sample_every = sample_every
        self._skip = 0  # evicted blocks to pass over before the next observed one

    def passes_over(self, evicted: int) -> bool:
        """Count ``evicted`` evictions none of which is due for a sample, and say so (True); False, counting
        nothing, when one of them is due (then :meth:`observe` records them). Spares the evicting path the
        clock and the pairs it would hand :meth:`observe` for nothing, 31 times in 32."""
        skip = min(self._skip, self.sample_every - 1)
        if skip < evicted:
            return False
        self._skip = skip - evicted  # what observe leaves: (skip - evicted) % sample_every
        return True

    def observe(
        self, now: float, taken_at: Sequence[float], idle_since: Iterable[tuple[int, float]], evicted: int
    ) -> None:
        """Record the first ``evicted`` ``(block, when it became idle)`` pairs of ``idle_since``, evicted at
        ``now``; ``taken_at[block]`` is when the block was allocated."""
        step = self.sample_every
        skip = min(self._skip, step - 1)  # sample_every may have been lowered since
        lifetime = self.lifetime
        idle = self.idle
        for b, released_at in islice(idle_since, skip, evicted, step):
            lifetime.observe(now - taken_at[b])
            idle.observe(now - released_at)
        self._skip = (skip - evicted) % step
