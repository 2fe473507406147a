"""Block movement bandwidth: scattered blocks against one contiguous copy of the same bytes, same run.

The contiguous copy is the physical limit of the machine; the target is that moving
scattered blocks (random ids, no runs) reaches >= 70% of it on CPU for blocks of 64 KiB or
more, and on a GPU >= 80% for device <-> pinned host and >= 70% for device copies.
"""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.paired import paired_ratio
from kvblocks.backends import CPUBackend, KVCacheSpec, get_backend

POOL_BYTES = 256 << 20
SMOKE_POOL_BYTES = 8 << 20  # a run with benchmarks disabled checks the calls, not the machine: a small pool
SHAPES = {
    # 16-token blocks of a Llama-3-8B-shaped cache: 32 layers, 8 KV heads, head_dim 128, bf16 -> 2 MiB a block
    "2MiB": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128},
    # a small model's block: 2 layers x 8 heads x 128 x bf16 x 16 tokens -> 128 KiB
    "128KiB": {"num_layers": 2, "num_kv_heads": 8, "head_dim": 128},
    # 64 KiB: the smallest block the target speaks of
    "64KiB": {"num_layers": 1, "num_kv_heads": 8, "head_dim": 128},
}


def _setup(benchmark, shape: str, *, block_major: bool = True, device: str = "cpu"):
    spec = KVCacheSpec(dtype="bfloat16", block_size=16, block_major=block_major, **SHAPES[shape])
    pool_bytes = SMOKE_POOL_BYTES if benchmark.disabled else POOL_BYTES
    num_blocks = max(16, pool_bytes // spec.bytes_per_block)
    backend = CPUBackend() if device == "cpu" else get_backend(device)
    cache = backend.allocate(spec, num_blocks)
    count = num_blocks // 4
    ids = random.Random(0).sample(range(num_blocks), count)  # scattered: almost no runs
    # Real bytes on both sides: untouched pages would map to the zero page and flatter the copy.
    cache.storage.random_(0, 256, generator=torch.Generator(device).manual_seed(0))
    contiguous_src = torch.randint(0, 256, (count, spec.bytes_per_block), dtype=torch.uint8, device=device)
    contiguous_dst = torch.zeros_like(contiguous_src)
    return spec, backend, cache, ids, contiguous_src, contiguous_dst


def _tag(benchmark, group: str, subject: str, nbytes: int) -> None:
    benchmark.group = group
    benchmark.extra_info["subject"] = subject
    benchmark.extra_info["bytes"] = nbytes


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("op", ["gather", "scatter", "contiguous copy"])
def test_cpu_gather_scatter(benchmark, shape: str, op: str) -> None:
    _, backend, cache, ids, src, dst = _setup(benchmark, shape)
    _tag(benchmark, f"cpu-move-{shape}", op, src.numel())
    if op == "gather":  # into a reused buffer, as a storage writer does: the same memory the copy writes
        out = benchmark(backend.gather, cache, ids, out=dst)
        assert out.data_ptr() == dst.data_ptr() and out.shape == (len(ids), cache.spec.bytes_per_block)
    elif op == "scatter":
        payload = backend.gather(cache, ids)
        benchmark(backend.scatter, cache, ids, payload)
    else:
        benchmark(dst.copy_, src)


@pytest.mark.parametrize("shape", ["2MiB", "64KiB"])
@pytest.mark.parametrize("block_major", [True, False], ids=["block-major", "layer-major"])
def test_cpu_transfer_between_caches(benchmark, shape: str, block_major: bool) -> None:
    """Cache -> cache with scattered ids on both sides (on a CPU machine: the host tier's path)."""
    spec, backend, cache, ids, src, _ = _setup(benchmark, shape, block_major=block_major)
    other = backend.allocate(spec, cache.num_blocks)
    targets = random.Random(1).sample(range(cache.num_blocks), len(ids))
    arrangement = "block-major" if block_major else "layer-major"
    _tag(benchmark, f"cpu-move-{shape}", f"transfer {arrangement}", src.numel())
    benchmark(lambda: backend.transfer(cache, other, ids, targets).wait())


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("op", ["gather", "scatter", "transfer"])
def test_cpu_move_paired(benchmark, shape: str, op: str) -> None:
    """The same ratios, measured in pairs (see :mod:`benchmarks.paired`): a contiguous copy, then the operation."""
    _, backend, cache, ids, src, dst = _setup(benchmark, shape)
    other = backend.allocate(cache.spec, cache.num_blocks)
    targets = random.Random(1).sample(range(cache.num_blocks), len(ids))
    payload = backend.gather(cache, ids)
    subject = {
        "gather": lambda: backend.gather(cache, ids, out=dst),
        "scatter": lambda: backend.scatter(cache, ids, payload),
        "transfer": lambda: backend.transfer(cache, other, ids, targets).wait(),
    }[op]
    paired_ratio(
        benchmark,
        f"cpu-paired-{shape}",
        op,
        lambda: dst.copy_(src),
        subject,
        baseline_name="contiguous copy",
        target=0.7,
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("direction", ["to device", "to host", "contiguous to device", "contiguous to host"])
def test_cuda_host_transfer(benchmark, direction: str) -> None:
    spec, backend, device_cache, ids, device_src, _ = _setup(benchmark, "2MiB", device="cuda")
    host_cache = CPUBackend().allocate(spec, device_cache.num_blocks, pin_memory=True)
    host_ids = random.Random(1).sample(range(host_cache.num_blocks), len(ids))
    pinned = torch.empty(device_src.shape, dtype=torch.uint8, pin_memory=True)
    _tag(benchmark, "cuda-host-2MiB", direction, device_src.numel())

    def run() -> None:
        if direction == "to device":
            backend.transfer(host_cache, device_cache, host_ids, ids).wait()
        elif direction == "to host":
            backend.transfer(device_cache, host_cache, ids, host_ids).wait()
        elif direction == "contiguous to device":
            device_src.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()
        else:
            pinned.copy_(device_src, non_blocking=True)
            torch.cuda.synchronize()

    benchmark(run)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("op", ["copy_blocks", "contiguous copy"])
def test_cuda_copy_blocks(benchmark, op: str) -> None:
    _, backend, cache, ids, src, dst = _setup(benchmark, "2MiB", device="cuda")
    targets = [b for b in range(cache.num_blocks) if b not in set(ids)][: len(ids)]
    _tag(benchmark, "cuda-device-2MiB", op, src.numel())

    def run() -> None:
        if op == "copy_blocks":
            backend.copy_blocks(cache, ids, targets)
        else:
            dst.copy_(src)
        torch.cuda.synchronize()

    benchmark(run)
