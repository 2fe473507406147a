"""Engines that share a damaged store, each a process of its own, never put wrong KV into it (issue 29).

* R computes every prompt in one pass (no prefix caching, an empty store) and saves every block: its entries
  are the reference KV of each key, and its outputs the baseline.
* R's store is copied and damaged every way a shared directory gets damaged: flipped payload bytes, a flipped
  header byte (the format version), entries cut to half, emptied, cut to the header, deleted, extended with
  garbage, and one replaced by another key's sound entry.
* B serves the same prompts over the damaged store: it loads what is sound, recomputes the rest and saves it.
  Its first step loads blocks 0..5 of the shared prefix (block 1 is another key's entry, block 4 flipped) and
  computes from block 6 on (deleted) -- over the failed loads, for every request that shares the prefix.
* Every entry left in the store must then hold the reference KV of its key, and C, serving the prompts from
  B's store, must reproduce R's tokens and logprobs.

KV is compared as float32 values: vLLM's CPU kernels are not bit-identical across batch shapes and cache
paths (a block recomputed beside other requests differs from R's one-pass block by ~1e-6), so the tolerance is
``KV_TOLERANCE`` of the values' range -- the wrong KV this test exists for was off by 2-5% of it.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import xxhash

from kvblocks.tiers.entry import HEADER
from tests.vllm_engine.engine import VOCAB_SIZE
from tests.vllm_engine.fleet import (
    chain_positions,
    connector_config,
    copy_store,
    damage_store,
    entries,
    hash_of_key,
    read_kv,
    run_engine,
)

LAYERS = 2
PAYLOAD = LAYERS * 2 * 32 * 64 * 4  # per layer: 2 KV heads x 32 tokens x (K, V of head dim 32) float32
KV_TOLERANCE = 1e-4
LOGPROB_TOLERANCE = 1e-4
DAMAGE = {
    "p0:1": "other-key",
    "p0:4": "flip-payload",
    "p0:6": "delete",
    "p0:8": "delete",
    "p0:17": "delete",
    "p0:2": "flip-header",
    "p0:10": "half",
    "p0:12": "empty",
    "p0:14": "header-only",
    "p0:16": "append",
    "p0:19": "flip-payload",
    "p1:20": "flip-payload",
    "p2:21": "half",
}


def _sound(data: bytes, reference: bytes) -> bool:
    """Whether ``data`` is a whole entry of the reference's format and key whose checksum matches its payload."""
    fixed = HEADER.size - 8  # everything before the payload's checksum
    checksum = int.from_bytes(data[fixed : HEADER.size], "little")
    return (
        len(data) == len(reference)
        and data[:fixed] == reference[:fixed]
        and xxhash.xxh3_64_intdigest(data[HEADER.size :]) == checksum
    )


def _prompts() -> list[list[int]]:
    rng = random.Random(29)
    shared = [rng.randrange(1, VOCAB_SIZE) for _ in range(640)]  # 20 blocks
    return [shared + [rng.randrange(1, VOCAB_SIZE) for _ in range(70)] for _ in range(4)]


def test_a_recovering_engine_leaves_only_the_reference_kv_in_a_shared_store(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    prompts = _prompts()
    names = chain_positions(prompts)
    reference_store = tmp_path / "reference"
    r = run_engine(
        tiny_llama_dir,
        prompts,
        tmp_path,
        "r",
        logprobs=1,
        kv_transfer_config=connector_config(reference_store),
        enable_prefix_caching=False,
        max_num_batched_tokens=4096,  # every prompt in one pass
    )
    assert r["connector"]["flushed"] and r["metrics"]["vllm:external_prefix_cache_hits"] == 0
    reference = {key: read_kv(path, LAYERS, PAYLOAD) for key, path in entries(reference_store).items()}
    keys = {names[hash_of_key(key)]: key for key in reference}
    assert len(keys) == 28  # 20 shared blocks, 2 of each prompt's own (the generated tokens fill no block)

    store = tmp_path / "store"
    copy_store(reference_store, store)
    damage_store(store, {keys[name]: how for name, how in DAMAGE.items()}, donor=keys["p3:21"])
    b = run_engine(tiny_llama_dir, prompts, tmp_path, "b", kv_transfer_config=connector_config(store))
    stats, seen = b["connector"], b["metrics"]
    assert stats["flushed"] and stats["worker"]["load_failed_blocks"] > 0 and stats["worker"]["load_blocks"] > 0
    # what the worker counted reached vLLM's metrics; the saves computed over the failed loads were withheld
    for name in ("load_blocks", "load_failed_blocks", "save_blocks", "save_withheld_blocks"):
        assert seen.get(f"vllm:kvblocks_{name}", 0) == stats["worker"][name], name
    assert stats["worker"]["save_withheld_blocks"] > 0
    log = (tmp_path / "b.log").read_text()
    assert "corrupt storage entries" in log  # kvblocks' warnings print where vLLM's do

    unsound, drift = [], 0.0
    for key, path in entries(store).items():
        expected = reference[key]
        assert expected is not None
        found = read_kv(path, LAYERS, PAYLOAD)
        if found is None or not _sound(path.read_bytes(), (reference_store / path.relative_to(store)).read_bytes()):
            unsound.append(names[hash_of_key(key)])  # a damaged entry no reader took: still a miss for all
            continue
        value_range = expected.value_range()
        diff = found.max_abs_diff(expected)
        drift = max(drift, diff / value_range)
        assert diff <= KV_TOLERANCE * value_range, (
            f"{names[hash_of_key(key)]}: KV off by {diff:.3g} (range {value_range:.3g}); layer 0 by "
            f"{float(np.max(np.abs(found.layers[0] - expected.layers[0]))):.3g}"
        )
    assert set(unsound) <= {name for name, how in DAMAGE.items() if how != "delete"}
    print(f"largest drift from the reference KV: {drift:.2e} of the range; unread damaged entries: {sorted(unsound)}")

    # C runs as vLLM serves: its engine core in a process of its own; the connector's counters still reach it
    c = run_engine(
        tiny_llama_dir,
        prompts,
        tmp_path,
        "c",
        logprobs=1,
        kv_transfer_config=connector_config(store),
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    )
    # vLLM counts every block the connector promised as an external hit; the connector's counters say which of
    # them arrived and which failed. C reads further than B did (B filled the deleted blocks), so it meets the
    # damaged entries no reader reached before: counted corrupt, removed, their blocks reported failed.
    hits, counted = c["metrics"]["vllm:external_prefix_cache_hits"], c["metrics"]
    loaded, failed = counted.get("vllm:kvblocks_load_blocks", 0), counted.get("vllm:kvblocks_load_failed_blocks", 0)
    assert hits > 0 and loaded > 0 and (loaded + failed) * 32 == hits
    corrupt = counted.get("vllm:kvblocks_loads_corrupt", 0)
    assert corrupt <= len(unsound) and (unsound or failed == corrupt == 0)
    for ours, theirs in zip(c["outputs"], r["outputs"], strict=True):
        assert ours["tokens"] == theirs["tokens"]
        assert np.allclose(ours["logprobs"], theirs["logprobs"], atol=LOGPROB_TOLERANCE, rtol=0)
    shutil.rmtree(tmp_path / "store", ignore_errors=True)
