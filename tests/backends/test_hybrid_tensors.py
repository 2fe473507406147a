"""Tensors per group of a hybrid layout (issue 14, item 7): KV caches, recurrent state pools and their movement.

Byte figures are worked out by hand here (layers x K,V x tokens x heads x head_dim x element size, or
the state tensors' shapes); movement is checked against plain torch indexing on copies of the tensors.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks.backends import get_backend
from kvblocks.backends.cache import KVCache
from kvblocks.errors import ConfigError, InvalidBlockIdError
from kvblocks.hybrid import CacheGroup, HybridLayout, RecurrentState, StateTensor
from kvblocks.hybrid.recurrent import StateCopy
from kvblocks.hybrid.tensors import HybridCaches, StatePool, apply_state_plan

# ---------------------------------------------------------------- tiny preset-like layouts


def gemma_like() -> HybridLayout:
    """5 sliding : 1 full, float32, 2 KV heads x 4, block 4."""
    return HybridLayout(
        (
            CacheGroup.attention(
                "sliding_window", [0, 1, 2, 3, 4], num_kv_heads=2, head_dim=4, dtype="float32", block_size=4, window=8
            ),
            CacheGroup.attention("full", [5], num_kv_heads=2, head_dim=4, dtype="float32", block_size=4),
        )
    )


def llama4_like() -> HybridLayout:
    return HybridLayout(
        (
            CacheGroup.attention("chunked_local", [0, 1, 2], num_kv_heads=1, head_dim=8, block_size=8, chunk=32),
            CacheGroup.attention("full", [3], num_kv_heads=1, head_dim=8, block_size=8),
        )
    )


def jamba_like() -> HybridLayout:
    """Mamba-1 layers 0, 1, 3 (bf16 conv, float32 SSM), full attention at layer 2."""
    mamba = RecurrentState.mamba1(d_inner=6, d_state=3, d_conv=4, ssm_dtype="float32")
    return HybridLayout(
        (
            CacheGroup.recurrent([0, 1, 3], mamba),
            CacheGroup.attention("full", [2], num_kv_heads=2, head_dim=4, dtype="bfloat16", block_size=4),
        )
    )


def qwen3_next_like() -> HybridLayout:
    """Gated DeltaNet layers 0-2, full attention at 3, and a cross-attention group at 4."""
    delta = RecurrentState.gated_delta_net(
        num_key_heads=1, num_value_heads=2, key_head_dim=2, value_head_dim=3, conv_kernel=3, ssm_dtype="float32"
    )
    return HybridLayout(
        (
            CacheGroup.recurrent([0, 1, 2], delta),
            CacheGroup.attention("full", [3], num_kv_heads=1, head_dim=4, dtype="float16", block_size=2),
            CacheGroup.attention(
                "cross_attention", [4], num_kv_heads=1, head_dim=4, dtype="float16", block_size=2, encoder_tokens=6
            ),
        )
    )


# Per layout: counts, and each group's bytes by hand.
HAND = {
    # sliding: 5 layers x 2 (K, V) x 4 tokens x 2 heads x 4 dim x 4 B = 1,280 per block; full: 256.
    "gemma": (gemma_like, [7, 11], [7 * 1280, 11 * 256]),
    # chunked: 3 x 2 x 8 x 1 x 8 x 2 B = 768 per block; full: 256.
    "llama4": (llama4_like, [5, 9], [5 * 768, 9 * 256]),
    # mamba per layer: conv 3 x 6 x 2 B = 36, SSM 6 x 3 x 4 B = 72 -> 108; x 3 layers = 324 per state.
    # full: 1 x 2 x 4 x 2 x 4 x 2 B = 128 per block.
    "jamba": (jamba_like, [3, 10], [3 * 324, 10 * 128]),
    # delta per layer: conv 2 x (2 x 1 x 2 + 2 x 3) x 2 B = 40, state 2 x 2 x 3 x 4 B = 48 -> 88; x 3 = 264.
    # full and cross: 1 x 2 x 2 x 1 x 4 x 2 B = 32 per block.
    "qwen3-next": (qwen3_next_like, [4, 6, 3], [4 * 264, 6 * 32, 3 * 32]),
}


@pytest.mark.parametrize("name", list(HAND))
def test_each_group_allocates_exactly_the_layouts_bytes(name: str) -> None:
    build, counts, expected = HAND[name]
    layout = build()
    caches = HybridCaches(layout, counts, "cpu")
    assert len(caches) == len(layout.groups)
    assert [caches.nbytes(i) for i in range(len(caches))] == expected
    assert caches.total_nbytes == sum(expected)
    for i, group in enumerate(layout.groups):
        assert caches.nbytes(i) == counts[i] * group.unit_bytes
        tensors = caches[i]
        if group.kind == "recurrent":
            assert isinstance(tensors, StatePool) and caches.states(i) is tensors
            assert tensors.num_states == counts[i]
        else:
            assert isinstance(tensors, KVCache) and caches.cache(i) is tensors
            assert tensors.num_blocks == counts[i] and tensors.spec == group.spec


def test_state_pool_tensors_have_the_states_shapes_dtypes_and_device() -> None:
    caches = HybridCaches(jamba_like(), [3, 10], get_backend("cpu"))
    pool = caches.states(0)
    assert pool.device == caches.backend.device == torch.device("cpu")
    assert tuple(pool.tensors["conv"].shape) == (3, 3, 3, 6)  # states, layers, d_conv - 1, d_inner
    assert pool.tensors["conv"].dtype == torch.bfloat16
    assert tuple(pool.tensors["ssm"].shape) == (3, 3, 6, 3)
    assert pool.tensors["ssm"].dtype == torch.float32
    assert pool.bytes_per_state == 324
    layer = pool.layer(2)
    assert tuple(layer["ssm"].shape) == (3, 6, 3) and layer["ssm"].stride()[1:] == (3, 1)  # inner dims contiguous
    assert all(bool((t == 0).all()) for t in pool.tensors.values())  # allocated zeroed
    layer["ssm"][1].fill_(2.5)  # a kernel writing through the layer view writes the pool
    assert bool((pool.tensors["ssm"][1, 2] == 2.5).all()) and bool((pool.tensors["ssm"][1, :2] == 0).all())


def test_a_budget_split_allocates_the_plans_units_computed_by_hand() -> None:
    # Gemma-like at 64 tokens, block 4: a sequence holds 3 sliding blocks (ceil(8 / 4) + 1) of 1,280 B
    # and 16 full blocks of 256 B = 7,936 B. Budget 3 x 7,936 + 100 = 23,908 B:
    # sliding 23,908 x 3 // 7,936 = 9 blocks, full 23,908 x 16 // 7,936 = 48 blocks.
    caches = HybridCaches.for_budget(gemma_like(), 23_908, 64)
    assert (caches.cache(0).num_blocks, caches.cache(1).num_blocks) == (9, 48)
    assert (caches.nbytes(0), caches.nbytes(1)) == (9 * 1280, 48 * 256)
    plan = jamba_like().split(10 * 324 + 10 * 8 * 128, 32)  # 10 sequences of 1 state + 8 blocks
    caches = HybridCaches(jamba_like(), plan)
    assert (caches.states(0).num_states, caches.cache(1).num_blocks) == (10, 80)
    assert (caches.nbytes(0), caches.nbytes(1)) == (3240, 10240)


def test_counts_and_accessors_are_validated() -> None:
    layout = jamba_like()
    with pytest.raises(ConfigError, match="2 groups"):
        HybridCaches(layout, [3])
    with pytest.raises(ConfigError, match="group 0"):
        HybridCaches(layout, [0, 4])
    with pytest.raises(ConfigError, match="positive"):
        HybridCaches(layout, [2, True])
    with pytest.raises(ConfigError, match="another layout"):
        HybridCaches(layout, gemma_like().split(1 << 20, 64))
    with pytest.raises(ConfigError, match="counts"):
        HybridCaches(layout, "34")
    with pytest.raises(ConfigError, match="unknown backend"):
        HybridCaches(layout, [2, 2], "nope")
    caches = HybridCaches(layout, [2, 2])
    with pytest.raises(ConfigError, match="recurrent"):
        caches.cache(0)
    with pytest.raises(ConfigError, match="full"):
        caches.states(1)
    with pytest.raises(ConfigError, match="group index"):
        caches[2]
    with pytest.raises(ConfigError, match="layer index"):
        caches.states(0).layer(3)
    with pytest.raises(ConfigError, match="recurrent CacheGroup"):
        StatePool(layout.groups[1], 2)


# ---------------------------------------------------------------- state movement against plain torch


def random_pool(num_states: int = 7, seed: int = 0) -> StatePool:
    pool = HybridCaches(jamba_like(), [num_states, 1]).states(0)
    generator = torch.Generator().manual_seed(seed)
    for tensor in pool.tensors.values():
        tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype))
    return pool


def snapshot(pool: StatePool) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in pool.tensors.items()}


def same(pool: StatePool, expected: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(pool.tensors[name], t) for name, t in expected.items())


def reference_payload(tensors: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The documented payload by plain indexing: tensor by tensor, each layer by layer, as bytes."""
    parts = [t[ids].reshape(len(ids), t[0].numel()).view(torch.uint8) for t in tensors.values()]
    return torch.cat(parts, dim=1)


