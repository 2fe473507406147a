"""vLLM's KV cache groups as the connector stores them: one key space and entry format per group.

With vLLM's hybrid memory allocator (HMA) a model's attention layers come in groups of one kind each, every
group with a block table of its own; a Gemma-3-like model has two::

    group 0  sliding window 64   layers 0, 2   holds only the blocks of the last 63 tokens
    group 1  full attention      layers 1, 3   holds every block

Block ``i`` of every group holds tokens ``[i * bs, (i + 1) * bs)``, so all groups share vLLM's chained hashes;
what differs is which blocks a hit needs (:mod:`kvblocks.core.groups.hits`: kvblocks' own rules) and whose layers
a block holds. Each group therefore stores under a key space of its own (:func:`~kvblocks.tiers.entry.group_tag`
over the deployment's tag: the group's number, kind, block size and span) and an entry format naming its layers,
so groups never read each other's entries. Mamba / linear-attention state is refused (:class:`ConfigError`):
kvblocks does not store recurrent state through vLLM yet.

A deployment with one full-attention group keeps the single-group key space (:func:`describe_format`), so
stores written before HMA support stay readable.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kvblocks.backends.spec import DTYPE_SIZES
from kvblocks.core.groups.hits import GroupHitRule
from kvblocks.errors import ConfigError
from kvblocks.integrations.vllm.kv_format import VllmKVFormat
from kvblocks.tiers.entry import group_tag

__all__ = ["VllmGroup", "describe_format", "describe_groups", "is_hybrid"]

_KINDS = {
    "FullAttentionSpec": "full",
    "SlidingWindowSpec": "sliding_window",
    "ChunkedLocalAttentionSpec": "chunked_local",
}
"""vLLM's attention spec classes the connector stores, and kvblocks' kind for each (by exact class name:
a subclass such as MLA's spec lays its KV out differently and is refused until it is described). A
``FullAttentionSpec`` with a window (a sliding-window model with HMA off) is stored as full attention."""


@dataclass(frozen=True)
class VllmGroup:
    """One of vLLM's KV cache groups as stored blocks.

    >>> fmt = VllmKVFormat("tiny", "float32", 2, (2, 32, 64), 32, "sha256", layout="cpu:g0")
    >>> g = VllmGroup(0, "sliding_window", 64, ("l0", "l2"), fmt, hybrid=True)
    >>> g.rule.kind, g.rule.span, g.tag != fmt.tag
    ('sliding_window', 64, True)
    """

    number: int
    """vLLM's index of the group (``kv_cache_config.kv_cache_groups[number]``)."""
    kind: str
    """kvblocks' kind: ``full``, ``sliding_window`` or ``chunked_local``."""
    span: int | None
    """The tokens a sliding window attends to (its window plus vLLM's extra retained tokens), or the chunk size."""
    layer_names: tuple[str, ...]
    """The group's attention layers (a stored block holds each one's block, in layer order)."""
    format: VllmKVFormat
    """The stored-block format of the group's layers."""
    hybrid: bool = False
    """Whether the deployment has other groups, or a group that is not full attention (its keys then name
    the group)."""

    @cached_property
    def rule(self) -> GroupHitRule:
        """What a hit needs of this group (kvblocks' hit rules)."""
        return GroupHitRule(self.kind, self.format.block_size, self.span)

    @cached_property
    def tag(self) -> str:
        """The key space: the deployment's, or (hybrid) the group's own under it."""
        fmt = self.format
        if not self.hybrid:
            return fmt.tag
        return group_tag(fmt.tag, self.number, self.kind, fmt.block_size, self.span or 0)


def _kind_of(number: int, spec: Any) -> tuple[str, int | None]:
    name = type(spec).__name__
    kind = _KINDS.get(name)
    if kind is None:
        what = " (Mamba / linear-attention state is not stored yet)" if "Mamba" in name else ""
        raise ConfigError(
            f"KVBlocksConnector stores full-attention, sliding-window and chunked-local KV; "
            f"KV cache group {number} is {name}{what}"
        )
    if kind == "full":
        # A windowed model without HMA: vLLM keeps every block (full-attention memory) and attends to a window.
        # Every block is stored and a hit needs all of them, as for full attention: more than the window needs.
        return kind, None
    if kind == "sliding_window":
        return kind, int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0)
    return kind, int(spec.attention_chunk_size)


def _format(vllm_config: Any, kv_cache_config: Any, number: int, salt: str | None, suffix: str) -> VllmKVFormat:
    group = kv_cache_config.kv_cache_groups[number]
    spec = group.kv_cache_spec
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError("KVBlocksConnector does not support pipeline parallelism yet")
    dtype = str(spec.dtype).removeprefix("torch.")
    if dtype not in DTYPE_SIZES:
        raise ConfigError(f"KV cache dtype {dtype} is not one kvblocks stores")
    block_size = int(spec.block_size)
    if block_size != int(vllm_config.cache_config.block_size):
        raise ConfigError(
            f"KV cache group {number} has blocks of {block_size} tokens, vLLM hashes blocks of "
            f"{vllm_config.cache_config.block_size}: the connector needs one block size"
        )
    from vllm.platforms import current_platform

    parts = (
        current_platform.device_type,
        kv_cache_config.kv_cache_layout,
        f"kv{spec.num_kv_heads}",
        f"hs{spec.head_size}",
        f"tp{parallel.tensor_parallel_size}",
    )
    return VllmKVFormat(
        model=str(vllm_config.model_config.model),
        dtype=dtype,
        num_layers=len(group.layer_names),
        block_shape=(int(spec.page_size_bytes) // DTYPE_SIZES[dtype],),
        block_size=block_size,
        hash_algo=str(vllm_config.cache_config.prefix_caching_hash_algo),
        layout=":".join(str(part) for part in parts) + suffix,
        salt=salt,
    )


def is_hybrid(kv_cache_config: Any) -> bool:
    """Whether a KV cache config needs the per-group (HMA) path: more than one group, or one that is not full
    attention."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    return len(groups) != 1 or type(groups[0].kv_cache_spec).__name__ != "FullAttentionSpec"


def describe_format(vllm_config: Any, kv_cache_config: Any, salt: str | None) -> VllmKVFormat:
    """The stored-block format of a deployment with one full-attention group (the single-group key space)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        raise ConfigError(f"describe_format describes one KV cache group; this config has {len(groups)}")
    kind, _ = _kind_of(0, groups[0].kv_cache_spec)
    if kind != "full":
        raise ConfigError(f"describe_format describes full attention, not {type(groups[0].kv_cache_spec).__name__}")
    return _format(vllm_config, kv_cache_config, 0, salt, "")


def describe_groups(vllm_config: Any, kv_cache_config: Any, salt: str | None) -> tuple[VllmGroup, ...]:
    """Every KV cache group of a deployment as stored blocks (see the module docstring); raises
    :class:`ConfigError` for a group kind the connector does not store."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not groups:
        raise ConfigError("the KV cache config has no KV cache groups")
    hybrid = is_hybrid(kv_cache_config)
    described = []
    for number, group in enumerate(groups):
        kind, span = _kind_of(number, group.kv_cache_spec)
        suffix = f":g{number}:{kind}:{span}" if hybrid else ""
        fmt = _format(vllm_config, kv_cache_config, number, salt, suffix)
        described.append(VllmGroup(number, kind, span, tuple(group.layer_names), fmt, hybrid))
    return tuple(described)
