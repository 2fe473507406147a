"""kvblocks' HiCache backend driven with SGLang's own objects (SGLang 0.5.23; run in .ci/sglang_env.sh's environment).

SGLang's ``StorageBackendFactory`` loads the backend by its dynamic name; SGLang's real host KV pool
(``MHATokenToKVPoolHost``, CPU tensors) is registered and its pages are written and read the way HiCache's
cache controller calls a backend (``batch_exists``, then ``batch_get_v1`` / ``batch_set_v1`` with host indices
for ``interface_v1``, ``batch_get`` / ``batch_set`` with flat pages otherwise). The device side the host pool is
built over is plain CPU tensors in SGLang's ``MHABufferInfo`` (what its device pool would describe).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvblocks.errors import ConfigError  # noqa: E402

PAGE = 4
LAYERS = 3
PAGE_BYTES = 2 * LAYERS * PAGE * 2 * 8 * 2  # K and V, layers, tokens, heads, head dim, float16
LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def host_pool(
    layout: str,
    dtype: torch.dtype = torch.float16,
    tokens: int = 64,
    *,
    page: int = PAGE,
    layers: int = LAYERS,
    heads: int = 2,
    dim: int = 8,
) -> MHATokenToKVPoolHost:
    """SGLang's MHA host pool over plain CPU "device" buffers, ``tokens`` tokens of ``page``-token pages."""

    def per_layer() -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(tokens + page, heads, dim, dtype=dtype) for _ in range(layers))

    k, v = per_layer(), per_layer()

    def ptrs(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
        page_size=page,
        head_num=heads,
        head_dim=dim,
        v_head_dim=dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info, 2, 0, page, layout, device_capacity_tokens=tokens, start_layer=0, end_layer=layers, pin_memory=False
    )


def extra(tmp_path: Path, **more: object) -> dict[str, object]:
    return {
        "backend_name": "kvblocks",
        "module_path": "kvblocks.integrations.sglang",
        "class_name": "KVBlocksHiCacheStorage",
        "interface_v1": 1,
        "path": str(tmp_path),
        **more,
    }


def backend(pool: MHATokenToKVPoolHost, config: dict[str, object], *, tp_rank: int = 0, tp_size: int = 1, mla=False):
    storage_config = HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=pool.layout != "layer_first",
        model_name="tiny/model",
        extra_config=config,
    )
    b = StorageBackendFactory.create_backend("dynamic", storage_config, pool)
    b.register_mem_pool_host(pool)  # as the cache controller does right after creating it
    return b


def keys(n: int, start: int = 1) -> list[str]:
    return [f"{i:064x}" for i in range(start, start + n)]


def fill_random(pool: MHATokenToKVPoolHost, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.kv_buffer.dtype))


