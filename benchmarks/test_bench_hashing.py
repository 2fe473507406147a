"""Hashing throughput: kvblocks schemes against pickle-then-hash baselines, same prompts, same run."""

from __future__ import annotations

import random

import pytest

from kvblocks import block_hashes

from .baselines import pickle_sha256_hashes, pickle_xxh3_hashes

BLOCK_SIZE = 16
SIZES = {"1k": 1024, "32k": 32 * 1024, "128k": 128 * 1024}
_rng = random.Random(1234)
PROMPTS = {name: [_rng.randrange(128_000) for _ in range(n)] for name, n in SIZES.items()}

SUBJECTS = {
    "kvblocks xxh3-128": lambda tokens: block_hashes(tokens, BLOCK_SIZE),
    "kvblocks sha256": lambda tokens: block_hashes(tokens, BLOCK_SIZE, scheme="sha256"),
    "kvblocks xxh3-64-1337": lambda tokens: block_hashes(tokens, BLOCK_SIZE, scheme="xxh3-64-1337"),
    "pickle+xxh3-128": lambda tokens: pickle_xxh3_hashes(tokens, BLOCK_SIZE),
    "pickle+sha256": lambda tokens: pickle_sha256_hashes(tokens, BLOCK_SIZE),
}


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("subject", list(SUBJECTS))
def test_hash_prompt(benchmark, size: str, subject: str) -> None:
    tokens = PROMPTS[size]
    benchmark.group = f"hash-{size}"
    benchmark.extra_info["subject"] = subject
    benchmark.extra_info["tokens"] = len(tokens)
    hashes = benchmark(SUBJECTS[subject], tokens)
    assert len(hashes) == len(tokens) // BLOCK_SIZE
    assert len(set(hashes)) == len(hashes)  # chained: distinct prefixes get distinct hashes
