"""What vLLM's hybrid allocator (HMA) buys a sliding-window model through kvblocks' connector, in a real engine.

Runs where vLLM is installed (``.ci/vllm_env.sh``'s environment); skipped elsewhere::

    /tmp/vllmenv/bin/python -m pytest benchmarks/test_bench_vllm_hma.py -q -s

A small Gemma-3-like model (4 layers: 0 and 2 slide over 64 tokens, 1 and 3 attend to everything; random
weights, hidden size 512), 8 prompts of 960 tokens sharing nothing, 8 generated tokens each, vLLM's CPU
engine in this process.

* **KV memory per running sequence**: after every scheduler step, each running request's KV bytes -- per KV
  cache group, its blocks that are not vLLM's null block times the group's bytes per block (its layers'
  pages) -- at its last step (decoding) and its peak (prefill), each averaged over the requests. With the
  connector and HMA on against the connector and HMA off (vLLM then makes every layer full attention).
  Reported: HMA-off bytes / HMA-on bytes.
* **Second-engine wall time**: engine A fills a store; a fresh engine B serves the same prompts from it; the
  generate call's wall time of B against an engine without the connector computing them (both HMA on).
  Reported: without / with (above 1: the store is faster than computing).
"""

from __future__ import annotations

import gc
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from tests.vllm_engine.engine import (
    GEMMA3_LAYER_TYPES,
    SLIDING_WINDOW,
    VOCAB_SIZE,
    build_llm,
    greedy,
    save_random_model,
    shutdown_llm,
)
from tests.vllm_engine.fleet import connector_config

PROMPTS = 8
PROMPT_TOKENS = 960
CHUNK = 256
"""vLLM's token budget per step (chunked prefill): a window group holds a chunk's blocks while it computes."""


def _prompts(seed: int = 11, count: int = PROMPTS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB_SIZE) for _ in range(PROMPT_TOKENS)] for _ in range(count)]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 17M parameters: computing a prompt costs what it does in a real model."""
    return save_random_model(
        tmp_path_factory.mktemp("bench-gemma3"),
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        head_dim=64,
        sliding_window=SLIDING_WINDOW,
        layer_types=GEMMA3_LAYER_TYPES,
    )


def _generate(llm: Any, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(8), use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def _kv_bytes_per_sequence(llm: Any, prompts: list[list[int]]) -> tuple[float, float, list[str]]:
    """The mean over requests of each one's peak KV bytes while running, and of its bytes at its last step
    (decoding), with the KV cache groups vLLM made (see the module docstring)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    groups = scheduler.kv_cache_config.kv_cache_groups
    per_block = [g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups]
    peaks: dict[str, int] = {}
    last: dict[str, int] = {}
    schedule = scheduler.schedule

    def observed_schedule(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        for request in scheduler.running:
            tables = scheduler.kv_cache_manager.get_block_ids(request.request_id)
            held = sum(size * sum(1 for b in table if b != 0) for size, table in zip(per_block, tables, strict=True))
            peaks[request.request_id] = max(peaks.get(request.request_id, 0), held)
            last[request.request_id] = held
        return out

    scheduler.schedule = observed_schedule
    try:
        _generate(llm, prompts)
    finally:
        scheduler.schedule = schedule
    assert len(peaks) == len(prompts)
    names = [type(g.kv_cache_spec).__name__ for g in groups]
    return sum(peaks.values()) / len(peaks), sum(last.values()) / len(last), names


def _close(llm: Any) -> None:
    shutdown_llm(llm)
    gc.collect()


def test_hma_kv_memory_per_running_sequence_through_the_connector(gemma3: Path, tmp_path: Path) -> None:
    prompts = _prompts()
    figures = {}
    for name, hma_off in (("hma-on", False), ("hma-off", True)):
        llm = build_llm(
            gemma3,
            kv_transfer_config=connector_config(tmp_path / name),
            disable_hybrid_kv_cache_manager=hma_off,
            max_num_batched_tokens=CHUNK,
        )
        try:
            figures[name] = _kv_bytes_per_sequence(llm, prompts)
        finally:
            _close(llm)
    (on_peak, on_last, on_groups), (off_peak, off_last, off_groups) = figures["hma-on"], figures["hma-off"]
    assert on_groups == ["SlidingWindowSpec", "FullAttentionSpec"] and off_groups == ["FullAttentionSpec"]
    mib = 2**20
    print(
        f"\nKV bytes per running sequence, HMA off / on: decoding {off_last / mib:.2f} / {on_last / mib:.2f} MiB "
        f"= {off_last / on_last:.2f}x; peak (prefill chunks of {CHUNK}) {off_peak / mib:.2f} / {on_peak / mib:.2f} MiB "
        f"= {off_peak / on_peak:.2f}x"
    )
    # decoding, the window layers hold 3 of the 31 blocks a 968-token sequence fills: (31 + 31) / (31 + 3) = 1.82
    assert off_last / on_last > 1.7


def test_second_engine_wall_time_with_the_connector_against_computing(gemma3: Path, tmp_path: Path) -> None:
    prompts = _prompts()
    store = tmp_path / "store"
    fill = build_llm(gemma3, kv_transfer_config=connector_config(store))
    try:
        _generate(fill, prompts)
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        assert all(tier.flush(60.0) for tier in get_kv_transfer_group().tiers)
    finally:
        _close(fill)
    warm_up = _prompts(seed=12, count=1)  # a prompt of its own: neither engine's first call is timed
    plain = build_llm(gemma3)
    try:
        _generate(plain, warm_up)
        computing, want = _generate(plain, prompts)
    finally:
        _close(plain)
    served = build_llm(gemma3, kv_transfer_config=connector_config(store))
    try:
        _generate(served, warm_up)
        loading, got = _generate(served, prompts)
    finally:
        _close(served)
    assert got == want
    print(f"\nsecond engine: computing {computing:.3f} s, from the store {loading:.3f} s: {computing / loading:.2f}x")