def pages(pool: MHATokenToKVPoolHost, first_index: int, n: int) -> list[torch.Tensor]:
    return [pool.get_data_page(first_index + i * PAGE).clone() for i in range(n)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_written_by_one_instance_are_read_back_bit_for_bit_by_a_new_one(tmp_path, layout: str) -> None:
    writer_pool = host_pool(layout)
    fill_random(writer_pool, 1)
    writer = backend(writer_pool, extra(tmp_path))
    assert writer.batch_exists(keys(4)) == 0
    assert writer.batch_set_v1(keys(4), torch.arange(0, 4 * PAGE)) == [True] * 4
    assert writer.flush(10)
    written = pages(writer_pool, 0, 4)
    writer.close()

    reader_pool = host_pool(layout)
    reader = backend(reader_pool, extra(tmp_path))
    assert reader.batch_exists([*keys(4), "ff" * 32]) == 4  # a prefix count
    assert reader.batch_get_v1(keys(4), torch.arange(8 * PAGE, 12 * PAGE)) == [True] * 4
    assert all(torch.equal(a, b) for a, b in zip(pages(reader_pool, 8 * PAGE, 4), written))
    assert not torch.equal(reader_pool.get_data_page(0), written[0])  # landed where asked, nowhere else
    # the generic (copying) path reads the same entries as SGLang's flat pages
    flat = reader.batch_get(keys(4), [reader_pool.get_dummy_flat_data_page() for _ in range(4)])
    assert all(torch.equal(f, w.flatten()) for f, w in zip(flat, written))
    metrics = reader.get_stats()
    assert metrics.prefetch_pgs == [4] and reader.get_stats().prefetch_pgs == []
    reader.close()


def test_the_generic_write_path_is_read_by_the_zero_copy_one(tmp_path) -> None:
    pool = host_pool("page_first")
    fill_random(pool, 2)
    b = backend(pool, extra(tmp_path, interface_v1=0))
    data = [pool.get_data_page(i * PAGE) for i in range(3)]  # what SGLang's _generic_page_set hands over
    assert b.batch_set(keys(3), data) is True
    assert b.flush(10)
    other = host_pool("page_first")
    assert backend(other, extra(tmp_path)).batch_get_v1(keys(3), torch.arange(0, 3 * PAGE)) == [True] * 3
    assert all(torch.equal(other.get_data_page(i * PAGE), data[i]) for i in range(3))


def test_a_damaged_entry_is_a_counted_miss_and_ends_the_run(tmp_path) -> None:
    pool = host_pool("layer_first")
    fill_random(pool, 3)
    b = backend(pool, extra(tmp_path))
    b.batch_set_v1(keys(4), torch.arange(0, 4 * PAGE))
    assert b.flush(10)
    entries = sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size >= PAGE_BYTES)
    assert len(entries) == 4
    victim = entries[0]  # whichever page it holds, the run ends there
    raw = bytearray(victim.read_bytes())
    raw[-5] ^= 0xFF  # one flipped bit of KV
    victim.write_bytes(bytes(raw))
    fresh_pool = host_pool("layer_first")
    fresh = backend(fresh_pool, extra(tmp_path))
    got = fresh.batch_get_v1(keys(4), torch.arange(0, 4 * PAGE))
    assert got.count(True) < 4 and got == sorted(got, reverse=True)  # a leading run, then misses
    stats = fresh.tier.stats
    assert stats.loads_corrupt == 1


def test_two_kv_dtypes_never_read_each_others_pages(tmp_path) -> None:
    half = host_pool("page_first", torch.float16)
    fill_random(half, 4)
    b16 = backend(half, extra(tmp_path))
    b16.batch_set_v1(keys(2), torch.arange(0, 2 * PAGE))
    assert b16.flush(10)
    bf = host_pool("page_first", torch.bfloat16)
    bbf = backend(bf, extra(tmp_path))
    assert bbf.batch_exists(keys(2)) == 0
    assert bbf.batch_get_v1(keys(2), torch.arange(0, 2 * PAGE)) == [False, False]
    assert torch.count_nonzero(bf.kv_buffer) == 0  # nothing landed


def test_two_layouts_and_two_tensor_parallel_ranks_never_share_pages(tmp_path) -> None:
    pool = host_pool("page_first")
    fill_random(pool, 5)
    b = backend(pool, extra(tmp_path), tp_rank=0, tp_size=2)
    b.batch_set_v1(keys(2), torch.arange(0, 2 * PAGE))
    assert b.flush(10)
    assert backend(host_pool("page_first"), extra(tmp_path), tp_rank=1, tp_size=2).batch_exists(keys(2)) == 0
    assert backend(host_pool("layer_first"), extra(tmp_path), tp_rank=0, tp_size=2).batch_exists(keys(2)) == 0
    assert backend(host_pool("page_first"), extra(tmp_path), tp_rank=0, tp_size=2).batch_exists(keys(2)) == 2


def test_an_mla_replica_that_is_not_the_writer_writes_nothing(tmp_path) -> None:
    pool = host_pool("page_first")
    fill_random(pool, 6)
    replica = backend(pool, extra(tmp_path), tp_rank=1, tp_size=2, mla=True)
    assert replica.writer is False
    assert replica.batch_set_v1(keys(2), torch.arange(0, 2 * PAGE)) == [True, True]
    assert replica.flush(10)
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size >= PAGE_BYTES]


