"""The CUDA backend, checked against the CPU backend as reference. Every test here needs a GPU.

Marked ``cuda``: skipped (with the reason shown) where no GPU is visible, run on a lent
device with ``python -m pytest -m cuda``.
"""

from __future__ import annotations

import multiprocessing
import uuid

import pytest
import torch

from kvblocks.backends import CPUBackend, KVCacheSpec, attach_shared, get_backend, publish_shared
from tests.support.examples import load_example

pytestmark = pytest.mark.cuda

SPECS = [
    KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_size=16),
    KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=32, dtype="float8_e4m3fn", block_size=8, scale_dtype="float32"),
    KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_size=16, block_major=False),
    KVCacheSpec.mla(num_layers=2, kv_lora_rank=64, qk_rope_head_dim=32, dtype="bfloat16", block_size=16),
]


def _random(cache, seed: int) -> None:
    cache.storage.copy_(
        torch.randint(0, 256, cache.storage.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).to(
            cache.device
        )
    )


@pytest.fixture(scope="module")
def gpu():
    return get_backend("cuda")


def test_auto_picks_cuda_and_allocates_on_the_device(gpu) -> None:
    assert get_backend("auto").name == "cuda"
    cache = gpu.allocate(SPECS[0], 32)
    assert cache.device.type == "cuda" and cache.key(2).is_cuda
    assert torch.count_nonzero(cache.storage).item() == 0
    assert get_backend("cuda:0").device == torch.device("cuda", 0)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.dtype}-{'bm' if s.block_major else 'lm'}-{s.kind}")
def test_device_movement_matches_the_cpu_reference(gpu, spec) -> None:
    cpu = CPUBackend()
    on_gpu, on_cpu = gpu.allocate(spec, 40), cpu.allocate(spec, 40)
    _random(on_gpu, 1)
    on_cpu.storage.copy_(on_gpu.storage.cpu())
    src, dst = [3, 17, 4, 5, 6, 39], [0, 1, 2, 30, 31, 32]
    for backend, cache in ((gpu, on_gpu), (cpu, on_cpu)):
        payload = backend.gather(cache, src)
        backend.scatter(cache, [20, 21, 22, 23, 24, 25], payload)
        backend.copy_blocks(cache, src, dst)
        backend.zero(cache, [10, 11, 35])
    gpu.synchronize()
    assert torch.equal(on_gpu.storage.cpu(), on_cpu.storage)
    assert torch.equal(gpu.gather(on_gpu, src).cpu(), cpu.gather(on_cpu, src))


@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.parametrize("ids", [list(range(8, 24)), [5, 33, 2, 17, 9, 28]], ids=["runs", "scattered"])
def test_host_device_transfers_round_trip(gpu, pinned: bool, ids: list[int]) -> None:
    spec = SPECS[0]
    device_cache = gpu.allocate(spec, 40)
    host_cache = CPUBackend().allocate(spec, 40, pin_memory=pinned)
    assert host_cache.pinned is pinned
    _random(device_cache, 2)
    expected = device_cache.storage.view(40, -1)[ids].cpu()
    out = gpu.transfer(device_cache, host_cache, ids, list(range(len(ids))), non_blocking=True)
    out.wait()
    assert out.done()
    assert torch.equal(host_cache.storage.view(40, -1)[: len(ids)], expected)
    gpu.zero(device_cache, ids)
    back = gpu.transfer(host_cache, device_cache, list(range(len(ids))), ids, non_blocking=True)
    back.wait()
    assert torch.equal(device_cache.storage.view(40, -1)[ids].cpu(), expected)


def test_a_transfer_waits_for_work_queued_before_it(gpu) -> None:
    """The side stream must see a write the current stream queued just before the transfer."""
    spec = SPECS[0]
    device_cache = gpu.allocate(spec, 8)
    host_cache = CPUBackend().allocate(spec, 8, pin_memory=True)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):
        big = big @ big  # keep the current stream busy
    device_cache.key(0)[3].fill_(1.25)  # queued behind the matmuls
    gpu.transfer(device_cache, host_cache, [3], [0]).wait()
    assert torch.all(host_cache.key(0)[0] == 1.25)


def test_pinning_is_real_with_a_gpu() -> None:
    cache = CPUBackend().allocate(SPECS[0], 4, pin_memory=True)
    assert cache.pinned and cache.storage.is_pinned()


def _child_attach_cuda(name: str, result) -> None:
    shared = attach_shared(name, timeout=30)
    cache = shared.caches[0]
    result.put(float(cache.key(0)[1].float().mean()))
    cache.key(1)[2].fill_(3.0)
    torch.cuda.synchronize()
    result.put("written")


