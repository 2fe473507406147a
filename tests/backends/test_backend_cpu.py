"""The CPU backend: views over one allocation, and every movement against a reference copy."""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks.backends import CPUBackend, KVCacheSpec, get_backend, movement
from kvblocks.backends.movement import contiguous_runs, paired_runs
from kvblocks.errors import ConfigError, InvalidBlockIdError

BACKEND = CPUBackend()


class RunByRunCPU(CPUBackend):
    """The CPU backend with every block "large": scattered blocks are copied one run at a time."""

    RUN_BY_RUN_MIN_ROW_BYTES = 0


BACKENDS = [BACKEND, RunByRunCPU()]


def spec_of(**overrides) -> KVCacheSpec:
    fields = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32", "block_size": 4}
    fields.update(overrides)
    return KVCacheSpec(**fields)


def filled(spec: KVCacheSpec, num_blocks: int, seed: int = 0):
    """A cache whose every byte is random, so that any misplaced copy shows."""
    cache = BACKEND.allocate(spec, num_blocks)
    generator = torch.Generator().manual_seed(seed)
    cache.storage.copy_(torch.randint(0, 256, cache.storage.shape, dtype=torch.uint8, generator=generator))
    return cache


def snapshot(cache) -> list[list[torch.Tensor]]:
    """Every per-layer tensor, cloned: the reference the byte-level operations are checked against."""
    out = []
    for layer in cache.layers:
        out.append([t.clone() for t in layer if t is not None])
    return out


def block_of(tensors: list[list[torch.Tensor]], block: int) -> list[torch.Tensor]:
    return [t[block] for layer in tensors for t in layer]


def same_block(a, block_a: int, b, block_b: int) -> bool:
    """Byte equality (random bytes include NaN patterns, which never compare equal as floats)."""
    pairs = zip(block_of(a, block_a), block_of(b, block_b))
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in pairs)


specs = st.builds(
    spec_of,
    num_layers=st.integers(1, 3),
    num_kv_heads=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([4, 8]),
    dtype=st.sampled_from(["float32", "bfloat16", "float8_e4m3fn"]),
    block_size=st.sampled_from([1, 2, 4]),
    layout=st.sampled_from(["NHD", "HND"]),
    scale_dtype=st.sampled_from([None, "float32"]),
    block_major=st.booleans(),
)


# ---------------------------------------------------------------- allocation and views


@pytest.mark.parametrize("block_major", [True, False])
@pytest.mark.parametrize("layout, shape", [("NHD", (10, 4, 2, 8)), ("HND", (10, 2, 4, 8))])
def test_per_layer_tensors_have_the_kernel_shapes(block_major: bool, layout: str, shape: tuple) -> None:
    cache = BACKEND.allocate(spec_of(layout=layout, block_major=block_major), 10)
    assert len(cache.layers) == 3
    for layer in cache.layers:
        assert tuple(layer.key.shape) == shape and tuple(layer.value.shape) == shape
        assert layer.key.dtype is torch.float32 and layer.key_scale is None
        assert layer.key.is_contiguous() is (not block_major)
        assert layer.key.untyped_storage().data_ptr() == cache.storage.untyped_storage().data_ptr()
    assert cache.nbytes == 10 * cache.spec.bytes_per_block
    assert torch.count_nonzero(cache.storage) == 0  # zeroed: no NaN garbage under masked slots


def test_views_partition_the_allocation() -> None:
    """Writing through each per-layer tensor in turn must touch every byte exactly once."""
    for block_major in (True, False):
        cache = BACKEND.allocate(spec_of(scale_dtype="float32", dtype="bfloat16", block_major=block_major), 5)
        for layer in cache.layers:
            for tensor in layer:
                assert torch.count_nonzero(tensor.view(torch.uint8) if tensor.dtype.itemsize == 1 else tensor) == 0
                tensor.fill_(1)
        count = sum(t.numel() * t.element_size() for layer in cache.layers for t in layer if t is not None)
        assert count == cache.nbytes
        assert torch.count_nonzero(cache.storage) > 0