@pytest.mark.parametrize(
    "bad", [{"pth": "/x"}, {"storage": "s3"}, {"lookup_timeout_s": -1}, {"max_pending_writes": True}]
)
def test_bad_extra_config_is_refused_when_sglang_attaches_the_backend(tmp_path, bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        backend(host_pool("page_first"), {**extra(tmp_path), **bad})


def test_a_missing_page_in_the_middle_ends_the_prefix(tmp_path) -> None:
    pool = host_pool("page_first")
    fill_random(pool, 7)
    b = backend(pool, extra(tmp_path))
    ks = keys(4)
    b.batch_set_v1([ks[0], ks[1], ks[3]], torch.tensor([*range(0, 2 * PAGE), *range(3 * PAGE, 4 * PAGE)]))
    assert b.flush(10)
    fresh = backend(host_pool("page_first"), extra(tmp_path))
    assert fresh.batch_exists(ks) == 2
    assert fresh.batch_get_v1(ks, torch.arange(0, 4 * PAGE)) == [True, True, False, False]


@pytest.mark.skipif(not os.environ.get("KVBLOCKS_TEST_REDIS_URL"), reason="set KVBLOCKS_TEST_REDIS_URL")
def test_pages_round_trip_through_redis_for_several_nodes(tmp_path) -> None:
    url = os.environ["KVBLOCKS_TEST_REDIS_URL"]
    salt = f"sglang-test-{os.getpid()}-{id(tmp_path)}"
    pool = host_pool("layer_first")
    fill_random(pool, 8)
    b = backend(pool, extra(tmp_path, storage="redis", redis_url=url, salt=salt))
    b.batch_set_v1(keys(3), torch.arange(0, 3 * PAGE))
    assert b.flush(10)
    other_pool = host_pool("layer_first")
    other = backend(other_pool, extra(tmp_path, storage="redis", redis_url=url, salt=salt))
    assert other.batch_get_v1(keys(3), torch.arange(0, 3 * PAGE)) == [True] * 3
    assert all(torch.equal(a, b_) for a, b_ in zip(pages(other_pool, 0, 3), pages(pool, 0, 3)))


# ---------------------------------------------------------------- extra pools (SGLang's v2 calls)

from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost  # noqa: E402


def mamba_pool(seed: int | None = None) -> MambaPoolHost:
    """SGLang's Mamba state host pool (one state per page; its pages are copies, not views)."""
    info = MambaStateBufferInfo(temporal=torch.zeros(2, 9, 4, 8), conv=(torch.zeros(2, 9, 3, 5),))
    pool = MambaPoolHost(info, 2, 0, device_capacity=8, pin_memory=False, layout="page_first")
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for i in range(4):
            page = torch.randint(0, 255, pool.get_data_page(i).shape, generator=g, dtype=torch.uint8)
            pool.set_from_flat_data_page(i, page)
    return pool


def hybrid_backend(tmp_path: Path, kv: MHATokenToKVPoolHost, swa: MHATokenToKVPoolHost, mamba: MambaPoolHost):
    b = backend(kv, extra(tmp_path))
    b.register_mem_host_pool_v2(swa, PoolName.SWA)
    b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    return b


def test_extra_pools_round_trip_through_the_v2_calls(tmp_path) -> None:
    kv, swa, mamba = host_pool("page_first"), host_pool("page_first"), mamba_pool(seed=9)
    fill_random(kv, 20)
    fill_random(swa, 21)
    b = hybrid_backend(tmp_path, kv, swa, mamba)
    ks = keys(4)
    assert b.batch_set_v1(ks, torch.arange(0, 4 * PAGE)) == [True] * 4
    done = b.batch_set_v2(
        [
            PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(0, 4 * PAGE), keys=ks),
            PoolTransfer(name=PoolName.MAMBA, host_indices=torch.arange(3, 4), keys=ks[3:]),
        ]
    )
    assert done == {PoolName.SWA: [True] * 4, PoolName.MAMBA: [True]}
    assert b.flush(10)

    kv2, swa2, mamba2 = host_pool("page_first"), host_pool("page_first"), mamba_pool()
    fresh = hybrid_backend(tmp_path, kv2, swa2, mamba2)
    found = fresh.batch_exists_v2(
        ks,
        [
            PoolTransfer(name=PoolName.SWA, keys=ks[2:], hit_policy=PoolHitPolicy.TRAILING_PAGES),
            PoolTransfer(name=PoolName.MAMBA, keys=ks[3:], hit_policy=PoolHitPolicy.TRAILING_PAGES),
        ],
    )
    assert found.kv_hit_pages == 4 and found.restorable_prefix_pages == [4]  # Mamba state only at page 4
    got = fresh.batch_get_v2(
        [
            PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(8 * PAGE, 12 * PAGE), keys=ks),
            PoolTransfer(name=PoolName.MAMBA, host_indices=torch.arange(5, 6), keys=ks[3:]),
        ]
    )
    assert got == {PoolName.SWA: [True] * 4, PoolName.MAMBA: [True]}
    assert all(torch.equal(a, b_) for a, b_ in zip(pages(swa2, 8 * PAGE, 4), pages(swa, 0, 4)))
    assert torch.equal(mamba2.get_data_page(5), mamba.get_data_page(3))  # the copying path put it back


