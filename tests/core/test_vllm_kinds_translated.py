"""vLLM's tests of its circular buffer, retained-prefix (reference) sliding window and sliding-window admission
cap, translated to kvblocks: the same behaviour asserted through kvblocks' API.

vLLM's managers take a request id and a table of block objects; kvblocks' local group takes a sequence key
and a table of block ids from its own pool (ids from 0 where vLLM uses 1000 and up), and places the window
at the committed token (vLLM: ``remove_skipped_blocks(request, num_computed_tokens)``). vLLM's
``tests/v1/core/test_prefix_caching.py`` has no test of these three (searched: none names ``RSWASpec``,
``CircularBufferSpec`` or the admission cap); the circular buffer's tests are in vLLM's model tests.
"""

from __future__ import annotations

import pytest

from kvblocks import KVCacheManager
from kvblocks.core.groups.local_group import LocalGroupManager
from kvblocks.core.groups.protocol import Ask
from kvblocks.hybrid import (
    PLACEHOLDER,
    GroupHitRule,
    HybridKVCacheManager,
    LocalGroup,
    held_blocks,
    longest_common_hit,
    needed_blocks,
)

P = PLACEHOLDER


def group(kind: str, span: int, num_blocks: int, block_size: int) -> LocalGroupManager:
    """One local group on its own, as vLLM's tests build one single-type manager."""
    return LocalGroupManager(LocalGroup(kind, span=span, num_blocks=num_blocks), block_size, 1, None)


def admit(local: LocalGroupManager, key: int, chain_blocks: int, prompt: int | None, covered: int | None) -> int:
    """Admit sequence ``key`` without a hit, its table spanning ``chain_blocks``: the group's two phases. Returns
    how many blocks the first phase said it would take (what it lacks plus what is free)."""
    ask = Ask((), 0, chain_blocks, 0, 0, prompt=prompt, covered=covered)
    answer = local.admission(ask, None)
    assert answer is not None
    predicted = answer[0] + local.pool.num_free
    local.take_admission(key, ask, answer[1])
    return predicted


# ---------------------------------------------------------------------- retained-prefix window (RSWASpec)


# vLLM: tests/v1/core/test_single_type_kv_cache_manager.py::test_rswa_remove_skipped_blocks_gap_range
def test_rswa_remove_skipped_blocks_gap_range() -> None:
    local = group("retained_prefix_window", span=8, num_blocks=20, block_size=4)

    # Without the prompt's length nothing is known to lie outside it: no gap block is released.
    admit(local, 1, 10, None, None)
    assert local.tables[1] == list(range(10))
    local.committed(1, (), 0, 28, cache=False)
    assert local.tables[1] == list(range(10))

    # A 16-token prompt: at 28 computed tokens the gap is block 4 only (tokens 16..19).
    admit(local, 2, 10, 16, 40)
    expected = list(range(10, 20))
    assert local.tables[2] == expected
    local.committed(2, (), 0, 28, cache=False)
    expected[4] = P
    assert local.tables[2] == expected

    # The window moves: blocks 5 and 6 enter the gap too; block 4 is already released.
    local.committed(2, (), 28, 36, cache=False)
    expected[5] = expected[6] = P
    assert local.tables[2] == expected
    assert list(local.pool.fresh_order()) == [14, 15, 16]  # past the prompt: never cached, fresh again


# ---------------------------------------------------------------------- the admission cap


