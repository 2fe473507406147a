"""What CUDA and XPU share: a device module with streams and events, used for asynchronous transfers.

``torch.cuda`` and ``torch.xpu`` expose the same stream API (``Stream``, ``Event``,
``stream(...)``, ``current_stream(...)``), so one implementation serves both. A transfer
runs on a side stream after the work already queued on the current stream (which wrote
the source blocks), and records an event the caller can wait on::

    current stream  ... attention writes block 7 ... |
    side stream                                      wait -> gather 7 -> copy -> scatter -> event

With a pinned host cache, blocks go straight between the two caches, one DMA per run per
row tensor -- for large blocks even when every run is one block long, since a DMA's setup is
small next to moving a large block. Between device caches, all block copies run in one
multi-tensor kernel. Otherwise blocks travel as a staged payload.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvblocks.backends._torch import torch
from kvblocks.backends.base import TorchBackend, TransferHandle
from kvblocks.backends.cache import KVCache
from kvblocks.backends.movement import copy_between, copy_pairs_batched, gather_into, scatter_from
from kvblocks.errors import BackendUnavailableError

__all__ = ["AcceleratorBackend"]

_DMA_PER_BLOCK_MIN_BYTES = 256 << 10  # from this row width on, one DMA per scattered block beats staging


class AcceleratorBackend(TorchBackend):
    """A torch accelerator device (``cuda`` or ``xpu``) with a side stream for transfers.

    Transfers run between host memory and this device, or within it.
    """

    name: ClassVar[str] = ""

    def __init__(self, device: str | torch.device | int | None = None) -> None:
        if not self.is_available():
            raise BackendUnavailableError(self.unavailable_reason())
        if device is None:
            device = torch.device(self.name, self.device_module().current_device())
        elif isinstance(device, int):
            device = torch.device(self.name, device)
        super().__init__(device)
        if self._device.type != self.name:
            raise BackendUnavailableError(f"{type(self).__name__} drives {self.name} devices, not {self._device}")
        if self._device.index is None:
            self._device = torch.device(self.name, self.device_module().current_device())
        count = self.device_module().device_count()
        if self._device.index >= count:
            raise BackendUnavailableError(
                f"{self._device} does not exist: this process sees {count} {self.name} devices"
            )
        self._side_stream: Any = None

    @classmethod
    def device_module(cls) -> Any:
        """``torch.cuda`` or ``torch.xpu``."""
        return getattr(torch, cls.name)

    @classmethod
    def unavailable_reason(cls) -> str:
        return f"no {cls.name} device is available to this process"

    def _stream(self) -> Any:
        if self._side_stream is None:
            self._side_stream = self.device_module().Stream(device=self._device)
        return self._side_stream

    def synchronize(self) -> None:
        self.device_module().synchronize(self._device)

    def _run_by_run(self, cache: KVCache) -> bool:
        return False  # one multi-tensor kernel (_copy_disjoint) beats a launch per block at any size

    def _copy_disjoint(self, cache: KVCache, src: Any, dst: Any) -> bool:
        return copy_pairs_batched(cache, cache, src, dst)

    def _move(self, src: KVCache, dst: KVCache, source: Any, target: Any, *, non_blocking: bool) -> TransferHandle:
        module = self.device_module()
        stream = self._stream()
        stream.wait_stream(module.current_stream(self._device))  # the source blocks were written before this call
        host = src if self._is_host(src) else dst if self._is_host(dst) else None
        finish = None
        keepalive: tuple[object, ...] = ()
        with module.stream(stream):
            if host is None:  # device <-> device: one multi-tensor kernel per row tensor
                direct = copy_pairs_batched(src, dst, source, target)
            else:
                large = min(r.shape[1] * r.element_size() for r in src.rows) >= _DMA_PER_BLOCK_MIN_BYTES
                direct = host.pinned and copy_between(src, dst, source, target, non_blocking=True, any_runs=large)
            if not direct:
                finish, keepalive = self._staged(src, dst, source, target)
            event = module.Event()
            event.record(stream)
        handle = TransferHandle(event, finish=finish, keepalive=keepalive)
        if not non_blocking:
            handle.wait()
        return handle

    def _is_host(self, cache: KVCache) -> bool:
        """Whether ``cache`` lives in host memory (the other side of a DMA)."""
        return cache.device.type == "cpu"

    def _host_staging(self, shape: tuple[int, int]) -> torch.Tensor:
        """A pinned host buffer: what asynchronous DMA needs on the host side."""
        return torch.empty(shape, dtype=torch.uint8, pin_memory=True)

    def _staged(self, src: KVCache, dst: KVCache, source: Any, target: Any) -> tuple[Any, tuple[object, ...]]:
        """Move the blocks as one payload: gather where they are, one copy across, scatter where they go."""
        shape = (len(source), src.spec.bytes_per_block)
        if self._is_host(src):  # host -> device: gather into pinned memory, one DMA, scatter on device
            staging = self._host_staging(shape)
            gather_into(src, source, staging)
            arrived = staging.to(dst.device, non_blocking=True)
            scatter_from(dst, target, arrived)
            return None, (staging, arrived)
        payload = torch.empty(shape, dtype=torch.uint8, device=src.device)
        gather_into(src, source, payload)
        if self._is_host(dst):  # device -> host: the host-side scatter runs once the copy has landed
            landing = self._host_staging(shape)
            landing.copy_(payload, non_blocking=True)
            return (lambda: scatter_from(dst, target, landing)), (payload, landing)
        arrived = payload.to(dst.device, non_blocking=True)  # device -> another device
        scatter_from(dst, target, arrived)
        return None, (payload, arrived)