def test_mla_cache_has_no_values() -> None:
    spec = KVCacheSpec.mla(num_layers=2, kv_lora_rank=16, qk_rope_head_dim=8, dtype="bfloat16", block_size=4)
    cache = BACKEND.allocate(spec, 6)
    assert tuple(cache.key(1).shape) == (6, 4, 1, 24)
    assert cache.layers[0].value is None
    with pytest.raises(ConfigError, match="no V tensor"):
        cache.value(0)


def test_fp8_scales_are_typed_views() -> None:
    cache = BACKEND.allocate(spec_of(dtype="float8_e4m3fn", scale_dtype="float32"), 4)
    layer = cache.layers[2]
    assert layer.key.dtype is torch.float8_e4m3fn and layer.key_scale.dtype is torch.float32
    assert tuple(layer.key_scale.shape) == (4, 4, 2) and tuple(layer.value_scale.shape) == (4, 4, 2)


def test_misaligned_planes_are_refused() -> None:
    with pytest.raises(ConfigError, match="not aligned"):  # 3 fp8 bytes per block, then float32 scales
        BACKEND.allocate(
            spec_of(num_kv_heads=1, head_dim=3, block_size=1, dtype="float8_e4m3fn", scale_dtype="float32"), 2
        )


def test_pin_memory_without_an_accelerator_is_ignored_visibly() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = BACKEND.allocate(spec_of(), 2, pin_memory=True)
    assert cache.pinned is False
    assert any("pin_memory=True ignored" in str(w.message) for w in caught)


@pytest.mark.parametrize("bad", [0, -3, 2.0, True])
def test_bad_allocations(bad) -> None:
    with pytest.raises(ConfigError):
        BACKEND.allocate(spec_of(), bad)
    with pytest.raises(ConfigError):
        BACKEND.allocate("spec", 4)  # type: ignore[arg-type]


# ---------------------------------------------------------------- movement against a reference


@settings(max_examples=60, deadline=None)
@given(spec=specs, data=st.data())
def test_gather_then_scatter_moves_exactly_those_blocks(spec: KVCacheSpec, data) -> None:
    cache = filled(spec, 12)
    before = snapshot(cache)
    src = data.draw(st.lists(st.integers(0, 11), min_size=1, max_size=6))
    dst = data.draw(st.lists(st.integers(0, 11), min_size=len(src), max_size=len(src), unique=True))
    payload = BACKEND.gather(cache, src)
    assert payload.shape == (len(src), spec.bytes_per_block) and payload.is_contiguous()
    BACKEND.scatter(cache, dst, payload)
    after = snapshot(cache)
    for i in range(12):
        if i in dst:
            assert same_block(after, i, before, src[dst.index(i)])
        else:
            assert same_block(after, i, before, i)


def ids_with_runs(num_blocks: int, count: int, *, unique: bool) -> st.SearchStrategy[list[int]]:
    """``count`` block ids: scattered, or one run of consecutive ids (the case movement copies as slices)."""
    scattered = st.lists(st.integers(0, num_blocks - 1), min_size=count, max_size=count, unique=unique)
    run = st.integers(0, num_blocks - count).map(lambda first: list(range(first, first + count)))
    return st.one_of(scattered, run)


@pytest.mark.parametrize("backend", BACKENDS, ids=["cpu", "run-by-run"])
@settings(max_examples=60, deadline=None)
@given(spec=specs, data=st.data())
def test_copy_blocks_matches_reference_even_when_sets_overlap(backend: CPUBackend, spec: KVCacheSpec, data) -> None:
    cache = filled(spec, 10, seed=1)
    before = snapshot(cache)
    count = data.draw(st.integers(1, 6))
    src = data.draw(ids_with_runs(10, count, unique=False))
    dst = data.draw(ids_with_runs(10, count, unique=True))
    backend.copy_blocks(cache, src, dst)
    after = snapshot(cache)
    for i in range(10):
        expected = src[dst.index(i)] if i in dst else i
        assert same_block(after, i, before, expected)


