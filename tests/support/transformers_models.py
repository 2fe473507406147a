"""Tiny transformers models and their reference outputs, shared by the transformers integration tests.

Built from configs with random weights (fixed seed, float32, CPU, no downloads). The reference is
``model.generate`` (greedy, EOS disabled) with transformers' own cache.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
import transformers

from kvblocks.integrations.transformers import PagedGenerator

VOCAB = 128
WINDOW = 6
SIZES: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES)),
    # layer 0 full, layer 1 a sliding window: a hybrid manager with a window group
    "qwen2": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    ),
    # every layer a window smaller than the prompts
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**SIZES, sliding_window=WINDOW)),
    # q/k norms before attention, explicit head_dim
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZES, head_dim=16)),
    # alternating sliding/full layers, attention logit soft-capping, query_pre_attn_scalar scaling
    "gemma2": lambda: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**SIZES, head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=10)
    ),
}

# Learned absolute positions; the attention call gets no extra keyword arguments (GPT-2, GPT-BigCode), a causal
# mask the model builds itself (OPT), or comes from a class without ``_supports_attention_backend`` (GPT-BigCode,
# BioGPT). Wider initial weights than the default: the greedy tokens of the tiny models vary.
GPT2_SIZES: dict[str, Any] = dict(
    vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=256, initializer_range=0.3
)
LEARNED_SIZES: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256
)
LEARNED_POSITIONS: dict[str, Callable[[], Any]] = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_SIZES)),
    # a scale only GPT-2's eager attention applies (its sdpa ignores it): the reference runs eager
    "gpt2-inverse-layer-scale": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(**GPT2_SIZES, scale_attn_by_inverse_layer_idx=True, attn_implementation="eager")
    ),
    # multi-query attention: one K/V head for 4 query heads
    "gpt_bigcode": lambda: transformers.GPTBigCodeForCausalLM(transformers.GPTBigCodeConfig(**GPT2_SIZES)),
    # its own causal mask
    "opt": lambda: transformers.OPTForCausalLM(
        transformers.OPTConfig(**LEARNED_SIZES, ffn_dim=64, word_embed_proj_dim=32)
    ),
    "biogpt": lambda: transformers.BioGptForCausalLM(
        transformers.BioGptConfig(**LEARNED_SIZES, intermediate_size=64, initializer_range=0.3, scale_embedding=False)
    ),
}


@functools.cache
def model(family: str) -> Any:
    torch.manual_seed(0)
    built = {**FAMILIES, **LEARNED_POSITIONS}[family]().eval()
    built.generation_config.eos_token_id = None  # EOS disabled: every run makes max_new_tokens tokens
    return built


@functools.lru_cache(maxsize=512)
def reference(family: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' own greedy generation: the new tokens and the logits each was picked from."""
    ids = torch.tensor([prompt])
    out = model(family).generate(
        ids,
        attention_mask=torch.ones_like(ids),  # explicit: a prompt may hold the pad token id
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences[0, len(prompt) :].tolist(), torch.stack(out.logits)[:, 0]


def shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    """Two system prompts (longer than the window), users' turns after them, one conversation continued."""
    rng = random.Random(seed)
    system_a = [rng.randrange(VOCAB) for _ in range(13)]
    system_b = [rng.randrange(VOCAB) for _ in range(9)]
    user = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))] for _ in range(5)]
    return [
        system_a + user[0],
        system_b + user[1],
        system_a + user[2],
        system_a + user[0] + user[3],
        system_b + user[4],
    ]


def assert_matches_reference(family: str, gen: PagedGenerator, prompts: list[list[int]], outs: list[list[int]]) -> None:
    for prompt, tokens, logits in zip(prompts, outs, gen.last_logits, strict=True):
        ref_tokens, ref_logits = reference(family, tuple(prompt), len(tokens))
        assert tokens == ref_tokens
        assert torch.allclose(logits, ref_logits, atol=1e-4, rtol=0), float((logits - ref_logits).abs().max())