def test_zero_clears_stale_bytes_of_the_states_named_and_nothing_else() -> None:
    pool = random_pool()
    for tensor in pool.tensors.values():
        tensor.view(torch.uint8).fill_(0xFF)  # stale bytes: NaN in every float dtype
    assert bool(pool.tensors["ssm"].isnan().all())
    before = snapshot(pool)
    pool.zero([5, 1, 5])
    for name, tensor in pool.tensors.items():
        assert bool((tensor[[1, 5]] == 0).all())
        keep = [0, 2, 3, 4, 6]
        assert torch.equal(tensor[keep].view(torch.uint8), before[name][keep].view(torch.uint8))


def test_copy_checkpoints_and_restores_like_plain_indexing() -> None:
    pool = random_pool()
    expected = snapshot(pool)
    for tensor in expected.values():
        tensor[[4, 6]] = tensor[[0, 0]]  # checkpoint running slot 0 into cacheable states 4 and 6
    pool.copy([0, 0], [4, 6])
    assert same(pool, expected)
    pool.tensors["ssm"][0].fill_(9.0)  # the running slot moves on ...
    for tensor in expected.values():
        tensor[[0]] = tensor[[6]]
    pool.copy([6], [0])  # ... and a hit restores the checkpoint
    assert same(pool, expected)


