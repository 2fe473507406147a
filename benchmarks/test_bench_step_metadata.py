"""Building one step's attention metadata for 256 running sequences, against kvblocks' own step bookkeeping.

Issue 15's bar: the tensors a paged-attention kernel takes (block tables, slot mapping, positions, lengths,
query offsets) cost no more to build than the manager's ``step`` for the same sequences (ratio >= 1.0).
The device is the CPU here: on CUDA the build adds one host-to-device copy per array.
"""

from __future__ import annotations

import random

import pytest

from kvblocks import KVCacheManager
from kvblocks.attention import StepMetadataBuilder
from kvblocks.hybrid import HybridKVCacheManager, LocalGroup

from .paired import paired_ratio

RUNNING = 256
BLOCK_SIZE = 16
PROMPT = [random.Random(15).randrange(50_000) for _ in range(512)]


def _running(hybrid: bool = False):
    """``RUNNING`` sequences with 513-token prompts, admitted and committed: ready to decode."""
    if hybrid:  # plus a 128-token sliding window group: two tables and two slot mappings a step
        window = LocalGroup("sliding_window", span=128, num_blocks=1 << 14)
        m: KVCacheManager = HybridKVCacheManager(1 << 15, BLOCK_SIZE, local_groups=[window])
    else:
        m = KVCacheManager(num_blocks=1 << 15, block_size=BLOCK_SIZE)
    for i in range(RUNNING):
        m.add_sequence(i, [i, *PROMPT])
        m.allocate(i, 513)
        m.commit(i, 513)
    return m


@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid-window"])
def test_decode_step_metadata_256_paired(benchmark, hybrid: bool) -> None:
    """One decode step of 256 sequences: ``build`` (the subject) right after the manager's ``step`` (the baseline).

    The bar (1.0) is the plain manager's; the hybrid one (a sliding-window group beside) is reported."""
    m = _running(hybrid)
    ids = list(range(RUNNING))
    sampled = [(7,)] * RUNNING
    ones = [1] * RUNNING
    builder = StepMetadataBuilder(m)
    state = {"computed": [513] * RUNNING}
    built = []

    def step() -> None:  # commit what the last pass wrote, append the sampled token, one slot each
        computed = state["computed"]
        if m.step(ids, computed, sampled):
            raise AssertionError("the pool is large enough for every step")
        state["computed"] = [n + 1 for n in computed]

    def build() -> None:
        built.append(builder.build(ids, ones).num_tokens)

    ratio = paired_ratio(
        benchmark,
        f"step-metadata-256-{'hybrid' if hybrid else 'plain'}-paired",
        "metadata build",
        step,
        build,
        baseline_name=f"{'hybrid ' if hybrid else ''}manager step, 256 decodes",
        target=None if hybrid else 1.0,
        rounds=101,
    )
    assert ratio > 0 and built and set(built) == {RUNNING}
    meta = builder.build(ids, ones)  # the tensors follow the manager: the slot of each sequence's next token
    table = m.block_table(0)
    position = m.num_computed_tokens(0)
    assert int(meta.slot_mapping[0]) == table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
