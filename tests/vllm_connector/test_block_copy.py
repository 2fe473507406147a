"""Whole blocks of vLLM-shaped per-layer KV tensors as bytes (kvblocks.integrations.vllm.block_copy)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvblocks.errors import ConfigError, InvalidArgumentError  # noqa: E402
from kvblocks.integrations.vllm.block_copy import LayerBlocks, layer_order  # noqa: E402

SHAPE = (6, 2, 32, 8)  # [num_blocks, kv_heads, block_size, 2 * head_dim], vLLM's CPU layout


def layers(n: int = 3, dtype: torch.dtype = torch.float32, *, shared: bool = True) -> dict[str, torch.Tensor]:
    """Per-layer tensors; ``shared``: views of one buffer, as vLLM allocates them."""
    gen = torch.Generator().manual_seed(n)
    if shared:
        buffer = torch.randn((n, *SHAPE), generator=gen).to(dtype)
        return {f"model.layers.{i}.self_attn.attn": buffer[i] for i in range(n)}
    return {f"model.layers.{i}.self_attn.attn": torch.randn(SHAPE, generator=gen).to(dtype) for i in range(n)}


def expected_payload(tensors: dict[str, torch.Tensor], block: int) -> bytes:
    """The payload by its definition: every layer's block bytes, layers in numeric order."""
    names = sorted(tensors, key=lambda name: int(name.split(".")[2]))
    return b"".join(tensors[name][block].contiguous().view(torch.uint8).numpy().tobytes() for name in names)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_payload_is_every_layers_block_in_layer_order(dtype: torch.dtype) -> None:
    tensors = layers(12, dtype)  # 12 layers: "10" and "11" sort after "2" only numerically
    blocks = LayerBlocks(tensors)
    got = blocks.read([4, 0, 4])
    assert [bytes(p) for p in got] == [expected_payload(tensors, b) for b in (4, 0, 4)]
    assert blocks.bytes_per_block == 12 * 2 * 32 * 8 * torch.tensor([], dtype=dtype).element_size()
    assert blocks.dtype == str(dtype).removeprefix("torch.")


def test_a_read_is_a_copy_taken_now() -> None:
    tensors = layers()
    blocks = LayerBlocks(tensors)
    before = expected_payload(tensors, 2)
    payload = blocks.read([2])[0]
    for t in tensors.values():
        t[2].zero_()  # vLLM reuses the block
    assert bytes(payload) == before


@settings(max_examples=40, deadline=None)
@given(src=st.lists(st.integers(0, 5), min_size=1, max_size=6), data=st.data())
def test_written_blocks_read_back_identical_and_nothing_else_changes(src: list[int], data: st.DataObject) -> None:
    source = layers(3, shared=True)
    target = layers(3, shared=False)
    for t in target.values():
        t.fill_(7.0)
    dst = data.draw(st.lists(st.integers(0, 5), min_size=len(src), max_size=len(src), unique=True))
    payloads = LayerBlocks(source).read(src)
    sink = LayerBlocks(target)
    sink.write(dst, payloads)
    for s, d in zip(src, dst, strict=True):
        assert expected_payload(target, d) == expected_payload(source, s)
    untouched = set(range(SHAPE[0])) - set(dst)
    for t in target.values():
        for b in untouched:
            assert bool((t[b] == 7.0).all())


def test_a_bad_write_writes_nothing() -> None:
    target = layers(2)
    before = {name: t.clone() for name, t in target.items()}
    blocks = LayerBlocks(target)
    good = bytes(blocks.bytes_per_block)
    with pytest.raises(InvalidArgumentError):
        blocks.write([0, 1], [good, good[:-1]])  # one short payload
    with pytest.raises(InvalidArgumentError):
        blocks.write([0, 6], [good, good])  # an id past the pool
    with pytest.raises(InvalidArgumentError):
        blocks.write([1, 1], [good, good])
    with pytest.raises(InvalidArgumentError):
        blocks.write([0], [good, good])
    with pytest.raises(InvalidArgumentError):
        blocks.write([0], [object()])
    assert all(torch.equal(before[name], t) for name, t in target.items())