@pytest.mark.parametrize("backend", BACKENDS, ids=["cpu", "run-by-run"])
@settings(max_examples=40, deadline=None)
@given(spec=specs, other_major=st.booleans(), data=st.data())
def test_transfer_between_arrangements(backend: CPUBackend, spec: KVCacheSpec, other_major: bool, data) -> None:
    src = filled(spec, 8, seed=2)
    dst_spec = KVCacheSpec(**{**spec.__dict__, "block_major": other_major})
    dst = filled(dst_spec, 8, seed=3)
    src_before, dst_before = snapshot(src), snapshot(dst)
    count = data.draw(st.integers(0, 8))
    source = data.draw(ids_with_runs(8, count, unique=False))
    target = data.draw(ids_with_runs(8, count, unique=True))
    handle = backend.transfer(src, dst, source, target)
    assert handle.done()
    handle.wait()
    dst_after = snapshot(dst)
    for i in range(8):
        if i in target:
            assert same_block(dst_after, i, src_before, source[target.index(i)])
        else:
            assert same_block(dst_after, i, dst_before, i)
    assert all(same_block(snapshot(src), i, src_before, i) for i in range(8))


def test_zero_clears_only_those_blocks() -> None:
    for block_major in (True, False):
        cache = filled(spec_of(block_major=block_major, scale_dtype="float32"), 6)
        before = snapshot(cache)
        BACKEND.zero(cache, [1, 2, 3, 5])  # a run and a single
        after = snapshot(cache)
        for i in range(6):
            if i in (1, 2, 3, 5):
                assert all(torch.count_nonzero(t) == 0 for t in block_of(after, i))
            else:
                assert same_block(after, i, before, i)


def test_ids_as_tensors_work_like_lists() -> None:
    cache = filled(spec_of(), 6)
    assert torch.equal(BACKEND.gather(cache, torch.tensor([4, 1])), BACKEND.gather(cache, [4, 1]))
    assert BACKEND.gather(cache, []).shape == (0, cache.spec.bytes_per_block)


def test_one_indexed_copy_per_row_tensor_never_per_block() -> None:
    """Scattered ids: one index_select for a block-major cache, one per layer tensor when layer-major."""
    for block_major, expected in ((True, 1), (False, 3 * 2)):
        cache = filled(spec_of(block_major=block_major), 64)
        scattered = list(range(0, 64, 3))  # 22 blocks, no two adjacent
        with mock.patch.object(movement.torch, "index_select", wraps=torch.index_select) as spy:
            BACKEND.gather(cache, scattered)
        assert spy.call_count == expected


def test_contiguous_ids_move_as_runs() -> None:
    cache = filled(spec_of(), 64)
    with mock.patch.object(movement.torch, "index_select", wraps=torch.index_select) as spy:
        payload = BACKEND.gather(cache, list(range(10, 30)) + list(range(40, 60)))
    assert spy.call_count == 0  # two runs: two slice copies
    assert torch.equal(payload[:20], cache.storage.view(64, -1)[10:30])


