"""Memory per running sequence at 32k tokens on running managers: Gemma-3-27B-like layout vs all full attention.

Eight sequences are prefilled in 2,048-token chunks and decoded across 32,768 tokens through batched
``step`` calls, on a :class:`HybridKVCacheManager` (10 full layers in the base group, 52 sliding-window
layers of W 1,024 in a local group) and on a :class:`KVCacheManager` (all 62 layers full). The blocks each
group holds per sequence are read from its tables (``PLACEHOLDER`` entries are released blocks) and
converted to bytes with ``hybrid_preset("gemma-3-27b")``'s bytes per block per group. Run with ``-s`` to
see the report line, or read ``extra_info`` in ``--benchmark-json``.
"""

from __future__ import annotations

from kvblocks import KVCacheManager
from kvblocks.hybrid import HybridKVCacheManager, LocalGroup, hybrid_preset
from tests.support.held_blocks import held_blocks, serve

CONTEXT = 32768
CHUNK = 2048
DECODE = 256
LENGTHS = [CONTEXT - DECODE // 2 + 5 * i for i in range(8)]  # each passes 32k at its own offset in a block
LAYOUT = hybrid_preset("gemma-3-27b")
SLIDING, FULL = LAYOUT.groups
B = int(FULL.block_size or 0)
WINDOW = int(SLIDING.window or 0)
ALL_FULL_BLOCK_BYTES = sum(int(g.bytes_per_block or 0) for g in LAYOUT.all_full().groups)


def _bytes(blocks: tuple[int, ...]) -> int:
    if len(blocks) == 1:  # all full: every layer's block
        return blocks[0] * ALL_FULL_BLOCK_BYTES
    full, window = blocks
    return full * int(FULL.bytes_per_block or 0) + window * int(SLIDING.bytes_per_block or 0)


def _measure(manager: KVCacheManager) -> dict[int, set[int]]:
    """Bytes per decoding sequence, by its context (the tokens it has slots for), over every step."""
    by_context: dict[int, set[int]] = {}
    for held, _ in serve(manager, LENGTHS, CHUNK, DECODE):
        for seq_id, h in held.items():
            if h.slots == h.committed + 1:  # decoding (not prefilling)
                by_context.setdefault(h.slots, set()).add(_bytes(held_blocks(manager, seq_id)))
    return by_context


def _both() -> tuple[dict[int, set[int]], dict[int, set[int]]]:
    blocks = len(LENGTHS) * ((CONTEXT + DECODE) // B + 2)
    window_blocks = len(LENGTHS) * (-(-WINDOW // B) + 1 + 2 * CHUNK // B)
    hybrid = HybridKVCacheManager(blocks, B, local_groups=[LocalGroup("sliding_window", WINDOW, window_blocks)])
    return _measure(hybrid), _measure(KVCacheManager(num_blocks=blocks, block_size=B))


def test_hybrid_memory_per_running_sequence_at_32k(benchmark, capsys) -> None:
    """Report bytes per running sequence at 32k tokens, Gemma-3-like over all full, and the two references."""
    benchmark.group = "hybrid-memory-32k"
    hybrid, full = benchmark.pedantic(_both, rounds=1, iterations=1)
    assert hybrid.keys() == full.keys() and CONTEXT in hybrid
    assert all(len(sizes) == 1 for sizes in (*hybrid.values(), *full.values()))  # one figure per context
    ratios = {n: max(hybrid[n]) / max(full[n]) for n in hybrid}
    ratio = ratios[CONTEXT]
    peak_ratio = max(ratios[n] for n in ratios if CONTEXT - B < n <= CONTEXT)  # the last block before 32k
    layout_ratio = LAYOUT.held_bytes(CONTEXT) / LAYOUT.all_full().held_bytes(CONTEXT)
    estimate = 1 / 6 + 5 / 6 * WINDOW / CONTEXT
    benchmark.extra_info.update(
        ratio=ratio, peak_ratio=peak_ratio, layout_ratio=layout_ratio, estimate=estimate, context=CONTEXT
    )
    with capsys.disabled():
        print(
            f"\nhybrid memory at {CONTEXT} tokens per running sequence: Gemma-3-like {max(hybrid[CONTEXT]) / 2**30:.3f}"
            f" GiB vs all full {max(full[CONTEXT]) / 2**30:.3f} GiB: ratio {ratio:.4f} (window at its block-aligned"
            f" minimum); the most in the block before it {peak_ratio:.4f} (ceil(W/B)+1 window blocks,"
            f" the layout's figure {layout_ratio:.4f}); the 1/6 + 5/6 W/32k estimate {estimate:.4f}"
        )
    assert ratio < peak_ratio == layout_ratio < estimate  # the running manager reaches the layout's bound
