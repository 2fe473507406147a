"""kvblocks' KV connector with vLLM's hybrid memory allocator (HMA), each engine a process of its own.

Two tiny random models whose sliding window (64 tokens, two blocks) is shorter than every prompt:

* Gemma-3-like: layers 0 and 2 slide, 1 and 3 attend to everything -- two KV cache groups;
* Mistral: every layer slides -- one sliding-window group (vLLM makes it full attention without HMA).

Engine A fills a store; a fresh engine B hits it. Expected counts follow the rules, not the engine: a P-token
prompt reuses ``(P - 1) // 32`` blocks; the full-attention group loads all of them, the window group only the
two blocks before the hit (tokens ``[h - 63, h)``); every group saves each block filled once. Outputs are compared
with a baseline engine (HMA on, no connector) over the same prompts.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_engine.engine import BLOCK_SIZE, SLIDING_WINDOW, VOCAB_SIZE
from tests.vllm_engine.fleet import chain_positions, connector_config, damage_store, entries, hash_of_key, run_engine

MAX_TOKENS = 8
LOGPROB_TOLERANCE = 1e-4
HMA_OFF_LINE = "Turning off hybrid kv cache manager"
LOOKUP_TIMEOUT_S = 60.0
WINDOW_BLOCKS = -(-(SLIDING_WINDOW - 1) // BLOCK_SIZE)  # blocks a hit needs of a window group: 2


def _config(store: Path) -> dict[str, Any]:
    """The connector on ``store``, with a lookup deadline no probe reaches on a busy machine: a hit then depends on
    what the store holds, not on how fast its reader thread answered (the counts below are exact)."""
    return connector_config(store, lookup_timeout_s=LOOKUP_TIMEOUT_S)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(1, VOCAB_SIZE) for _ in range(200)]  # 6 full blocks and 8 tokens
    return [shared + [rng.randrange(1, VOCAB_SIZE) for _ in range(37 + 23 * i)] for i in range(4)]


PROMPTS = _prompts()
REUSABLE = [(len(p) - 1) // BLOCK_SIZE for p in PROMPTS]  # 7, 8, 8, 9 blocks


def _filled() -> int:
    """Distinct full blocks the requests fill: prompt and output but the last token, shared blocks once."""
    tokens = [p + [0] * MAX_TOKENS for p in PROMPTS]  # only the count of full blocks matters
    return len({(tuple(t[: (i + 1) * BLOCK_SIZE])) for t in tokens for i in range((len(t) - 1) // BLOCK_SIZE)})


def _same_outputs(result: dict[str, Any], baseline: dict[str, Any]) -> None:
    for got, want in zip(result["outputs"], baseline["outputs"], strict=True):
        assert got["tokens"] == want["tokens"]
        assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)) < LOGPROB_TOLERANCE


def _log(workdir: Path, name: str) -> str:
    return (workdir / f"{name}.log").read_text()


@pytest.fixture(scope="module")
def gemma3_fill(tiny_gemma3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The Gemma-3-like model's baseline (HMA on, no connector) and engine A's filled store."""
    workdir = tmp_path_factory.mktemp("hma-gemma3")
    store = workdir / "store"
    baseline = run_engine(tiny_gemma3_dir, PROMPTS, workdir, "baseline", max_tokens=MAX_TOKENS, logprobs=1)
    a = run_engine(tiny_gemma3_dir, PROMPTS, workdir, "a", max_tokens=MAX_TOKENS, kv_transfer_config=_config(store))
    return {"workdir": workdir, "store": store, "baseline": baseline, "a": a}


def test_the_connector_keeps_vllms_hybrid_allocator_on_and_saves_every_group(gemma3_fill: dict[str, Any]) -> None:
    a, workdir = gemma3_fill["a"], gemma3_fill["workdir"]
    assert HMA_OFF_LINE not in _log(workdir, "a")
    assert a["kv_cache_groups"] == ["SlidingWindowSpec", "FullAttentionSpec"]
    connector = a["connector"]
    assert connector["hybrid"] and [kind for kind, _, _ in connector["groups"]] == ["sliding_window", "full"]
    assert connector["groups"][0][1] == SLIDING_WINDOW
    filled = _filled()
    assert [tier["saves_queued"] for tier in connector["tiers"]] == [filled, filled]
    assert connector["worker"]["save_blocks"] == 2 * filled and connector["writer_dropped"] == 0
    tags = {key.split(".")[1] for key in entries(gemma3_fill["store"])}
    assert tags == {tag for _, _, tag in connector["groups"]}  # each group under a key space of its own
    _same_outputs(a, gemma3_fill["baseline"])