@pytest.mark.parametrize("backend", BACKENDS, ids=["cpu", "run-by-run"])
@pytest.mark.parametrize("block_major", [True, False], ids=["block-major", "layer-major"])
@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (list(range(0, 8)), list(range(1, 9))),  # one run onto itself shifted up: each block read before written
        (list(range(1, 9)), list(range(0, 8))),  # shifted down
        ([8, 9, 10, 11, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7]),  # run 2 reads what run 1 writes
        ([0, 1, 2, 3, 8, 9, 10, 11], [8, 9, 10, 11, 0, 1, 2, 3]),  # a swap of two runs
    ],
    ids=["shift-up", "shift-down", "chain", "swap"],
)
def test_copy_blocks_with_overlapping_runs_reads_every_block_before_writing(
    backend: CPUBackend, block_major: bool, src: list[int], dst: list[int]
) -> None:
    """Regression: long runs whose sets overlap were copied run by run (torch refused a self-overlapping
    copy midway; a chain of runs silently copied blocks already overwritten)."""
    cache = filled(spec_of(block_major=block_major, scale_dtype="float32"), 12, seed=6)
    before = snapshot(cache)
    backend.copy_blocks(cache, src, dst)
    after = snapshot(cache)
    for i in range(12):
        assert same_block(after, i, before, src[dst.index(i)] if i in dst else i)


def test_large_blocks_move_one_block_at_a_time_small_ones_staged() -> None:
    """Scattered ids: a copy per block once rows reach RUN_BY_RUN_MIN_ROW_BYTES, else indexed copies."""
    small = spec_of()
    large = spec_of(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float32", block_size=16)  # 1 MiB blocks
    assert large.bytes_per_block >= CPUBackend.RUN_BY_RUN_MIN_ROW_BYTES > small.bytes_per_block
    for spec, indexed in ((small, True), (large, False)):
        src, dst = filled(spec, 8, seed=7), filled(spec, 8, seed=8)
        before = snapshot(src)
        with mock.patch.object(movement.torch, "index_select", wraps=torch.index_select) as spy:
            BACKEND.transfer(src, dst, [6, 0, 3], [1, 7, 4])
            BACKEND.copy_blocks(src, [6, 0, 3], [1, 7, 4])
        assert (spy.call_count > 0) is indexed
        for s, d in ((6, 1), (0, 7), (3, 4)):
            assert same_block(snapshot(dst), d, before, s) and same_block(snapshot(src), d, before, s)


def test_runs() -> None:
    assert contiguous_runs([]) == []
    assert contiguous_runs([7]) == [(7, 0, 1)]
    assert contiguous_runs([1, 2, 3, 5, 6, 0]) == [(1, 0, 3), (5, 3, 2), (0, 5, 1)]
    assert paired_runs([1, 2, 3, 4], [9, 10, 0, 1]) == [(1, 9, 2), (3, 0, 2)]


# ---------------------------------------------------------------- refusals change nothing


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda c: BACKEND.gather(c, [0, 8]), InvalidBlockIdError),
        (lambda c: BACKEND.gather(c, [-1]), InvalidBlockIdError),
        (lambda c: BACKEND.gather(c, [1.0]), InvalidBlockIdError),
        (lambda c: BACKEND.gather(c, [True]), InvalidBlockIdError),
        (lambda c: BACKEND.gather(c, torch.zeros(2, 2, dtype=torch.long)), InvalidBlockIdError),
        (lambda c: BACKEND.gather(c, torch.tensor([0.0])), InvalidBlockIdError),
        (lambda c: BACKEND.scatter(c, [1, 1], BACKEND.gather(c, [2, 3])), InvalidBlockIdError),
        (lambda c: BACKEND.scatter(c, [1], BACKEND.gather(c, [2, 3])), ConfigError),
        (lambda c: BACKEND.scatter(c, [1], torch.zeros(1, 7, dtype=torch.uint8)), ConfigError),
        (lambda c: BACKEND.scatter(c, [1], BACKEND.gather(c, [2]).float()), ConfigError),
        (lambda c: BACKEND.copy_blocks(c, [1, 2], [3]), ConfigError),
        (lambda c: BACKEND.copy_blocks(c, [1, 2], [3, 3]), InvalidBlockIdError),
        (lambda c: BACKEND.zero(c, [9]), InvalidBlockIdError),
        (lambda c: BACKEND.scatter(c, [5, 6], c.storage[: 2 * c.spec.bytes_per_block].view(2, -1)), ConfigError),
        (
            lambda c: BACKEND.gather(
                c, [5, 6], out=c.storage[c.spec.bytes_per_block :][: 2 * c.spec.bytes_per_block].view(2, -1)
            ),
            ConfigError,
        ),
        (lambda c: BACKEND.transfer(c, BACKEND.allocate(spec_of(head_dim=4), 8), [0], [0]), ConfigError),
        (lambda c: BACKEND.transfer(c, c, [0, 1], [2]), ConfigError),
        (lambda c: BACKEND.transfer(c, c, [0, 1, 2, 3], [1, 2, 3, 4]), ConfigError),  # one cache: copy_blocks
        (lambda c: BACKEND.gather("cache", [0]), ConfigError),
    ],
)
def test_bad_movement_raises_and_changes_nothing(call, error) -> None:
    cache = filled(spec_of(), 8)
    before = cache.storage.clone()
    with pytest.raises(error):
        call(cache)
    assert torch.equal(cache.storage, before)


