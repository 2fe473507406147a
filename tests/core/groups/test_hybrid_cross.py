"""Cross-attention groups in HybridKVCacheManager: encoder K/V blocks per sequence, never prefix-cached."""

from __future__ import annotations

import pytest

from kvblocks.errors import ConfigError, InvalidArgumentError, SequenceStateError
from kvblocks.hybrid import HybridKVCacheManager, LocalGroup
from kvblocks.hybrid.cross import CrossAttentionGroup

B = 4


def manager(cross_blocks: int = 4, *, block_size: int | None = None) -> HybridKVCacheManager:
    return HybridKVCacheManager(
        16,
        B,
        local_groups=[LocalGroup("sliding_window", 4, 16)],
        cross_groups=[CrossAttentionGroup(cross_blocks, block_size)],
    )


def test_an_admission_takes_ceil_encoder_tokens_over_block_size_cross_blocks_and_free_returns_them() -> None:
    m = manager()
    assert m.group_kinds == ("full", "sliding_window", "cross_attention")
    m.add_sequence("a", list(range(6)))
    m.set_encoder_tokens("a", 10)
    assert m.allocate("a", 6) is not None
    assert m.group_block_table("a", 2) == [0, 1, 2]
    m.commit("a", 6)
    assert not any(m.group_pool(2).is_cached(b) for b in range(4))  # encoder K/V is never findable
    m.free("a")
    assert m.group_pool(2).num_fresh == 4 and m.group_pool(2).num_idle == 0
    m.check_integrity()


def test_a_prefix_hit_still_takes_fresh_cross_blocks() -> None:
    m = manager()
    m.add_sequence("a", list(range(10)))
    m.set_encoder_tokens("a", 4)
    m.allocate("a", 10)
    m.commit("a", 10)
    m.add_sequence("b", list(range(10)))
    m.set_encoder_tokens("b", 8)
    assert m.lookup("b").device == 8  # the decoder prefix is shared; the encoder input is b's own
    table = m.allocate("b", 2, num_cached_tokens=8)
    assert table is not None and m.group_block_table("b", 2) == [1, 2]
    m.check_integrity()


def test_no_room_in_the_cross_group_refuses_the_admission_in_every_group() -> None:
    m = manager(cross_blocks=3)
    m.add_sequence("a", list(range(6)))
    m.set_encoder_tokens("a", 8)
    m.allocate("a", 6)
    m.add_sequence("b", list(range(100, 106)))
    m.set_encoder_tokens("b", 8)
    assert m.blocks_short("b", 6) == 1
    free = [m.group_pool(g).num_free for g in range(3)]
    assert m.allocate("b", 6) is None
    assert [m.group_pool(g).num_free for g in range(3)] == free and not m.is_admitted("b")
    m.preempt("a")  # its cross blocks go back: b fits
    assert m.allocate("b", 6) is not None and m.group_block_table("b", 2) == [2, 1]  # the fresh queue's order
    m.check_integrity()


def test_a_request_without_encoder_input_holds_no_cross_blocks_and_block_size_is_the_groups() -> None:
    m = manager(block_size=16)
    m.add_sequence("text", [1, 2, 3])
    m.allocate("text", 3)
    assert m.group_block_table("text", 2) == []
    m.add_sequence("image", [1, 2, 3])
    m.set_encoder_tokens("image", 17)
    m.allocate("image", 3)
    assert len(m.group_block_table("image", 2)) == 2
    m.check_integrity()


def test_encoder_tokens_are_fixed_while_admitted_and_checked() -> None:
    m = manager()
    m.add_sequence("a", [1, 2, 3])
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(InvalidArgumentError):
            m.set_encoder_tokens("a", bad)  # type: ignore[arg-type]
    m.set_encoder_tokens("a", 4)
    m.set_encoder_tokens("a", 0)  # back to none
    m.allocate("a", 3)
    assert m.group_block_table("a", 2) == []
    with pytest.raises(SequenceStateError):
        m.set_encoder_tokens("a", 4)
    no_cross = HybridKVCacheManager(8, B, local_groups=[LocalGroup("sliding_window", 4, 8)])
    no_cross.add_sequence("x", [1])
    with pytest.raises(InvalidArgumentError):
        no_cross.set_encoder_tokens("x", 1)
    with pytest.raises(InvalidArgumentError):
        m.state_slot("a", 2)  # a cross group has no state slot
    for bad in (0, -1, True):
        with pytest.raises(ConfigError):
            CrossAttentionGroup(bad)
        with pytest.raises(ConfigError):
            CrossAttentionGroup(4, bad)
    with pytest.raises(ConfigError):
        HybridKVCacheManager(8, B, cross_groups=[LocalGroup("sliding_window", 4, 8)])  # type: ignore[list-item]
