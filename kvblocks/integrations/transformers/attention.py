"""The ``"kvblocks"`` attention function: the step's new K/V into their slots, attention over each context.

transformers' attention modules call it through ``AttentionInterface`` with their queries, keys and
values; what the call needs beyond them -- the step's block tables, slot mappings and caches -- comes
from a context variable that :func:`step_scope` sets around the forward pass. Not through keyword
arguments of ``model(...)``: GPT-2 and GPT-BigCode drop those before their attention call.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface

from kvblocks.attention import StepMetadata, gather_kv, write_kv
from kvblocks.backends.cache import KVCache
from kvblocks.errors import ConfigError
from kvblocks.integrations.transformers.layout import Layout

ATTENTION_NAME = "kvblocks"
"""The name the paged attention function is registered under in transformers' ``AttentionInterface``."""


@dataclass(frozen=True, eq=False)
class Step:
    """What every layer's attention call of one forward pass shares: the step's kvblocks metadata
    (valid for this step only), the caches, and the per-sequence offsets as host ints (no device sync per layer)."""

    layout: Layout
    caches: Sequence[KVCache]
    meta: StepMetadata
    starts: list[int]  # each sequence's first new position (its committed line)
    query_starts: list[int]  # where each sequence's new tokens start in the packed row; num_seqs + 1


@dataclass(frozen=True, eq=False)
class Call:
    """What one attention call of a probe forward pass received."""

    layer: int | None  # the module's layer_idx
    query: torch.Tensor  # [1, heads, tokens, head_dim]
    key: torch.Tensor  # [1, kv_heads, tokens, head_dim]
    value_dim: int
    mask: torch.Tensor | None
    window: int | None  # the sliding_window it passed
    causal: bool


@dataclass(eq=False)
class Probe:
    """In place of a step: the attention calls of one forward pass are recorded, and answered with zeros."""

    calls: list[Call] = field(default_factory=list)


_CURRENT: ContextVar[Step | Probe | None] = ContextVar("kvblocks_step", default=None)
"""The step (or probe) of the forward pass running in this context. Each thread and each asyncio task has
its own value, so a generator in another thread never sees it; :func:`step_scope` resets it."""


@contextmanager
def step_scope(step: Step | Probe) -> Iterator[None]:
    """``step`` is what the attention function sees for the length of the block, even if the block raises."""
    token = _CURRENT.set(step)
    try:
        yield
    finally:
        _CURRENT.reset(token)


@contextmanager
def kvblocks_attention(config: Any) -> Iterator[None]:
    """The model's attention modules call the kvblocks attention for the length of the block."""
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature over paged KV: write the new K/V, attend over each context.

    ``query`` is ``[1, heads, tokens, head_dim]``, ``key``/``value`` ``[1, kv_heads, tokens,
    head_dim]`` for the packed tokens of every sequence; the output is ``[1, tokens, heads, head_dim]``.
    """
    step = _CURRENT.get()
    if isinstance(step, Probe):
        return _record(step, module, query, key, value, attention_mask, kwargs), None
    if step is None:
        raise ConfigError(
            f"the {ATTENTION_NAME!r} attention runs inside PagedGenerator's forward passes only; "
            "set the model's attention implementation back to call the model directly"
        )
    layout = step.layout
    if attention_mask is not None and not layout.own_mask:
        raise ConfigError("transformers built an attention mask for the kvblocks attention; it relies on none")
    layer: int = module.layer_idx  # type: ignore[assignment]
    window = layout.windows[layer]
    if (kwargs.get("sliding_window") or None) != window:
        raise ConfigError(
            f"layer {layer} attends with sliding_window={kwargs.get('sliding_window')!r}, "
            f"but its config says {window!r}"
        )
    group = layout.group_of(layer)  # the builder's groups are (0,) or (0, 1): FULL_GROUP, WINDOW_GROUP
    cache = step.caches[group]
    index = layout.index_in_group(layer)
    dtype = cache.spec.torch_dtype()
    new_keys, new_values = key[0].transpose(0, 1).to(dtype), value[0].transpose(0, 1).to(dtype)
    write_kv(cache, index, step.meta.slot_mappings[group], new_keys, new_values)
    table = step.meta.block_tables[group]
    scale = _scale(module, scaling, query.shape[-1])
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])
    for seq, start in enumerate(step.starts):
        lo, hi = step.query_starts[seq], step.query_starts[seq + 1]
        first = max(0, start - window + 1) if window else 0
        keys, values = gather_kv(cache, index, table[seq], start + hi - lo, start=first)
        context = torch.arange(first, start + hi - lo, device=query.device)
        positions = step.meta.positions[lo:hi]
        out[lo:hi] = attend(query[0, :, lo:hi], keys, values, context, positions, window, scale, kwargs.get("softcap"))
    return out.unsqueeze(0), None


def _scale(module: torch.nn.Module, scaling: float | None, head_dim: int) -> float:
    """The call's ``scaling``; without one, GPT-2's rule from its module (its eager attention's: 1/sqrt(head_dim)
    unless ``scale_attn_weights`` is off, divided by layer + 1 with ``scale_attn_by_inverse_layer_idx``)."""
    if scaling is not None:
        return scaling
    scale = head_dim**-0.5 if getattr(module, "scale_attn_weights", True) else 1.0
    if getattr(module, "scale_attn_by_inverse_layer_idx", False):
        scale /= module.layer_idx + 1  # type: ignore[operator]
    return scale


def _record(
    probe: Probe,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    layer = getattr(module, "layer_idx", None)
    causal = kwargs.get("is_causal")
    probe.calls.append(
        Call(
            layer=layer if isinstance(layer, int) else None,
            query=query.detach().clone(),
            key=key.detach().clone(),
            value_dim=value.shape[-1],
            mask=mask if isinstance(mask, torch.Tensor) else None,
            window=kwargs.get("sliding_window") or None,
            causal=bool(getattr(module, "is_causal", True) if causal is None else causal),
        )
    )
    return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor | None,
    key_positions: torch.Tensor,
    positions: torch.Tensor,
    window: int | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """One sequence's attention: ``query`` ``[heads, n, dim]`` at ``positions`` over its context ``keys``/``values``
    ``[context, kv_heads, dim]`` at ``key_positions``; ``[n, heads, dim]``."""
    if values is None:  # pragma: no cover - the generator's caches always hold V
        raise ConfigError("the kvblocks attention needs a cache with values")
    repeat = query.shape[0] // keys.shape[1]
    k = keys.transpose(0, 1).repeat_interleave(repeat, dim=0).to(query.dtype)
    v = values.transpose(0, 1).repeat_interleave(repeat, dim=0).to(query.dtype)
    scores = torch.matmul(query, k.transpose(1, 2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    visible = key_positions[None, :] <= positions[:, None]
    if window:
        visible &= key_positions[None, :] > positions[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, v).transpose(0, 1)


AttentionInterface.register(ATTENTION_NAME, paged_attention)
