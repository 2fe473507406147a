"""Issue 15: per decode step of a tiny model, kvblocks' own time (the manager's step and the step metadata build)
as a share of the whole step (schedule, metadata, the forward pass, sampling).

A random Llama (4 layers, hidden 128, GQA) decodes a batch of 16 sequences through ``PagedGenerator`` on the
CPU. The manager's ``step`` and the builder's ``build`` are timed where the generator calls them, and the
step from one ``after_step`` to the next, so both sides of the share come from the same step (no drift between
them). Only decode steps (one new token per running sequence, 16 of them) count. The reference attention's
K/V I/O (``write_kv`` + ``gather_kv``, part of the forward pass) is reported beside it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
import transformers

import kvblocks.integrations.transformers.attention as integration  # where the paged attention looks its K/V I/O up
from kvblocks.integrations.transformers import PagedGenerator

BATCH = 16
PROMPT = 32
NEW_TOKENS = 64


def _model() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return transformers.LlamaForCausalLM(config).eval()


class _Clock:
    """Seconds spent in wrapped calls since the last ``take``."""

    def __init__(self) -> None:
        self.spent = 0.0

    def wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - start

        return timed

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


def test_decode_step_kvblocks_share_of_a_tiny_model(benchmark, monkeypatch: pytest.MonkeyPatch) -> None:
    new_tokens = 4 if benchmark.disabled else NEW_TOKENS
    prompts = [[(7 * i + j) % 512 for j in range(PROMPT)] for i in range(BATCH)]  # no shared prefix
    kvblocks_clock, io_clock = _Clock(), _Clock()
    steps: list[tuple[float, float, float]] = []  # decode steps: (whole step, kvblocks, reference K/V I/O)
    state: dict[str, Any] = {"mark": 0.0, "tokens": 0}

    def after(gen: PagedGenerator) -> None:
        now = time.perf_counter()
        kvblocks_time, io_time = kvblocks_clock.take(), io_clock.take()
        if state["tokens"] == BATCH and state["mark"]:  # a pure decode step of the whole batch
            steps.append((now - state["mark"], kvblocks_time, io_time))
        state["mark"] = time.perf_counter()

    gen = PagedGenerator(_model(), num_blocks=BATCH * 8, block_size=16, max_running=BATCH, after_step=after)
    build = gen._builder.build

    def counted_build(seq_ids: Any, num_new_tokens: Any) -> Any:
        meta = build(seq_ids, num_new_tokens)
        state["tokens"] = meta.num_tokens
        return meta

    monkeypatch.setattr(gen.manager, "step", kvblocks_clock.wrap(gen.manager.step))
    monkeypatch.setattr(gen._builder, "build", kvblocks_clock.wrap(counted_build))
    monkeypatch.setattr(integration, "write_kv", io_clock.wrap(integration.write_kv))
    monkeypatch.setattr(integration, "gather_kv", io_clock.wrap(integration.gather_kv))
    outs: list[list[list[int]]] = []

    def run() -> None:
        steps.clear()
        state["mark"] = 0.0
        outs.append(gen.generate(prompts, max_new_tokens=new_tokens))

    benchmark.group = "integration-decode-16"
    benchmark.extra_info["subject"] = "kvblocks step + metadata"
    benchmark.pedantic(run, rounds=1, iterations=1)

    # every step after the first (the prefill, which also samples the first token) decodes the whole batch
    assert len(steps) == new_tokens - 1 and all(len(o) == new_tokens for o in outs[-1])
    assert all(0 < kv < whole and 0 < io < whole for whole, kv, io in steps)
    share = statistics.median(kv / whole for whole, kv, _ in steps)
    forward_share = statistics.median(kv / (whole - kv) for whole, kv, _ in steps)
    io_share = statistics.median(io / whole for whole, _, io in steps)
    benchmark.extra_info.update(
        batch=BATCH,
        decode_steps=len(steps),
        step_us=statistics.median(whole for whole, _, _ in steps) * 1e6,
        kvblocks_us=statistics.median(kv for _, kv, _ in steps) * 1e6,
        kvblocks_share_of_step=share,
        kvblocks_vs_rest_of_step=forward_share,
        reference_kv_io_share_of_step=io_share,
    )
    print(
        f"\ndecode step of {BATCH}: kvblocks step + metadata {share:.1%} of the step "
        f"({forward_share:.1%} of the rest: forward + sampling); reference write_kv + gather_kv {io_share:.1%}"
    )