def test_overlapping_copy_reads_everything_before_writing() -> None:
    pool = random_pool()
    expected = snapshot(pool)
    for tensor in expected.values():
        tensor[[1, 2, 3]] = tensor[[0, 1, 2]].clone()  # a shift: every dst is another copy's src
    pool.copy([0, 1, 2], [1, 2, 3])
    assert same(pool, expected)


def test_gather_then_scatter_round_trips_into_another_pool() -> None:
    pool, other = random_pool(seed=1), random_pool(seed=2)
    ids = [6, 0, 3]
    payload = pool.gather(ids)
    assert tuple(payload.shape) == (3, 324) and payload.dtype == torch.uint8 and payload.is_contiguous()
    assert torch.equal(payload, reference_payload(pool.tensors, ids))
    expected = snapshot(other)
    for name, tensor in expected.items():
        tensor[[1, 5, 2]] = pool.tensors[name][ids]
    other.scatter([1, 5, 2], payload)
    assert same(other, expected)
    out = torch.full((3, 324), 7, dtype=torch.uint8)
    assert pool.gather(ids, out=out) is out and torch.equal(out, payload)


def test_hybrid_caches_zero_and_copy_dispatch_per_group_kind() -> None:
    caches = HybridCaches(jamba_like(), [4, 6])
    kv = caches.cache(1)
    kv.key(0)[2].fill_(3.0)
    caches.copy(1, [2], [5])
    assert bool((kv.key(0)[5] == 3.0).all())
    caches.zero(1, [2])
    assert bool((kv.key(0)[2] == 0).all()) and bool((kv.key(0)[5] == 3.0).all())
    pool = caches.states(0)
    pool.tensors["conv"][1].fill_(1.5)
    caches.copy(0, [1], [3])
    assert bool((pool.tensors["conv"][3] == 1.5).all())
    caches.zero(0, [1])
    assert bool((pool.tensors["conv"][1] == 0).all()) and bool((pool.tensors["conv"][3] == 1.5).all())