def test_cuda_caches_shared_through_ipc(gpu) -> None:
    name = f"cuda-{uuid.uuid4().hex[:12]}"
    cache = gpu.allocate(SPECS[0], 6)
    cache.key(0)[1].fill_(2.0)
    torch.cuda.synchronize()
    with publish_shared(name, [cache]):
        ctx = multiprocessing.get_context("spawn")
        result = ctx.Queue()
        child = ctx.Process(target=_child_attach_cuda, args=(name, result))
        child.start()
        assert result.get(timeout=60) == 2.0
        assert result.get(timeout=60) == "written"
        child.join(timeout=60)
        assert child.exitcode == 0
        assert torch.all(cache.key(1)[2] == 3.0)


def test_tiny_model_on_the_gpu_matches_without_caching(gpu) -> None:
    tiny = load_example("tiny_model", "tiny_model_cuda")
    model = tiny.TinyModel()
    prompts = tiny.shared_prefix_prompts()
    plain_cpu = tiny.generate(model, prompts, caching=False)
    host = CPUBackend()

    def through_gpu(request, step, manager, backend, cache):
        """After every step, every block holding KV goes to the GPU and back; the host copy is wiped between."""
        blocks = [b for b in range(cache.num_blocks) if manager.pool.ref_count(b) or manager.pool.is_cached(b)]
        device_cache = gpu.allocate(cache.spec, cache.num_blocks)
        gpu.transfer(cache, device_cache, blocks, blocks)
        host.zero(cache, blocks)
        gpu.transfer(device_cache, cache, blocks, blocks)

    moved = tiny.generate(model, prompts, caching=True, after_step=through_gpu)
    assert tiny.max_logit_difference(plain_cpu, moved) < 1e-4
    assert moved.tokens == plain_cpu.tokens


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (list(range(0, 8)), list(range(1, 9))),
        (list(range(1, 9)), list(range(0, 8))),
        ([8, 9, 10, 11, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7]),
    ],
    ids=["shift-up", "shift-down", "chain"],
)
def test_copy_blocks_with_overlapping_runs_on_the_gpu(gpu, src: list[int], dst: list[int]) -> None:
    cpu = CPUBackend()
    on_gpu, on_cpu = gpu.allocate(SPECS[0], 12), cpu.allocate(SPECS[0], 12)
    _random(on_gpu, 5)
    on_cpu.storage.copy_(on_gpu.storage.cpu())
    gpu.copy_blocks(on_gpu, src, dst)
    cpu.copy_blocks(on_cpu, src, dst)
    gpu.synchronize()
    assert torch.equal(on_gpu.storage.cpu(), on_cpu.storage)


def test_the_transfer_executor_moves_evicted_blocks_through_pinned_host_memory(gpu) -> None:
    """A tiered manager's plans run on a GPU cache and a pinned host cache: write-back, then swap-in."""
    from kvblocks.tiers import TierConfig, TieredKVCacheManager
    from kvblocks.tiers.executor import TransferExecutor

    spec = SPECS[0]
    manager = TieredKVCacheManager(5, spec.block_size, tiers=TierConfig(num_host_blocks=8))
    device_cache = gpu.allocate(spec, 5)
    host_cache = CPUBackend().allocate(spec, 8, pin_memory=True)
    executor = TransferExecutor(manager, gpu, device_cache, host_cache)
    prompt = list(range(4 * spec.block_size + 1))  # 4 full blocks and one token
    manager.add_sequence("a", prompt)
    table = list(manager.allocate("a", len(prompt)))
    _random(device_cache, 6)
    written = device_cache.storage.view(5, -1)[table[:4]].cpu()  # "the forward pass wrote a's KV"
    manager.commit("a", len(prompt))
    manager.free("a")
    manager.add_sequence("b", [10_000 + t for t in prompt])
    manager.allocate("b", len(prompt))  # evicts a's 4 blocks ...
    executor.step()  # ... which go to the pinned host cache first
    device_cache.storage.zero_()  # b's forward pass overwrites everything on the device
    manager.free("b")
    manager.add_sequence("c", prompt)
    assert manager.lookup("c").host == 4 * spec.block_size
    table_c = manager.allocate("c", 1)
    executor.step()  # swap-ins: host -> GPU
    assert manager.is_ready("c")
    assert torch.equal(device_cache.storage.view(5, -1)[list(table_c)[:4]].cpu(), written)
    manager.check_integrity()