def test_layers_that_disagree_are_refused() -> None:
    with pytest.raises(ConfigError):
        LayerBlocks({})
    mixed = layers(2)
    mixed["model.layers.1.self_attn.attn"] = mixed["model.layers.1.self_attn.attn"].to(torch.float16)
    with pytest.raises(ConfigError):
        LayerBlocks(mixed)
    strided = {"l0": torch.zeros(8, 6, 32, 4).permute(1, 0, 2, 3)}  # a block is not one run of memory
    with pytest.raises(ConfigError):
        LayerBlocks(strided)
    with pytest.raises(InvalidArgumentError):
        LayerBlocks(layers()).read([-1])


def test_layer_order_is_numeric() -> None:
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 1, 0, 11)]
    assert sorted(names, key=layer_order) == [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 10, 11)]


def test_the_device_path_moves_the_same_bytes_as_the_host_path() -> None:
    """Off the host (a GPU), blocks move by torch gather/scatter; on CPU that path must agree byte for byte."""
    source = layers(3, torch.bfloat16)
    host_path = LayerBlocks(source)
    device_path = LayerBlocks(source)
    device_path._host = None  # what a CUDA tensor gets
    ids = [5, 1, 3]
    assert [bytes(p) for p in device_path.read(ids)] == [bytes(p) for p in host_path.read(ids)]
    target = layers(3, torch.bfloat16, shared=False)
    writer = LayerBlocks(target)
    writer._host = None
    writer.write([0, 2, 4], host_path.read(ids))
    assert [expected_payload(target, b) for b in (0, 2, 4)] == [expected_payload(source, b) for b in ids]


def arranged(how: str, n: int, dtype: torch.dtype, order: list[int]) -> dict[str, torch.Tensor]:
    """``n`` layers of SHAPE laid out in memory ``how``; layer ``i`` named ``model.layers.{i}``."""
    gen = torch.Generator().manual_seed(n)
    nb, *block = SHAPE
    if how == "separate":
        views = [torch.randn(SHAPE, generator=gen).to(dtype) for _ in range(n)]
    elif how == "interleaved":  # [num_blocks, layers, ...]: a layer's blocks are layers apart
        buffer = torch.randn((nb, n, *block), generator=gen).to(dtype)
        views = [buffer[:, i] for i in range(n)]
    else:
        spread = {"stacked": 1, "gapped": 2}.get(how, 1)
        buffer = torch.randn((n * spread + 1, *SHAPE), generator=gen).to(dtype)
        slots = [i * spread for i in range(n)]
        if how == "uneven":  # one layer a slot further than the others
            slots = [i + (i == n - 1) for i in range(n)]
        if how == "permuted":  # names in another order than memory
            slots = [order.index(i) for i in range(n)]
        views = [buffer[slot] for slot in slots]
    return {f"model.layers.{i}.self_attn.attn": views[i] for i in range(n)}


@settings(max_examples=60, deadline=None)
@given(
    how=st.sampled_from(["stacked", "interleaved", "gapped", "uneven", "permuted", "separate"]),
    n=st.integers(1, 5),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]),
    ids=st.lists(st.integers(0, SHAPE[0] - 1), min_size=1, max_size=5),
    data=st.data(),
)
def test_every_memory_layout_copies_the_defined_payload(how, n, dtype, ids, data) -> None:  # type: ignore[no-untyped-def]
    """One copy over every layer (layers at a fixed distance in one buffer) or one a layer (otherwise): the
    payload is the definition's, and the one-call path is taken exactly where the layout allows it."""
    order = data.draw(st.permutations(range(n)))
    tensors = arranged(how, n, dtype, order)
    blocks = LayerBlocks(tensors)
    assert [bytes(p) for p in blocks.read(ids)] == [expected_payload(tensors, b) for b in ids]
    out = bytearray(blocks.bytes_per_block)
    blocks.copy_out(ids[0], memoryview(out))
    assert bytes(out) == expected_payload(tensors, ids[0])
    in_order = how != "permuted" or order == sorted(order)
    fixed_distance = (
        how in ("stacked", "interleaved", "gapped")
        or (how == "permuted" and in_order)
        or (
            how == "uneven" and n == 2  # two layers are always a fixed distance apart
        )
    )
    assert (blocks._stacked is not None) == (n > 1 and fixed_distance)