BAD_CALLS = [
    ("zero out of range", lambda p: p.zero([0, 7]), InvalidBlockIdError),
    ("zero negative", lambda p: p.zero([-1]), InvalidBlockIdError),
    ("zero bool", lambda p: p.zero([True]), InvalidBlockIdError),
    ("zero float tensor", lambda p: p.zero(torch.tensor([1.0])), InvalidBlockIdError),
    ("zero 2-D tensor", lambda p: p.zero(torch.tensor([[1]])), InvalidBlockIdError),
    ("zero not a sequence", lambda p: p.zero(3), InvalidBlockIdError),
    ("copy source out of range", lambda p: p.copy([1, 9], [2, 3]), InvalidBlockIdError),
    ("copy destination out of range", lambda p: p.copy([1, 2], [3, 7]), InvalidBlockIdError),
    ("copy repeated destination", lambda p: p.copy([1, 2], [3, 3]), InvalidBlockIdError),
    ("copy lengths differ", lambda p: p.copy([1, 2], [3]), ConfigError),
    ("gather out of range", lambda p: p.gather([0, 7]), InvalidBlockIdError),
    ("gather wrong out", lambda p: p.gather([0], out=torch.empty((1, 323), dtype=torch.uint8)), ConfigError),
    ("scatter repeated", lambda p: p.scatter([1, 1], torch.zeros((2, 324), dtype=torch.uint8)), InvalidBlockIdError),
    ("scatter out of range", lambda p: p.scatter([7], torch.zeros((1, 324), dtype=torch.uint8)), InvalidBlockIdError),
    ("scatter wrong dtype", lambda p: p.scatter([1], torch.zeros((1, 324), dtype=torch.int8)), ConfigError),
    ("scatter wrong rows", lambda p: p.scatter([1, 2], torch.zeros((1, 324), dtype=torch.uint8)), ConfigError),
    (
        "scatter not contiguous",
        lambda p: p.scatter([1], torch.zeros((1, 648), dtype=torch.uint8)[:, ::2]),
        ConfigError,
    ),
    (
        "scatter from the pool's own memory",
        lambda p: p.scatter([1], p.tensors["ssm"].view(7, -1).view(torch.uint8)[:1, :324]),
        ConfigError,
    ),
]


