"""How a :class:`~kvblocks.routing.router.Router` scores workers: :class:`RouterConfig`, validated once, and the
tiers and hash forms it knows."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvblocks.errors import ConfigError
from kvblocks.hashing import DEFAULT_SCHEME, HASH_SCHEMES, BlockHash, Namespace, sglang_int_hash, vllm_int_hash

__all__ = ["HASH_FORMS", "TIERS", "RouterConfig"]

TIERS = ("device", "host", "storage")
HASH_FORMS: dict[str, Callable[[BlockHash], BlockHash] | None] = {
    "native": None,
    "vllm-int64": vllm_int_hash,
    "sglang-int64": sglang_int_hash,
}
"""How the workers' events write a block hash: as the scheme makes it (``"native"``), as vLLM's 64-bit
integer form (``"vllm-int64"``, vLLM's default: :func:`kvblocks.hashing.vllm_int_hash`), or as SGLang's
(``"sglang-int64"``: :func:`kvblocks.hashing.sglang_int_hash`)."""


@dataclass(frozen=True)
class RouterConfig:
    """How a :class:`Router` scores workers, validated once.

    >>> RouterConfig(block_size=16, mode="approximate").approx_ttl_s
    120.0
    >>> RouterConfig(block_size=16, temperature=-1)
    Traceback (most recent call last):
    ...
    kvblocks.errors.ConfigError: temperature must be a number >= 0, got -1
    """

    block_size: int
    hash_scheme: str = DEFAULT_SCHEME
    namespace: Namespace | str = "default"
    hash_form: str = "native"
    """How the workers' events write hashes (:data:`HASH_FORMS`): ``"vllm-int64"`` with a vLLM scheme
    (``hash_scheme="vllm-sha256"``) indexes a vLLM fleet by recomputing its hashes from the prompt's tokens."""
    mode: str = "precise"
    """precise: indexes follow workers' KV events; approximate: the router's own routing decisions, with a TTL."""
    approx_ttl_s: float = 120.0
    prefill_weight: float = 1.0
    decode_weight: float = 128.0
    """Prefill tokens one running sequence weighs (decode work keeps a worker busy too)."""
    overlap_credit: float = 1.0
    tier_weights: tuple[tuple[str, float], ...] = (("device", 1.0), ("host", 0.5), ("storage", 0.25))
    temperature: float = 0.0
    seed: int | None = 0
    silent_after_s: float = 30.0
    """Precise mode: a worker routed to with no event for this long is reported silent."""
    eviction_weight: float = 0.2
    """Precise mode: cost (in blocks) per block a worker evicted recently, scaled by the share of the
    prompt that would be new there: prompts that bring many new blocks avoid workers whose caches are
    thrashing, while continuations stay with the worker that holds them."""
    eviction_half_life: int = 64
    """Routes after which recent evictions count half."""

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ConfigError(f"block_size must be a positive int, got {self.block_size!r}")
        if self.mode not in ("precise", "approximate"):
            raise ConfigError(f"mode must be 'precise' or 'approximate', got {self.mode!r}")
        for name in ("approx_ttl_s", "silent_after_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a number > 0, got {value!r}")
        half_life = self.eviction_half_life
        if isinstance(half_life, bool) or not isinstance(half_life, int) or half_life < 1:
            raise ConfigError(f"eviction_half_life must be an int >= 1, got {half_life!r}")
        for name in ("prefill_weight", "decode_weight", "overlap_credit", "temperature", "eviction_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}")
        if self.hash_scheme not in HASH_SCHEMES:
            known = ", ".join(sorted(HASH_SCHEMES))
            raise ConfigError(f"unknown hash scheme {self.hash_scheme!r}; known: {known}")
        if not isinstance(self.hash_form, str) or self.hash_form not in HASH_FORMS:
            raise ConfigError(f"hash_form must be one of {', '.join(HASH_FORMS)}, got {self.hash_form!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an int or None, got {self.seed!r}")
        message = f"tier_weights must be (tier, weight) pairs, tiers among {TIERS}, weights numbers >= 0"
        try:
            weights = dict(self.tier_weights)
        except (TypeError, ValueError):
            raise ConfigError(f"{message}; got {self.tier_weights!r}") from None
        if set(weights) - set(TIERS) or any(
            isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0 or math.isinf(w)
            for w in weights.values()
        ):
            raise ConfigError(f"{message}; got {self.tier_weights!r}")
        object.__setattr__(self, "tier_weights", tuple(weights.items()))
        object.__setattr__(self, "namespace", Namespace.of(self.namespace))