# vLLM: tests/v1/core/test_single_type_kv_cache_manager.py::
#       test_predictor_matches_allocator_blocks_calculation_with_admission_cap
def test_predictor_matches_allocator_blocks_calculation_with_admission_cap() -> None:
    """What an admission or a growth says it needs is exactly what it then takes (else the pool runs dry)."""
    block_size, window = 2, 8
    local = group("capped_sliding_window", span=window, num_blocks=100, block_size=block_size)
    prompt = 16
    before = local.pool.num_free
    predicted = admit(local, 1, 4 // block_size, prompt, 4)  # the first chunk: 4 tokens
    assert predicted == before - local.pool.num_free == 2
    for num_tokens in (8, 12, 16):
        total = num_tokens // block_size
        predicted = local.growth_short(1, total) + local.pool.num_free
        before = local.pool.num_free
        local.resize(1, total)
        assert predicted == before - local.pool.num_free == 2, num_tokens

    # kvblocks' counterpart of vLLM's cap (sliding_window // block_size = 4 blocks): the whole prompt in one
    # pass takes only the window after it, and says so before it takes.
    before = local.pool.num_free
    predicted = admit(local, 2, prompt // block_size, prompt, prompt)
    assert predicted == before - local.pool.num_free == window // block_size
    assert local.tables[2] == [P, P, P, P, 8, 9, 10, 11]  # token 16 attends to 9..16: positions 4..7


# vLLM: tests/v1/core/test_single_type_kv_cache_manager.py::test_sliding_window_remove_skipped_blocks
# (the capped kind is a sliding window once admitted)
def test_sliding_window_remove_skipped_blocks() -> None:
    local = group("capped_sliding_window", span=4, num_blocks=11, block_size=2)
    admit(local, 1, 11, None, None)  # no pass end known: every position, as a plain sliding window
    original = list(range(11))
    assert local.tables[1] == original
    done = 0

    def commit(n: int) -> list[int]:
        nonlocal done
        local.committed(1, (), done, n, cache=False)
        done = n
        return local.tables[1]

    assert commit(0) == original
    # 4 tokens computed: only token 0 is out of the window; block 0 also holds token 1, still in it.
    assert commit(4) == original
    # 5 tokens: tokens 0 and 1 are out: block 0 goes.
    assert commit(5) == [P] + original[1:]
    # 6 tokens: tokens 0..2 are out, but block 1 still holds token 3.
    assert commit(6) == [P] + original[1:]
    # 7 tokens: tokens 0..3 are out: block 1 goes too.
    assert commit(7) == [P] * 2 + original[2:]
    # 11 tokens: tokens 0..7 are out: blocks 2 and 3 go.
    assert commit(11) == [P] * 4 + original[4:]
    # kvblocks gives them back oldest first (vLLM frees a run tail first); none was cached: fresh again
    assert list(local.pool.fresh_order()) == [0, 1, 2, 3]


# vLLM: tests/v1/core/test_single_type_kv_cache_manager.py::test_sliding_window_possible_cached_prefix
# (the capped kind's hits are a sliding window's)
@pytest.mark.parametrize(
    ("block_is_cached", "expect_length"),
    [
        ([False] * 10, 0),
        ([True], 1),
        ([True, False], 1),
        ([True, True], 2),
        ([True, True, False], 2),
        ([True, True, True], 3),
        ([True, True, True, False], 3),
        ([True, True, False, True, False, False, True, True, False, True, True, True], 12),
        ([True, True, False, True, False, False, True, True, False, False, False], 8),
        ([True, True, False, True, False, False, True, True, False, False, False, True], 8),
    ],
)
def test_sliding_window_possible_cached_prefix(block_is_cached: list[bool], expect_length: int) -> None:
    block_size = 2
    rule = GroupHitRule("capped_sliding_window", block_size, 4)  # type: ignore[arg-type]
    cached = {p for p, hit in enumerate(block_is_cached) if hit}
    limit = len(block_is_cached) * block_size
    hit = longest_common_hit([rule], limit, [cached.__contains__], block_size)
    assert hit == expect_length * block_size
    # vLLM's hit holds null blocks but for the last two, which are the cached ones: the window's
    assert list(needed_blocks(rule, hit)) == list(range(max(0, expect_length - 2), expect_length))
    assert set(needed_blocks(rule, hit)) <= cached


# vLLM: tests/v1/core/test_single_type_kv_cache_manager.py::test_evictable_cached_blocks_not_double_allocated
def test_evictable_cached_blocks_not_double_allocated() -> None:
    """An idle cached block the hit keeps counts against the free supply; only the truly new block is taken."""
    block_size = 2
    m = HybridKVCacheManager(16, block_size, local_groups=[LocalGroup("capped_sliding_window", 2 * block_size, 2)])
    m.add_sequence("a", [0, 1, 2, 3])
    m.allocate("a", 4)
    m.commit("a", 4)
    m.free("a")  # both window blocks cached and idle: the group has no fresh block left
    window = m.group_pool(1)
    assert (window.num_fresh, window.num_idle) == (0, 2)
    m.add_sequence("req", [0, 1, 7, 8])
    assert m.lookup("req").device == block_size  # the hit's window: block 0, idle
    assert m.blocks_short("req", 2) == 0  # 1 new + the kept idle one: the 2 free blocks, exactly
    m.allocate("req", 2)
    assert m.group_block_table("req", 1) == [0, 1]  # 0 kept; 1 is the one new block (evicted, reused)
    assert (window.ref_count(0), window.ref_count(1), window.num_free) == (1, 1, 0)
    m.check_integrity()


# ---------------------------------------------------------------------- circular buffer (CircularBufferSpec)


# vLLM: tests/models/qwen4_exp (a model's cache tests)::test_qwen4_exp_circular_manager_owns_one_block_per_request
def test_qwen4_exp_circular_manager_owns_one_block_per_request() -> None:
    m = HybridKVCacheManager(600, 16, local_groups=[LocalGroup("circular_buffer", span=4, num_blocks=8)])
    ring = m.group_pool(1)
    m.add_sequence("req", list(range(4096)))
    assert m.blocks_short("req", 4096) == 0
    m.allocate("req", 4096)
    assert m.group_block_table("req", 1) == [0]
    assert ring.num_free == 7  # one block for 4096 tokens
    m.append_tokens("req", range(4096, 8192))
    m.allocate("req", 4096)  # 8192 tokens: the ring takes nothing more
    assert m.group_block_table("req", 1) == [0]
    assert ring.num_free == 7
    m.check_integrity()


# vLLM: tests/models/qwen4_exp (a model's cache tests)::test_qwen4_exp_circular_cache_stores_keys_without_unused_values
def test_qwen4_exp_circular_cache_stores_keys_without_unused_values() -> None:
    """The ring occupies one block per request for its whole life (vLLM: max memory = one page)."""
    assert [held_blocks("circular_buffer", context, 16, 4) for context in (1, 4096, 8192)] == [1, 1, 1]


# vLLM: tests/models/qwen4_exp (a model's cache tests)::test_qwen4_exp_csa_linear_cache_layout
# (its part on prefix caching: the coordinator's hit search leaves the circular buffer groups out)
def test_qwen4_exp_csa_linear_cache_layout() -> None:
    lookups = []
    ring = [LocalGroup("circular_buffer", span=4, num_blocks=4)]
    for m in (KVCacheManager(32, 4), HybridKVCacheManager(32, 4, local_groups=ring)):
        m.add_sequence("a", list(range(40)))
        m.allocate("a", 40)
        m.commit("a", 40)
        m.free("a")
        m.add_sequence("b", list(range(40)))
        lookups.append(m.lookup("b").device)
    assert lookups == [36, 36]  # nine full blocks below the last token, without the ring or with it
