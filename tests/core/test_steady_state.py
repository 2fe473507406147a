"""Steady state allocates nothing per block and retains nothing per request.

The pool and the tree keep per-block state in preallocated lists, so a request's
lifecycle (allocate with eviction, commit, decode steps, free) must create no
Python object per block. Measured with tracemalloc: the transient peak of a
cycle, per block, stays below what one small object per block would cost, and
memory after many cycles stops growing.
"""

from __future__ import annotations

import random
import statistics
import tracemalloc
from array import array

from kvblocks import KVCacheManager

BLOCK = 16
BLOCKS_PER_REQUEST = 256
DECODE_STEPS = 32


def test_request_cycles_allocate_no_object_per_block_and_leak_nothing() -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(50_000) for _ in range(BLOCKS_PER_REQUEST * BLOCK)] for _ in range(8)]
    m = KVCacheManager(num_blocks=3 * BLOCKS_PER_REQUEST, block_size=BLOCK)  # prompts do not all fit: eviction
    cycles = 300
    transient = array("q", [0] * cycles)  # preallocated: recording a figure must not allocate
    retained = array("q", [0] * cycles)
    tracemalloc.start()
    try:
        for i in range(cycles):
            seq_id = f"s{i % 4}"  # recycled ids: the freed-id memory stays small
            prompt = prompts[i % len(prompts)]
            m.add_sequence(seq_id, prompt)
            start = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            assert m.allocate(seq_id, len(prompt) - m.lookup(seq_id).device) is not None
            m.commit(seq_id, len(prompt))
            for step in range(DECODE_STEPS):
                m.append_tokens(seq_id, [step])
                m.allocate(seq_id, 1)
                m.commit(seq_id, len(prompt) + step + 1)
            transient[i] = tracemalloc.get_traced_memory()[1] - start
            m.free(seq_id)
            retained[i] = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert m.stats.evicted_blocks > 10 * BLOCKS_PER_REQUEST
    # One small object per block would be >= 32 bytes per block; lists of ids cost 8.
    assert statistics.median(transient) / BLOCKS_PER_REQUEST < 16
    # After warm-up (dicts at their steady size), memory does not grow with more requests.
    assert retained[-1] - retained[100] < 1024
    m.check_integrity()
