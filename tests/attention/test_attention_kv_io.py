"""K/V writes land in the cache's bytes through every documented path; paged attention on the step metadata
equals dense attention."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks import KVCacheManager
from kvblocks.attention import StepMetadata, StepMetadataBuilder, gather_kv, write_kv
from kvblocks.backends import KVCacheSpec, get_backend
from kvblocks.backends.cache import KVCache
from kvblocks.errors import ConfigError, InvalidArgumentError, InvalidBlockIdError
from kvblocks.hybrid import HybridKVCacheManager, LocalGroup

CPU = get_backend("cpu")


def make_cache(num_blocks: int = 6, **overrides: object) -> KVCache:
    fields: dict = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "dtype": "float32", "block_size": 4}
    fields.update(overrides)
    cache = CPU.allocate(KVCacheSpec(**fields), num_blocks)
    cache.storage.copy_(torch.randint(0, 256, cache.storage.shape, dtype=torch.uint8, generator=torch.Generator()))
    return cache


def expected_bytes(cache: KVCache, layer: int, role: str, slots: list[int], source: torch.Tensor) -> np.ndarray:
    """The storage after writing ``source`` into ``slots``, placed by hand from the spec's byte layout."""
    spec = cache.spec
    out = cache.storage.numpy().copy()
    plane = next(p for p in spec.planes() if p.layer == layer and p.role == role)
    size, heads, dim, es = spec.block_size, spec.num_kv_heads, spec.head_dim, spec.element_size
    raw = source.contiguous().view(torch.uint8).numpy().reshape(len(slots), heads, dim * es)
    for token, slot in enumerate(slots):
        block, offset = divmod(slot, size)
        base = block * spec.bytes_per_block + plane.offset if spec.block_major else plane.offset * cache.num_blocks
        if not spec.block_major:
            base += block * plane.nbytes
        for head in range(heads):
            element = (offset * heads + head) * dim if spec.layout == "NHD" else (head * size + offset) * dim
            start = base + element * es
            out[start : start + dim * es] = raw[token, head]
    return out


ARRANGEMENTS = [(major, layout) for major in (True, False) for layout in ("NHD", "HND")]


@settings(max_examples=150, deadline=None)
@given(
    arrangement=st.sampled_from(ARRANGEMENTS),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    layer=st.integers(0, 1),
    data=st.data(),
)
def test_write_kv_lands_in_the_cache_bytes_in_every_arrangement(arrangement, dtype, layer, data) -> None:
    block_major, layout = arrangement
    cache = make_cache(block_major=block_major, layout=layout, dtype=dtype)
    slots = data.draw(st.lists(st.integers(0, cache.num_blocks * 4 - 1), min_size=0, max_size=12, unique=True))
    key = torch.randn(len(slots), 2, 4).to(getattr(torch, dtype))
    value = torch.randn(len(slots), 2, 4).to(getattr(torch, dtype))
    want = expected_bytes(cache, layer, "k", slots, key)
    cache_v = cache.storage.numpy().copy()
    cache.storage.copy_(torch.from_numpy(want))
    want = expected_bytes(cache, layer, "v", slots, value)
    cache.storage.copy_(torch.from_numpy(cache_v))
    write_kv(cache, layer, torch.tensor(slots, dtype=torch.int64), key, value)
    assert np.array_equal(cache.storage.numpy(), want)  # K and V where computed by hand, every other byte kept


@pytest.mark.parametrize("role", ["k", "v"])
def test_the_flat_view_aliases_a_layer_major_cache(role: str) -> None:
    cache = make_cache(block_major=False)
    flat = cache.flat_key(1) if role == "k" else cache.flat_value(1)
    assert flat.shape == (6 * 4, 2, 4)
    slots = [0, 5, 23]
    source = torch.randn(3, 2, 4)
    want = expected_bytes(cache, 1, role, slots, source)
    flat[torch.tensor(slots)] = source  # a write through the view
    assert np.array_equal(cache.storage.numpy(), want)
    again = torch.randn(3, 2, 4)
    want = expected_bytes(cache, 1, role, slots, again)
    flat.index_copy_(0, torch.tensor(slots), again)  # and through index_copy_, the way kernels write slots
    assert np.array_equal(cache.storage.numpy(), want)