def test_a_cache_from_another_device_is_refused() -> None:
    cache = filled(spec_of(), 4)
    other = CPUBackend("cpu")
    assert other.gather(cache, [0]).shape[0] == 1  # the same device under another backend object is fine
    with pytest.raises(ConfigError, match="lives on"):
        BACKEND.gather(cache.__class__(**{**cache.__dict__, "storage": cache.storage.to("meta")}), [0])


def test_get_backend_cpu_variants() -> None:
    assert isinstance(get_backend("cpu"), CPUBackend)
    assert get_backend("cpu:0").device == torch.device("cpu", 0)
    assert BACKEND.synchronize() is None


def test_batched_pair_copies_and_dma_style_runs_on_cpu() -> None:
    """The accelerator paths (one multi-tensor copy; one copy per run, even runs of one) checked on CPU."""
    from kvblocks.backends.movement import block_ids, copy_between, copy_pairs_batched

    for block_major in (True, False):
        src = filled(spec_of(block_major=block_major, scale_dtype="float32"), 8, seed=4)
        dst = filled(spec_of(block_major=block_major, scale_dtype="float32"), 8, seed=5)
        before_src, before_dst = snapshot(src), snapshot(dst)
        source, target = [5, 0, 3], [1, 6, 2]
        assert copy_pairs_batched(src, dst, block_ids(src, source), block_ids(dst, target, distinct=True))
        after = snapshot(dst)
        for i in range(8):
            expected = (before_src, source[target.index(i)]) if i in target else (before_dst, i)
            assert same_block(after, i, *expected)
        assert not copy_between(src, dst, block_ids(src, source), block_ids(dst, target))  # scattered: declined
        assert copy_between(src, dst, block_ids(src, [7]), block_ids(dst, [0]), any_runs=True)
        assert same_block(snapshot(dst), 0, before_src, 7)
    other = filled(spec_of(block_major=False), 8)
    mixed = filled(spec_of(block_major=True), 8)
    assert not copy_pairs_batched(mixed, other, block_ids(mixed, [1]), block_ids(other, [1]))


def test_special_float_bit_patterns_survive_every_copy() -> None:
    """Words are moved as complex128/int64 containers: signalling NaNs and denormals must keep their bits."""
    cache = BACKEND.allocate(spec_of(), 4)
    patterns = torch.tensor(
        [0x7FF0000000000001, 0x0000000000000001, 0xFFF8000000000123 - (1 << 64), 0x7FF4000000000000]
    )
    words = cache.storage.view(torch.int64)
    words[: words.numel() // 4] = patterns.repeat(words.numel() // 16)
    before = cache.storage.clone()
    payload = BACKEND.gather(cache, [0, 1])
    BACKEND.scatter(cache, [2, 3], payload)
    BACKEND.copy_blocks(cache, [2, 3], [0, 1])
    assert torch.equal(cache.storage.view(4, -1)[2], before.view(4, -1)[0])
    assert torch.equal(cache.storage.view(4, -1)[:2], before.view(4, -1)[:2])