def test_a_second_engine_hits_every_group_and_loads_only_the_window_a_sliding_group_needs(
    tiny_gemma3_dir: Path, gemma3_fill: dict[str, Any]
) -> None:
    workdir = gemma3_fill["workdir"]
    b = run_engine(
        tiny_gemma3_dir,
        PROMPTS,
        workdir,
        "b",
        max_tokens=MAX_TOKENS,
        kv_transfer_config=_config(gemma3_fill["store"]),
    )
    assert HMA_OFF_LINE not in _log(workdir, "b")
    assert b["metrics"]["vllm:external_prefix_cache_hits"] == sum(REUSABLE) * BLOCK_SIZE
    window_tier, full_tier = b["connector"]["tiers"]
    assert full_tier["loads_hit"] == sum(REUSABLE)
    assert window_tier["loads_hit"] == WINDOW_BLOCKS * len(PROMPTS)
    assert b["connector"]["worker"]["load_failed_blocks"] == 0
    _same_outputs(b, gemma3_fill["baseline"])


def test_a_failed_load_in_either_group_is_recomputed_and_never_reaches_the_store(
    tiny_gemma3_dir: Path, gemma3_fill: dict[str, Any]
) -> None:
    """A flipped byte in the window group's block 6 of prompt 0, and in the full group's block 7 of prompt 1:
    both requests' loads fail (vLLM hears it per request), they are computed again, and an engine C over the
    store B leaves serves every prompt from it with the baseline's outputs -- nothing computed over the
    poisoned blocks was saved."""
    workdir = gemma3_fill["workdir"]
    store = workdir / "damaged"
    shutil.copytree(gemma3_fill["store"], store)
    window_tag, full_tag = (tag for _, _, tag in gemma3_fill["a"]["connector"]["groups"])
    names = chain_positions(PROMPTS)
    victims = {}
    for key in entries(store):
        tag, name = key.split(".")[1], names.get(hash_of_key(key))
        if (tag, name) in ((window_tag, "p0:6"), (full_tag, "p1:7")):
            victims[key] = "flip-payload"
    assert len(victims) == 2
    damage_store(store, victims)
    b = run_engine(
        tiny_gemma3_dir,
        PROMPTS,
        workdir,
        "b-damaged",
        max_tokens=MAX_TOKENS,
        kv_transfer_config=_config(store),
    )
    window_tier, full_tier = b["connector"]["tiers"]
    assert window_tier["loads_corrupt"] == 1 and full_tier["loads_corrupt"] == 1
    assert b["connector"]["worker"]["load_failed_blocks"] >= 2
    _same_outputs(b, gemma3_fill["baseline"])
    c = run_engine(
        tiny_gemma3_dir,
        PROMPTS,
        workdir,
        "c-damaged",
        max_tokens=MAX_TOKENS,
        kv_transfer_config=_config(store),
    )
    assert c["metrics"]["vllm:external_prefix_cache_hits"] == sum(REUSABLE) * BLOCK_SIZE
    assert all(tier["loads_corrupt"] == 0 for tier in c["connector"]["tiers"])
    _same_outputs(c, gemma3_fill["baseline"])


def test_an_all_sliding_window_model_keeps_its_window_group_and_loads_only_the_window(
    tiny_mistral_dir: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    baseline = run_engine(tiny_mistral_dir, PROMPTS, tmp_path, "baseline", max_tokens=MAX_TOKENS)
    config = _config(store)
    a = run_engine(tiny_mistral_dir, PROMPTS, tmp_path, "a", max_tokens=MAX_TOKENS, kv_transfer_config=config)
    b = run_engine(tiny_mistral_dir, PROMPTS, tmp_path, "b", max_tokens=MAX_TOKENS, kv_transfer_config=config)
    for name, result in (("a", a), ("b", b)):
        assert HMA_OFF_LINE not in _log(tmp_path, name)
        assert result["kv_cache_groups"] == ["SlidingWindowSpec"]
    assert a["connector"]["worker"]["save_blocks"] == _filled()
    assert b["metrics"]["vllm:external_prefix_cache_hits"] == sum(REUSABLE) * BLOCK_SIZE
    assert b["connector"]["worker"]["load_blocks"] == WINDOW_BLOCKS * len(PROMPTS)
    _same_outputs(a, baseline)
    _same_outputs(b, baseline)


def test_a_mamba_hybrid_model_is_refused_at_start_with_a_clear_error(tiny_jamba_dir: Path, tmp_path: Path) -> None:
    """The connector stores no Mamba state yet: an engine with it refuses to start and says why (rather than
    running with a group whose state it would silently never load)."""
    with pytest.raises(AssertionError, match="exited"):
        run_engine(tiny_jamba_dir, PROMPTS[:1], tmp_path, "jamba", kv_transfer_config=_config(tmp_path / "s"))
    log = _log(tmp_path, "jamba")
    assert "KV cache group 0 is MambaSpec (Mamba / linear-attention state is not stored yet)" in log