def test_the_four_dimensional_views_take_writes_in_place() -> None:
    cache = make_cache()  # block-major
    source = torch.randn(2, 2, 4)
    want = expected_bytes(cache, 0, "k", [9, 10], source)
    cache.key(0)[torch.tensor([2, 2]), torch.tensor([1, 2])] = source
    assert np.array_equal(cache.storage.numpy(), want)


def test_the_flat_slot_trap_a_block_major_reshape_is_a_copy_so_flat_views_refuse() -> None:
    cache = make_cache()
    copied = cache.key(0).reshape(-1, 2, 4)
    before = cache.storage.clone()
    copied[3] = 1.0  # what a flat slot write into the reshape does: nothing reaches the cache
    assert torch.equal(cache.storage, before)
    with pytest.raises(ConfigError, match="strided on blocks"):
        cache.flat_key(0)
    with pytest.raises(ConfigError, match="strided on blocks"):
        cache.flat_value(0)
    with pytest.raises(ConfigError, match="HND"):
        make_cache(block_major=False, layout="HND").flat_key(0)


def test_mla_writes_the_latent_only() -> None:
    spec = KVCacheSpec.mla(num_layers=1, kv_lora_rank=4, qk_rope_head_dim=4, dtype="float32", block_size=4)
    cache = CPU.allocate(spec, 3)
    latent = torch.randn(2, 1, 8)
    want = expected_bytes(cache, 0, "k", [1, 6], latent)
    write_kv(cache, 0, torch.tensor([1, 6]), latent, None)
    assert np.array_equal(cache.storage.numpy(), want)
    with pytest.raises(ConfigError):
        write_kv(cache, 0, torch.tensor([1, 6]), latent, latent)
    key, value = gather_kv(cache, 0, [0, 1], 7, start=5)
    assert torch.equal(key[1], latent[1]) and value is None


def test_bad_writes_raise_and_change_nothing() -> None:
    cache = make_cache()
    before = cache.storage.clone()
    kv = torch.randn(2, 2, 4)
    slots = torch.tensor([0, 1])
    for args in (
        (cache, 2, slots, kv, kv),  # no layer 2
        (cache, 0, torch.tensor([0, 24]), kv, kv),  # slot beyond num_blocks * block_size
        (cache, 0, torch.tensor([-1, 0]), kv, kv),
        (cache, 0, torch.tensor([0.0, 1.0]), kv, kv),
        (cache, 0, slots, kv[:1], kv),
        (cache, 0, slots, kv.half(), kv),
        (cache, 0, slots, kv, None),
    ):
        with pytest.raises((InvalidArgumentError, InvalidBlockIdError)):
            write_kv(*args)
    assert torch.equal(cache.storage, before)


def test_gather_reads_back_what_was_written_and_refuses_released_blocks_it_needs() -> None:
    cache = make_cache(block_major=True, layout="HND")
    table = [4, 1, 3]
    keys = torch.randn(10, 2, 4)
    values = torch.randn(10, 2, 4)
    slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(10)])
    write_kv(cache, 1, slots, keys, values)
    key, value = gather_kv(cache, 1, torch.tensor(table + [-1], dtype=torch.int32), 10)
    assert torch.equal(key, keys) and torch.equal(value, values)
    key, value = gather_kv(cache, 1, [-1, 1, 3], 10, start=5)  # position 0 released: not needed from token 5
    assert torch.equal(key, keys[5:]) and torch.equal(value, values[5:])
    with pytest.raises(InvalidBlockIdError):
        gather_kv(cache, 1, [-1, 1, 3], 10, start=3)
    with pytest.raises(InvalidArgumentError):
        gather_kv(cache, 1, [4, 1], 10)  # 10 tokens need 3 blocks
    with pytest.raises(InvalidArgumentError):
        gather_kv(cache, 1, table, 10, start=11)


# ---------------------------------------------------------------- paged attention == dense attention

HEADS, KV_HEADS, DIM = 4, 2, 8


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos, k_pos, window: int | None) -> torch.Tensor:
    """Causal (optionally windowed) GQA attention of ``q`` [n, HEADS, DIM] over ``k``/``v`` [m, KV_HEADS, DIM]."""
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / DIM**0.5
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def paged_attention(q, cache, meta: StepMetadata, group: int, window: int | None) -> torch.Tensor:
    """Plain-torch paged attention: each sequence's context read through its row of the block table."""
    out = torch.empty_like(q)
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for i in range(meta.num_seqs):
        a, b, seq_len = starts[i], starts[i + 1], lens[i]
        first = seq_len - (b - a)  # the first new token's position
        lo = 0 if window is None else max(0, first - window + 1)
        k, v = gather_kv(cache, 0, meta.block_tables[group][i], seq_len, start=lo)
        out[a:b] = attend(q[a:b], k, v, torch.arange(first, seq_len), torch.arange(lo, seq_len), window)
    return out