def test_an_extra_pool_missing_a_page_cuts_the_restorable_prefix(tmp_path) -> None:
    kv, swa = host_pool("page_first"), host_pool("page_first")
    fill_random(kv, 22)
    fill_random(swa, 23)
    b = hybrid_backend(tmp_path, kv, swa, mamba_pool())
    ks = keys(4)
    b.batch_set_v1(ks, torch.arange(0, 4 * PAGE))
    b.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(0, 2 * PAGE), keys=ks[:2])])
    assert b.flush(10)
    fresh = hybrid_backend(tmp_path, host_pool("page_first"), host_pool("page_first"), mamba_pool())
    every = fresh.batch_exists_v2(ks, [PoolTransfer(name=PoolName.SWA, keys=ks, hit_policy=PoolHitPolicy.ALL_PAGES)])
    assert (every.kv_hit_pages, every.extra_pool_hit_pages[PoolName.SWA]) == (2, 2)
    trailing = fresh.batch_exists_v2(
        ks, [PoolTransfer(name=PoolName.SWA, keys=ks[:1], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    )
    assert trailing.restorable_prefix_pages == [1, 2]  # a one-page window ending at page 1 or 2
    nothing = fresh.batch_exists_v2(ks, [PoolTransfer(name="draft", keys=ks, hit_policy=PoolHitPolicy.ALL_PAGES)])
    assert nothing.kv_hit_pages == 0  # a pool nobody registered restores nothing


def test_a_transfer_whose_indices_do_not_cover_its_pages_moves_nothing(tmp_path) -> None:
    b = hybrid_backend(tmp_path, host_pool("page_first"), host_pool("page_first"), mamba_pool())
    short = PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(0, PAGE), keys=keys(2))
    assert b.batch_set_v2([short]) == {PoolName.SWA: [False, False]}
    assert b.batch_get_v2([short]) == {PoolName.SWA: [False, False]}


def test_backup_and_prefetch_threads_at_once_never_read_wrong_pages(tmp_path) -> None:
    """SGLang backs pages up on one thread while another prefetches: every page read is the page written."""
    import threading

    writer_pool = host_pool("layer_first", tokens=64)
    fill_random(writer_pool, 30)
    b = backend(writer_pool, extra(tmp_path))
    reader_pool = host_pool("layer_first", tokens=64)
    reader = backend(reader_pool, extra(tmp_path))
    ks = keys(16)
    expected = {k: writer_pool.get_data_page((i % 16) * PAGE).clone() for i, k in enumerate(ks)}
    stop = threading.Event()
    errors: list[str] = []

    def backup() -> None:
        for start in range(0, 16, 4):
            b.batch_set_v1(ks[start : start + 4], torch.arange(start * PAGE, (start + 4) * PAGE))
        b.flush(10)
        stop.set()

    def prefetch() -> None:
        while True:  # until one pass after the backup finished
            n = reader.batch_exists(ks)
            got = reader.batch_get_v1(ks[:n], torch.arange(0, n * PAGE))
            for i, ok in enumerate(got):
                if ok and not torch.equal(reader_pool.get_data_page(i * PAGE), expected[ks[i]]):
                    errors.append(f"page {i} read wrong")
            if stop.is_set():
                break

    threads = [threading.Thread(target=backup), threading.Thread(target=prefetch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert reader.batch_exists(ks) == 16
