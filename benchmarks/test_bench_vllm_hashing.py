"""vLLM's block hashes: kvblocks' ``vllm-*`` schemes against vLLM's per-block loop, same tokens, same run.

The baseline restates how vLLM 0.33 hashes a request's blocks (``hash_block_tokens`` per block:
``hash_fn((parent, tuple(block_tokens), extra_keys))`` with ``hash_fn`` = pickle then SHA-256 or XXH3-128)
over an 8k-token prompt in 16-token blocks, token ids a Python list as vLLM keeps them. Both sides give
the same hashes (checked). Beside them, kvblocks' default ``xxh3-128``, which frames instead of pickling.
Ratios are paired (see :mod:`benchmarks.paired`): baseline time / kvblocks time, median of the rounds.
"""

from __future__ import annotations

import hashlib
import pickle
import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import xxhash

from kvblocks import block_hashes
from kvblocks.hashing import Namespace

from .paired import paired_ratio

BLOCK_SIZE = 16
SEED = "0"  # the engine's PYTHONHASHSEED; the xxhash variants are reproducible only with one
_rng = random.Random(1234)
PROMPT = [_rng.randrange(128_000) for _ in range(8 * 1024)]


def _pickled(digest: Callable[[bytes], bytes]) -> Callable[[Any], bytes]:
    return lambda value: digest(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


PICKLE_SHA256 = _pickled(lambda data: hashlib.sha256(data).digest())
PICKLE_XXH3 = _pickled(xxhash.xxh3_128_digest)


def hash_block(hash_fn: Callable[[Any], bytes], parent: bytes, tokens: Sequence[int], keys: Any) -> bytes:
    return hash_fn((parent, tuple(tokens), keys))


def vllm_style(hash_fn: Callable[[Any], bytes], tokens: list[int]) -> list[bytes]:
    """vLLM's request hasher, restated: the root from the seed, then one call per full block."""
    parent = hash_fn(SEED)
    out = []
    for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = hash_block(hash_fn, parent, tokens[start : start + BLOCK_SIZE], None)
        out.append(parent)
    return out


NAMESPACE = Namespace(salt=SEED)
PAIRS = {
    # subject: (kvblocks call, baseline name, baseline call, loose target)
    "kvblocks vllm-sha256": (
        lambda: block_hashes(PROMPT, BLOCK_SIZE, scheme="vllm-sha256", namespace=NAMESPACE),
        "vLLM-style pickle+sha256",
        lambda: vllm_style(PICKLE_SHA256, PROMPT),
        0.7,
    ),
    "kvblocks vllm-xxhash": (
        lambda: block_hashes(PROMPT, BLOCK_SIZE, scheme="vllm-xxhash", namespace=NAMESPACE),
        "vLLM-style pickle+xxh3",
        lambda: vllm_style(PICKLE_XXH3, PROMPT),
        0.7,
    ),
    "kvblocks xxh3-128": (
        lambda: block_hashes(PROMPT, BLOCK_SIZE),
        "vLLM-style pickle+sha256",
        lambda: vllm_style(PICKLE_SHA256, PROMPT),
        2.0,
    ),
}


def test_the_pairs_hash_alike() -> None:
    """The benchmark compares equal work: kvblocks' vLLM schemes give the restated loop's hashes."""
    sha, _, sha_baseline, _ = PAIRS["kvblocks vllm-sha256"]
    xx, _, xx_baseline, _ = PAIRS["kvblocks vllm-xxhash"]
    assert sha() == sha_baseline()
    assert xx() == xx_baseline()
    assert len(sha()) == len(PROMPT) // BLOCK_SIZE


@pytest.mark.parametrize("subject", list(PAIRS))
def test_hash_8k_prompt_paired(benchmark, subject: str) -> None:
    measured, baseline_name, baseline, target = PAIRS[subject]
    ratio = paired_ratio(
        benchmark,
        "vllm-hash-8k-paired",
        subject,
        baseline,
        measured,
        baseline_name=baseline_name,
        target=target,
        repeat=5,
    )
    if not benchmark.disabled:  # loose: shared machines drift; the report prints the measured ratio
        assert ratio >= target, f"{subject}: {ratio:.2f}x {baseline_name}, expected >= {target}"
