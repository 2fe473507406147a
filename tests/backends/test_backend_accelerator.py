"""The accelerator transfer logic (shared by CUDA and XPU), driven on the CPU through a fake device module.

The fake records what a real stream API would be asked (waits, stream contexts, events) and
treats caches allocated by the fake backend as device memory. Real asynchrony is checked by
the ``cuda`` tests on a GPU; this checks every branch of the control flow everywhere:
direct DMA per run, staged payloads in both directions, the deferred host-side scatter, and
the one-launch device-to-device copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from unittest import mock

import pytest
import torch

from kvblocks.backends import CPUBackend, KVCacheSpec, movement
from kvblocks.backends import accelerator as accelerator_module
from kvblocks.backends.accelerator import AcceleratorBackend
from kvblocks.backends.base import TorchBackend


class FakeEvent:
    def __init__(self) -> None:
        self.recorded_on = None
        self.polls = 0

    def record(self, stream) -> None:
        self.recorded_on = stream

    def query(self) -> bool:
        self.polls += 1
        return self.polls > 1  # the first poll finds the copy still in flight

    def synchronize(self) -> None:
        self.polls = 2


class FakeStream:
    def __init__(self, device=None) -> None:
        self.waited_for: list[FakeStream] = []

    def wait_stream(self, other) -> None:
        self.waited_for.append(other)


class FakeModule:
    def __init__(self) -> None:
        self.current = FakeStream()
        self.entered: list[FakeStream] = []
        self.events: list[FakeEvent] = []

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def Stream(self, device=None) -> FakeStream:
        return FakeStream(device)

    @contextlib.contextmanager
    def stream(self, s: FakeStream):
        self.entered.append(s)
        yield

    def current_stream(self, device=None) -> FakeStream:
        return self.current

    def Event(self) -> FakeEvent:
        event = FakeEvent()
        self.events.append(event)
        return event

    def synchronize(self, device=None) -> None:
        pass


class FakeAccelerator(AcceleratorBackend):
    """The AcceleratorBackend logic on CPU tensors; caches it allocates count as device memory."""

    name = "fake"

    def __init__(self) -> None:
        TorchBackend.__init__(self, "cpu")
        self._side_stream = None
        self.module = FakeModule()
        self._device_caches: weakref.WeakSet = weakref.WeakSet()

    @classmethod
    def is_available(cls) -> bool:
        return True

    def device_module(self):  # type: ignore[override]
        return self.module

    def allocate(self, spec, num_blocks, *, pin_memory=False):
        cache = super().allocate(spec, num_blocks, pin_memory=pin_memory)
        self._device_caches.add(cache)
        return cache

    def _is_host(self, cache) -> bool:
        return cache not in self._device_caches

    def _host_staging(self, shape):
        return torch.empty(shape, dtype=torch.uint8)  # no pinned allocator on a CPU-only machine


LARGE = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, dtype="float32", block_size=16)  # 256 KiB rows
SMALL = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)


def _host(spec, num_blocks: int, *, pinned: bool, seed: int = 0):
    cache = CPUBackend().allocate(spec, num_blocks)
    cache.storage.copy_(
        torch.randint(0, 256, cache.storage.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    )
    return dataclasses.replace(cache, pinned=pinned)


def _rows(cache, ids):
    return cache.storage.view(cache.num_blocks, -1)[ids]


@pytest.mark.parametrize(
    "spec, pinned, path",
    [(LARGE, True, "direct"), (SMALL, True, "staged"), (LARGE, False, "staged")],
    ids=["large-pinned", "small-pinned", "large-pageable"],
)
def test_host_to_device_paths(spec, pinned: bool, path: str) -> None:
    gpu = FakeAccelerator()
    device = gpu.allocate(spec, 8)
    host = _host(spec, 8, pinned=pinned)
    src, dst = [6, 1, 4], [0, 5, 2]  # scattered: no run longer than one block
    with mock.patch.object(accelerator_module, "gather_into", wraps=accelerator_module.gather_into) as staged:
        handle = gpu.transfer(host, device, src, dst, non_blocking=True)
    assert (staged.call_count == 0) is (path == "direct")
    assert gpu.module.entered == [gpu._stream()]  # the copy ran on the side stream ...
    assert gpu._stream().waited_for == [gpu.module.current]  # ... after the work already queued
    assert gpu.module.events[-1].recorded_on is gpu._stream()
    assert handle.done() is False and handle.done() is True  # polled while in flight, then done
    assert torch.equal(_rows(device, dst), _rows(host, src))


def test_device_to_host_staged_scatters_on_the_host_only_once_landed() -> None:
    gpu = FakeAccelerator()
    device = gpu.allocate(SMALL, 8)
    device.storage.copy_(torch.arange(device.storage.numel(), dtype=torch.int64).to(torch.uint8))
    host = _host(SMALL, 8, pinned=False)
    before = host.storage.clone()
    handle = gpu.transfer(device, host, [3, 7], [1, 2], non_blocking=True)
    assert torch.equal(host.storage, before)  # the host-side scatter waits for the copy
    assert handle.event is not None
    handle.wait()
    assert handle.event is None and handle.done()
    assert torch.equal(_rows(host, [1, 2]), _rows(device, [3, 7]))


def test_device_to_host_direct_when_pinned_and_large() -> None:
    gpu = FakeAccelerator()
    device = gpu.allocate(LARGE, 6)
    device.storage.fill_(9)
    host = _host(LARGE, 6, pinned=True)
    handle = gpu.transfer(device, host, [5, 0], [2, 4])  # blocking: done on return
    assert handle.done() and handle.event is None
    assert torch.equal(_rows(host, [2, 4]), _rows(device, [5, 0]))


def test_device_to_device_is_one_batched_copy_per_row_tensor() -> None:
    gpu = FakeAccelerator()
    a, b = gpu.allocate(SMALL, 8), gpu.allocate(SMALL, 8)
    a.storage.copy_(torch.randint(0, 256, a.storage.shape, dtype=torch.uint8))
    with mock.patch.object(movement.torch, "_foreach_copy_", wraps=torch._foreach_copy_) as batched:
        gpu.transfer(a, b, [2, 7, 4], [0, 3, 6])
    assert batched.call_count == len(a.rows) == 1
    assert torch.equal(_rows(b, [0, 3, 6]), _rows(a, [2, 7, 4]))


def test_copy_blocks_on_a_device_uses_the_batched_copy_for_disjoint_sets() -> None:
    gpu = FakeAccelerator()
    cache = gpu.allocate(SMALL, 10)
    cache.storage.copy_(torch.randint(0, 256, cache.storage.shape, dtype=torch.uint8))
    before = cache.storage.clone().view(10, -1)
    with mock.patch.object(movement.torch, "_foreach_copy_", wraps=torch._foreach_copy_) as batched:
        gpu.copy_blocks(cache, [1, 8], [5, 3])
        gpu.copy_blocks(cache, [0, 1], [1, 2])  # overlapping: staged, read before write
    assert batched.call_count == 1
    after = cache.storage.view(10, -1)
    assert torch.equal(after[5], before[1]) and torch.equal(after[3], before[8])
    assert torch.equal(after[1], before[0]) and torch.equal(after[2], before[1])
