"""Hybrid layouts of published models, from their public configs.

Each preset cites where its figures come from: the model's Hugging Face ``config.json`` and the
transformers config class that derives the per-layer kinds from it. Layer kinds follow those
derivations exactly (which index is global, which local). KV figures are after GQA. Recurrent
states are kept in ``state_dtype`` (bfloat16 by default, the checkpoints' dtype, as vLLM's
``mamba_cache_dtype="auto"`` does), independent of the KV cache dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvblocks.errors import ConfigError
from kvblocks.layouts.plan import CacheGroup, GroupKind, HybridLayout, RecurrentState

__all__ = ["HYBRID_PRESETS", "hybrid_preset"]

_Builder = Callable[[str, int, str], HybridLayout]


@dataclass(frozen=True)
class _Shape:
    """The per-layer attention shape shared by a model's attention groups."""

    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int

    def group(
        self, kind: GroupKind, layers: list[int], *, window: int | None = None, chunk: int | None = None
    ) -> CacheGroup:
        return CacheGroup.attention(
            kind,
            layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            block_size=self.block_size,
            window=window,
            chunk=chunk,
        )


def _split(num_layers: int, is_a: Callable[[int], bool]) -> tuple[list[int], list[int]]:
    """Layer indices for which ``is_a`` holds, and the others."""
    yes = [i for i in range(num_layers) if is_a(i)]
    return yes, [i for i in range(num_layers) if not is_a(i)]


def _gemma_3_27b(dtype: str, block_size: int, state_dtype: str) -> HybridLayout:
    # google/gemma-3-27b-it config.json, text_config: num_hidden_layers 62, num_key_value_heads 16,
    # head_dim 128, sliding_window 1024, sliding_window_pattern 6; transformers Gemma3TextConfig makes
    # layer i "sliding_attention" when (i + 1) % 6 != 0: 52 sliding, 10 global (5, 11, ..., 59).
    sliding, full = _split(62, lambda i: (i + 1) % 6 != 0)
    shape = _Shape(16, 128, dtype, block_size)
    return HybridLayout(
        (
            shape.group("sliding_window", sliding, window=1024),
            shape.group("full", full),
        ),
        "gemma-3-27b",
    )


def _gpt_oss_20b(dtype: str, block_size: int, state_dtype: str) -> HybridLayout:
    # openai/gpt-oss-20b config.json: num_hidden_layers 24, num_key_value_heads 8, head_dim 64,
    # sliding_window 128, layer_types alternating "sliding_attention" (even i) / "full_attention" (odd).
    # The attention sinks are learned per-head parameters, not cache.
    sliding, full = _split(24, lambda i: i % 2 == 0)
    shape = _Shape(8, 64, dtype, block_size)
    return HybridLayout(
        (
            shape.group("sliding_window", sliding, window=128),
            shape.group("full", full),
        ),
        "gpt-oss-20b",
    )


def _llama_4_scout(dtype: str, block_size: int, state_dtype: str) -> HybridLayout:
    # meta-llama/Llama-4-Scout-17B-16E config.json, text_config: num_hidden_layers 48,
    # num_key_value_heads 8, head_dim 128, attention_chunk_size 8192; transformers Llama4TextConfig:
    # no_rope_layer_interval 4, layer i uses RoPE + chunked attention when (i + 1) % 4 != 0, the
    # others (3, 7, ..., 47) are NoPE global attention: 36 chunked, 12 full.
    chunked, full = _split(48, lambda i: (i + 1) % 4 != 0)
    shape = _Shape(8, 128, dtype, block_size)
    return HybridLayout(
        (
            shape.group("chunked_local", chunked, chunk=8192),
            shape.group("full", full),
        ),
        "llama-4-scout",
    )


def _qwen3_next_80b_a3b(dtype: str, block_size: int, state_dtype: str) -> HybridLayout:
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json (= transformers Qwen3NextConfig defaults):
    # num_hidden_layers 48, full_attention_interval 4 (layer i is "linear_attention" when
    # (i + 1) % 4 != 0: 36 Gated DeltaNet, 12 full), num_key_value_heads 2, head_dim 256;
    # linear_num_key_heads 16, linear_num_value_heads 32, linear_key_head_dim 128,
    # linear_value_head_dim 128, linear_conv_kernel_dim 4.
    linear, full = _split(48, lambda i: (i + 1) % 4 != 0)
    state = RecurrentState.gated_delta_net(
        num_key_heads=16, num_value_heads=32, key_head_dim=128, value_head_dim=128, conv_kernel=4, dtype=state_dtype
    )
    return HybridLayout(
        (
            CacheGroup.recurrent(linear, state),
            CacheGroup.attention("full", full, num_kv_heads=2, head_dim=256, dtype=dtype, block_size=block_size),
        ),
        "qwen3-next-80b-a3b",
    )


def _jamba_v0_1(dtype: str, block_size: int, state_dtype: str) -> HybridLayout:
    # ai21labs/Jamba-v0.1 config.json (= transformers JambaConfig defaults): num_hidden_layers 32,
    # attn_layer_period 8, attn_layer_offset 4 (attention at i % 8 == 4: 4, 12, 20, 28; 28 Mamba),
    # hidden_size 4096, num_attention_heads 32 (head_dim 4096 / 32 = 128), num_key_value_heads 8,
    # mamba_d_state 16, mamba_d_conv 4, mamba_expand 2 (d_inner 8192). Mamba-1 state shapes as
    # vLLM keeps them: conv (d_conv - 1) x d_inner, SSM d_inner x d_state.
    attention, mamba = _split(32, lambda i: i % 8 == 4)
    return HybridLayout(
        (
            CacheGroup.recurrent(
                mamba, RecurrentState.mamba1(d_inner=2 * 4096, d_state=16, d_conv=4, dtype=state_dtype)
            ),
            CacheGroup.attention("full", attention, num_kv_heads=8, head_dim=128, dtype=dtype, block_size=block_size),
        ),
        "jamba-v0.1",
    )


HYBRID_PRESETS: dict[str, _Builder] = {
    "gemma-3-27b": _gemma_3_27b,
    "gpt-oss-20b": _gpt_oss_20b,
    "llama-4-scout": _llama_4_scout,
    "qwen3-next-80b-a3b": _qwen3_next_80b_a3b,
    "jamba-v0.1": _jamba_v0_1,
}
"""Published hybrid models: name -> builder(dtype, block_size, state_dtype)."""


def hybrid_preset(
    name: str, *, dtype: str = "bfloat16", block_size: int = 16, state_dtype: str = "bfloat16"
) -> HybridLayout:
    """The layout of a published hybrid model, with the KV ``dtype`` and ``block_size`` given.

    >>> layout = hybrid_preset("gemma-3-27b")
    >>> [(g.kind, g.num_layers) for g in layout.groups]
    [('sliding_window', 52), ('full', 10)]
    """
    builder = HYBRID_PRESETS.get(name)
    if builder is None:
        raise ConfigError(f"no hybrid preset {name!r}; known: {', '.join(HYBRID_PRESETS)}")
    return builder(dtype, block_size, state_dtype)