@pytest.mark.parametrize("call, error", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_ids_and_payloads_are_refused_with_nothing_changed(call: object, error: type[Exception]) -> None:
    pool = random_pool()
    before = snapshot(pool)
    with pytest.raises(error):
        call(pool)  # type: ignore[operator]
    assert same(pool, before)


# ---------------------------------------------------------------- properties


def single_tensor_pool(num_states: int) -> StatePool:
    """A pool whose state s, layer l holds values 100 s + l: every state is told apart."""
    group = CacheGroup.recurrent([0, 1], RecurrentState((StateTensor("h", (3,), "float32"),)))
    pool = StatePool(group, num_states)
    values = torch.arange(num_states, dtype=torch.float32).view(-1, 1, 1) * 100 + torch.arange(2).view(1, -1, 1)
    pool.tensors["h"].copy_(values.expand(num_states, 2, 3))
    return pool


@st.composite
def copies(draw: st.DrawFn) -> tuple[int, list[int], list[int]]:
    num_states = draw(st.integers(1, 12))
    dst = draw(st.lists(st.integers(0, num_states - 1), unique=True, max_size=num_states))
    src = draw(st.lists(st.integers(0, num_states - 1), min_size=len(dst), max_size=len(dst)))
    return num_states, src, dst


@settings(max_examples=1500, deadline=None)
@given(copies())
def test_copy_leaves_every_destination_with_its_sources_old_state(case: tuple[int, list[int], list[int]]) -> None:
    num_states, src, dst = case
    pool = single_tensor_pool(num_states)
    before = [pool.tensors["h"][s].clone() for s in range(num_states)]
    expected = list(before)
    for s, d in zip(src, dst):
        expected[d] = before[s]
    pool.copy(src, dst)
    for state in range(num_states):
        assert torch.equal(pool.tensors["h"][state], expected[state])


@settings(max_examples=800, deadline=None)
@given(st.data())
def test_scatter_of_a_gather_writes_exactly_the_gathered_states(data: st.DataObject) -> None:
    num_states = data.draw(st.integers(1, 9))
    pool = random_pool(num_states, seed=data.draw(st.integers(0, 3)))
    src = data.draw(st.lists(st.integers(0, num_states - 1), max_size=min(6, num_states)))
    dst = data.draw(st.lists(st.integers(0, num_states - 1), unique=True, min_size=len(src), max_size=len(src)))
    expected = snapshot(pool)
    for tensor in expected.values():
        tensor[dst] = tensor[src].clone()
    payload = pool.gather(src)
    assert torch.equal(payload, reference_payload(pool.tensors, src))
    pool.scatter(dst, payload)
    assert same(pool, expected)


# ---------------------------------------------------------------- a plan's operations, in order


def one_by_one(pool: StatePool, ops: list[tuple[int | None, int]]) -> dict[str, torch.Tensor]:
    """What running ``ops`` one at a time does, by plain torch indexing on a copy of the pool's tensors."""
    expected = snapshot(pool)
    for src, dst in ops:
        for tensor in expected.values():
            tensor[dst] = 0 if src is None else tensor[src].clone()
    return expected


def test_a_plan_saves_a_slot_then_zeroes_it_for_the_next_sequence() -> None:
    """The manager's order within one plan: save slot 0 into checkpoint 5, the slot is reused (zeroed),
    and a hit restores checkpoint 5 into slot 1. Run as one batch, the zero would reach the checkpoint."""
    pool = random_pool()
    old = snapshot(pool)
    pool.apply([StateCopy(2, 0, 5), StateCopy(2, None, 0), StateCopy(2, 5, 1)])
    for name, tensor in pool.tensors.items():
        assert torch.equal(tensor[5], old[name][0]) and torch.equal(tensor[1], old[name][0])
        assert bool((tensor[0] == 0).all())
        assert torch.equal(tensor[[2, 3, 4, 6]], old[name][[2, 3, 4, 6]])


@pytest.mark.parametrize(
    "ops",
    [
        [(0, 1), (1, 2)],  # a chain: 2 gets what 1 holds after the first copy (0's), not 1's old state
        [(0, 1), (1, 0)],  # not a swap: both end up with 0's state
        [(0, 3), (1, 3)],  # the later copy into a state wins
        [(4, 2), (None, 4), (2, 4)],  # a checkpoint moved out, zeroed, moved back
        [(None, 1), (1, 2), (None, 2), (3, 1)],
        [(0, 0), (None, 6), (None, 6)],
    ],
    ids=["chain", "not-a-swap", "last-write-wins", "out-zero-back", "zero-read-zero", "self-copy"],
)
def test_apply_gives_what_one_by_one_gives(ops: list[tuple[int | None, int]]) -> None:
    pool = random_pool()
    expected = one_by_one(pool, ops)
    pool.apply(ops)
    assert same(pool, expected)


@st.composite
def plans(draw: st.DrawFn) -> tuple[int, list[tuple[int | None, int]]]:
    num_states = draw(st.integers(1, 8))
    state = st.integers(0, num_states - 1)
    ops = draw(st.lists(st.tuples(st.none() | state, state), max_size=12))
    return num_states, ops


@settings(max_examples=800, deadline=None)
@given(plans())
def test_apply_equals_running_the_operations_one_at_a_time(case: tuple[int, list[tuple[int | None, int]]]) -> None:
    num_states, ops = case
    pool = single_tensor_pool(num_states)
    expected = one_by_one(pool, ops)
    pool.apply(ops)
    assert same(pool, expected)


def test_safe_runs_are_batched_into_one_kernel_per_state_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = random_pool()
    calls: list[tuple[str, list[int]]] = []
    fill, move = pool._fill, pool._move
    monkeypatch.setattr(pool, "_fill", lambda index: (calls.append(("zero", index.tolist())), fill(index)))
    monkeypatch.setattr(pool, "_move", lambda src, dst: (calls.append(("copy", dst.tolist())), move(src, dst)))
    ops: list[tuple[int | None, int]] = [(None, 1), (None, 2), (0, 4), (0, 5), (3, 0), (4, 6), (None, 3)]
    expected = one_by_one(pool, ops)
    pool.apply(ops)
    assert same(pool, expected)
    # (4, 6) reads 4, written by (0, 4) of the same run: it starts a new batch
    assert calls == [("zero", [1, 2]), ("copy", [4, 5, 0]), ("copy", [6]), ("zero", [3])]


BAD_PLANS = [
    ("destination out of range", [(0, 1), (None, 7)], InvalidBlockIdError),
    ("source out of range", [(0, 1), (9, 2)], InvalidBlockIdError),
    ("negative", [(None, -1)], InvalidBlockIdError),
    ("bool id", [(True, 1)], InvalidBlockIdError),
    ("not a pair", [(0, 1, 2)], ConfigError),
    ("a list, not a pair", [[0, 1]], ConfigError),
    ("two groups", [StateCopy(1, 0, 1), StateCopy(2, None, 3)], ConfigError),
]


@pytest.mark.parametrize("ops, error", [c[1:] for c in BAD_PLANS], ids=[c[0] for c in BAD_PLANS])
def test_a_bad_operation_anywhere_moves_nothing(ops: list[object], error: type[Exception]) -> None:
    pool = random_pool()
    before = snapshot(pool)
    with pytest.raises(error):
        pool.apply(ops)  # type: ignore[arg-type]
    assert same(pool, before)


def test_apply_state_plan_runs_each_groups_operations_on_its_pool() -> None:
    pools = {1: random_pool(seed=1), 3: random_pool(seed=3)}
    plan = [StateCopy(3, 0, 4), StateCopy(1, None, 2), StateCopy(3, None, 0), StateCopy(1, 2, 5), StateCopy(3, 4, 1)]
    expected = {
        group: one_by_one(pool, [(op.src, op.dst) for op in plan if op.group == group]) for group, pool in pools.items()
    }
    apply_state_plan(plan, pools)
    assert all(same(pools[group], expected[group]) for group in pools)
    assert bool((pools[1].tensors["ssm"][5] == 0).all())  # zeroed, then copied into 5: order kept per group
    apply_state_plan([], pools)
    assert all(same(pools[group], expected[group]) for group in pools)


@pytest.mark.parametrize(
    "plan, match",
    [
        ([StateCopy(1, None, 0), StateCopy(2, None, 0)], "group 2"),
        ([StateCopy(1, None, 0), StateCopy(3, 0, 7)], "state 7"),
        ([StateCopy(1, None, 0), (None, 1)], "StateCopy"),
    ],
    ids=["group without a pool", "bad id in another group", "not a StateCopy"],
)
def test_a_bad_plan_moves_nothing_in_any_group(plan: list[object], match: str) -> None:
    pools = {1: random_pool(seed=1), 3: random_pool(seed=3)}
    before = {group: snapshot(pool) for group, pool in pools.items()}
    with pytest.raises((ConfigError, InvalidBlockIdError), match=match):
        apply_state_plan(plan, pools)  # type: ignore[arg-type]
    assert all(same(pools[group], before[group]) for group in pools)


def test_two_groups_on_one_pool_are_refused() -> None:
    pool = random_pool()
    before = snapshot(pool)
    with pytest.raises(ConfigError, match="share one state pool"):
        apply_state_plan([StateCopy(1, 0, 1), StateCopy(2, 1, 0)], {1: pool, 2: pool})
    assert same(pool, before)


# ---------------------------------------------------------------- import weight


def test_importing_kvblocks_hybrid_does_not_import_torch() -> None:
    code = (
        "import sys, kvblocks.hybrid\n"
        "light = 'torch' not in sys.modules\n"
        "kvblocks.hybrid.HybridCaches\n"
        "print(light, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]