@pytest.mark.parametrize("block_major", [True, False])
@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "sliding-window"])
def test_paged_attention_on_the_metadata_equals_dense_attention(block_major: bool, hybrid: bool) -> None:
    window = 6
    if hybrid:
        m: KVCacheManager = HybridKVCacheManager(
            32, 4, local_groups=[LocalGroup("sliding_window", span=window, num_blocks=32)]
        )
    else:
        m = KVCacheManager(num_blocks=32, block_size=4)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, dtype="float32", block_size=4)
    spec = KVCacheSpec(**{**spec.__dict__, "block_major": block_major})
    caches = [CPU.allocate(spec, 32) for _ in range(2 if hybrid else 1)]
    builder = StepMetadataBuilder(m)
    gen = torch.Generator().manual_seed(0)
    prompts = {"a": 11, "b": 5, "c": 14}
    history: dict[str, tuple[list, list]] = {s: ([], []) for s in prompts}
    for s, n in prompts.items():
        m.add_sequence(s, list(range(n)))
        m.allocate(s, min(n, 6))  # chunked prefill: at most 6 tokens a step
    pending: dict[str, int] = {}
    compared = 0
    for step in itertools.count():
        batch = sorted(prompts)
        if step:
            commits = [pending[s] for s in batch]
            appends = [[1] if pending[s] >= m.num_tokens(s) else None for s in batch]
            news = [min(6, max(1, m.num_tokens(s) + len(a or ()) - pending[s])) for s, a in zip(batch, appends)]
            assert not m.step(batch, commits, appends, news)
        queries = [m.num_allocated_tokens(s) - m.num_computed_tokens(s) for s in batch]
        meta = builder.build(batch, queries)
        q = torch.randn(meta.num_tokens, HEADS, DIM, generator=gen)
        k = torch.randn(meta.num_tokens, KV_HEADS, DIM, generator=gen)
        v = torch.randn(meta.num_tokens, KV_HEADS, DIM, generator=gen)
        for group, cache in enumerate(caches):
            write_kv(cache, 0, meta.slot_mappings[group], k, v)
        starts = meta.query_start_loc.tolist()
        for i, s in enumerate(batch):
            history[s][0].append(k[starts[i] : starts[i + 1]])
            history[s][1].append(v[starts[i] : starts[i + 1]])
            pending[s] = int(meta.seq_lens[i])
        for group, cache in enumerate(caches):
            w = window if group else None
            paged = paged_attention(q, cache, meta, group, w)
            for i, s in enumerate(batch):
                keys, values = torch.cat(history[s][0]), torch.cat(history[s][1])
                positions = meta.positions[starts[i] : starts[i + 1]]
                dense = attend(q[starts[i] : starts[i + 1]], keys, values, positions, torch.arange(len(keys)), w)
                torch.testing.assert_close(paged[starts[i] : starts[i + 1]], dense, rtol=1e-5, atol=1e-5)
                compared += 1
        m.check_integrity()
        if step == 12:
            break
    assert compared == 13 * 3 * len(caches)
    if hybrid:  # the window group released blocks: the kernels above never needed them
        assert -1 in m.group_block_table("c", 1)


@pytest.mark.cuda
@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
def test_on_cuda_writes_and_gathers_match_the_cpu(arrangement) -> None:
    block_major, layout = arrangement
    on_cpu = make_cache(block_major=block_major, layout=layout)
    on_gpu = get_backend("cuda").allocate(on_cpu.spec, on_cpu.num_blocks)
    on_gpu.storage.copy_(on_cpu.storage)
    slots, key, value = torch.tensor([3, 17, 8]), torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    write_kv(on_cpu, 1, slots, key, value)
    write_kv(on_gpu, 1, slots.cuda(), key.cuda(), value.cuda())
    assert torch.equal(on_gpu.storage.cpu(), on_cpu.storage)
    assert torch.equal(gather_kv(on_gpu, 1, [0, 4, 2], 10)[0].cpu(), gather_kv(on_cpu, 1, [0, 4, 2], 10)[0])
