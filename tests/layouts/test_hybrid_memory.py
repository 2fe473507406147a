"""Memory a running sequence holds, measured on a running manager: Gemma-3-like layout vs all full attention.

The expected figures are derived here from the model's public shape and the window rule (the token being
computed attends to itself and the W - 1 before it), not from the layout code: Gemma 3 27B has 62 layers,
layer i global when (i + 1) % 6 == 0 (10 global, 52 sliding), 16 KV heads of 128, window 1,024; bf16.
A running sequence that has committed ``c`` tokens and has slots for ``S`` holds ``ceil(S / B)`` blocks in
the full-attention group and, in the window group, the blocks from the one holding token ``c - W + 1`` on.
"""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks import KVCacheManager
from kvblocks.hybrid import HybridKVCacheManager, LocalGroup, hybrid_preset
from tests.support.held_blocks import Held, serve

B = 16
WINDOW = 1024
CONTEXT = 32768
LAYERS, GLOBAL_LAYERS = 62, 10
SLIDING_LAYERS = LAYERS - GLOBAL_LAYERS
LAYER_BLOCK_BYTES = 2 * B * 16 * 128 * 2  # K and V x tokens x KV heads x head_dim x bf16, one layer
BOUND = -(-WINDOW // B) + 1  # what a window group may hold per running sequence: ceil(W / B) + 1


def gemma_like(num_blocks: int, window_blocks: int) -> HybridKVCacheManager:
    return HybridKVCacheManager(num_blocks, B, local_groups=[LocalGroup("sliding_window", WINDOW, window_blocks)])


def expected_window(committed: int, slots: int, window: int, block: int) -> int:
    """Window blocks held: from the block of the first token the next token attends to, to the last slot."""
    return -(-slots // block) - max(0, committed - window + 1) // block


def bytes_per_sequence(held: Held) -> int:
    """Bytes a Gemma-3-like sequence holds: full blocks x 10 layers + window blocks x 52 layers."""
    full, window = held.blocks
    return (full * GLOBAL_LAYERS + window * SLIDING_LAYERS) * LAYER_BLOCK_BYTES


# 4 sequences, decoded across 32k tokens at different offsets in their blocks (so the window straddles
# block boundaries in every way), from prompts prefilled in chunks of 2,048 tokens.
LENGTHS = [CONTEXT - 40 + 3 * i for i in range(4)]
CHUNK = 2048
DECODE = 48
WINDOW_POOL = len(LENGTHS) * (BOUND + 2 * CHUNK // B)  # a step takes the next chunk before the commit releases


def test_the_preset_is_gemma_3_27b() -> None:
    """The layout the manager is sized from: the public config's figures, per group."""
    sliding, full = hybrid_preset("gemma-3-27b").groups
    assert (sliding.kind, sliding.num_layers, sliding.window, sliding.block_size) == (
        "sliding_window",
        SLIDING_LAYERS,
        WINDOW,
        B,
    )
    assert (full.kind, full.num_layers) == ("full", GLOBAL_LAYERS)
    assert sliding.bytes_per_block == SLIDING_LAYERS * LAYER_BLOCK_BYTES
    assert full.bytes_per_block == GLOBAL_LAYERS * LAYER_BLOCK_BYTES


def test_each_running_sequence_holds_its_window_and_no_more_at_32k() -> None:
    """Every step, every sequence: the full group holds every block, the window group exactly the blocks of
    its window (at most ceil(W / B) + 1), and the pools hold nothing else."""
    manager = gemma_like(len(LENGTHS) * (CONTEXT // B + 8), WINDOW_POOL)
    layout = hybrid_preset("gemma-3-27b")
    window_seen: set[int] = set()
    for held, pools in serve(manager, LENGTHS, CHUNK, DECODE):
        for h in held.values():
            assert h.blocks == (-(-h.slots // B), expected_window(h.committed, h.slots, WINDOW, B))
        assert pools == tuple(sum(h.blocks[g] for h in held.values()) for g in range(2))
        for h in held.values():
            if h.slots == h.committed + 1:  # decoding: the bound, and the layout's figure for that context
                window_seen.add(h.blocks[1])
                assert h.blocks[1] <= BOUND
                assert bytes_per_sequence(h) <= layout.held_bytes(h.slots)
                assert (bytes_per_sequence(h) == layout.held_bytes(h.slots)) == (h.blocks[1] == BOUND)
    assert window_seen == {BOUND - 1, BOUND}  # the bound is reached, and not exceeded
    manager.check_integrity()


def measured_at(manager: KVCacheManager, context: int) -> list[Held]:
    """What each sequence holds at the decode step whose slots reach exactly ``context`` tokens."""
    found = [
        h
        for held, _ in serve(manager, LENGTHS, CHUNK, DECODE)
        for h in held.values()
        if h.slots == context and h.committed == context - 1
    ]
    assert len(found) == len(LENGTHS)
    return found


def test_gemma_like_holds_3_16_of_all_full_per_running_sequence_at_32k() -> None:
    """The ratio the issue asks for, on running managers: 52 x 64 + 10 x 2,048 layer-blocks vs 62 x 2,048."""
    hybrid = measured_at(gemma_like(len(LENGTHS) * (CONTEXT // B + 8), WINDOW_POOL), CONTEXT)
    full = measured_at(KVCacheManager(num_blocks=len(LENGTHS) * (CONTEXT // B + 8), block_size=B), CONTEXT)
    window_blocks = WINDOW // B  # token 32,767 attends to 31,744..32,767: blocks 1,984..2,047
    assert [h.blocks for h in hybrid] == [(CONTEXT // B, window_blocks)] * len(LENGTHS)
    assert [h.blocks for h in full] == [(CONTEXT // B,)] * len(LENGTHS)
    all_full_bytes = CONTEXT // B * LAYERS * LAYER_BLOCK_BYTES
    ratio = Fraction(bytes_per_sequence(hybrid[0]), all_full_bytes)
    assert ratio == Fraction(GLOBAL_LAYERS * 2048 + SLIDING_LAYERS * 64, LAYERS * 2048) == Fraction(3, 16)
    assert abs(float(ratio) - (1 / 6 + 5 / 6 * WINDOW / CONTEXT)) < 0.01  # the estimate (5 : 1 layers)


@settings(max_examples=500, deadline=None)
@given(
    block=st.sampled_from([1, 2, 3, 4, 16]),
    window=st.integers(1, 70),
    lengths=st.lists(st.integers(1, 120), min_size=1, max_size=3),
    chunk=st.integers(1, 50),
    decode=st.integers(0, 40),
)
def test_a_window_group_holds_exactly_its_window_per_running_sequence(
    block: int, window: int, lengths: list[int], chunk: int, decode: int
) -> None:
    """Any block size, window, chunk and length: the window group holds exactly the window's blocks, within
    ceil(W / B) + 1 while decoding, and its pool holds nothing else."""
    room = len(lengths) * (-(-(max(lengths) + decode) // block) + 2)
    manager = HybridKVCacheManager(room, block, local_groups=[LocalGroup("sliding_window", window, room)])
    for held, pools in serve(manager, lengths, chunk, decode):
        for h in held.values():
            assert h.blocks == (-(-h.slots // block), expected_window(h.committed, h.slots, window, block))
            if h.slots == h.committed + 1:
                assert h.blocks[1] <= -(-window // block) + 1
        assert pools == tuple(sum(h.blocks[g] for h in held.values()) for g in range(2))
    manager.check_integrity()
