"""Helpers for the in-process vLLM engine tests (see ``conftest.py`` for the settings and why). Nothing here
imports vLLM, torch or transformers at import time: the main test environment imports this module too."""

from __future__ import annotations

import gc
import random
import socket
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32
VOCAB_SIZE = 1024
KV_CACHE_BYTES = 64 << 20
MAX_MODEL_LEN = 1024
SLIDING_WINDOW = 64
"""The tiny sliding-window models' window: two blocks, shorter than every test prompt."""
TINY_SHAPE: dict[str, int] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}
"""The tiny models' shape (head_dim 32: the CPU attention backend takes 32, 64, 80, ...)."""
GEMMA3_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
"""A Gemma-3-like model's layers: 0 and 2 slide, 1 and 3 attend to everything (two KV cache groups)."""


def save_random_model(path: Path, model: str, config: str, **fields: Any) -> Path:
    """A checkpoint of transformers' ``model`` class over its ``config`` class with seeded random weights, no
    tokenizer: :data:`TINY_SHAPE` with ``fields`` over it. Returns ``path``."""
    import torch
    import transformers

    settings = getattr(transformers, config)(**{**TINY_SHAPE, **fields})
    torch.manual_seed(0)
    getattr(transformers, model)(settings).save_pretrained(path)
    return path


def build_llm(
    model_dir: Path,
    *,
    kv_transfer_config: dict[str, Any] | None = None,
    kv_events_config: dict[str, Any] | None = None,
    **overrides: Any,
) -> Any:
    """An in-process CPU ``vllm.LLM`` over ``model_dir``: prefix caching on, token-id prompts only, stats kept
    (``llm.get_metrics()``). ``overrides`` replace any engine argument."""
    from vllm import LLM  # type: ignore[import-not-found, unused-ignore]

    args: dict[str, Any] = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "block_size": BLOCK_SIZE,
        "enable_prefix_caching": True,
        "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
        "seed": 0,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "disable_log_stats": False,
    }
    if kv_transfer_config is not None:
        args["kv_transfer_config"] = kv_transfer_config
    if kv_events_config is not None:
        args["kv_events_config"] = kv_events_config
    args.update(overrides)
    return LLM(**args)


def shutdown_llm(llm: Any) -> None:
    """Stops an in-process engine: its worker (and the process-wide worker connector) and its event publisher."""
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def greedy(max_tokens: int = 8) -> Any:
    """Greedy sampling of exactly ``max_tokens`` token ids (no EOS stop: the random model has no real EOS)."""
    from vllm import SamplingParams  # type: ignore[import-not-found, unused-ignore]

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def metric(llm: Any, name: str, **labels: str) -> float:
    """The summed value of the counter/gauge ``name`` (e.g. ``vllm:prefix_cache_hits``) whose labels include
    ``labels``; vLLM keeps these in-process when ``disable_log_stats=False``."""
    total = 0.0
    for m in llm.get_metrics():
        if m.name == name and hasattr(m, "value") and all(m.labels.get(k) == v for k, v in labels.items()):
            total += m.value
    return total


def random_prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids (never 0) of the tiny model's vocabulary, the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB_SIZE) for _ in range(n)]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
