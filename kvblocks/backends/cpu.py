"""The CPU backend: plain tensors in host memory.

``pin_memory=True`` pins the allocation when an accelerator is present (so that device
transfers can be asynchronous); without one there is nothing to pin for, and the request
is ignored -- visibly: the cache reports ``pinned=False`` and a warning says why.
"""

from __future__ import annotations

import warnings

from kvblocks.backends._torch import torch
from kvblocks.backends.base import TorchBackend

__all__ = ["CPUBackend", "accelerator_present"]


def accelerator_present() -> bool:
    """Whether this process can reach a CUDA or XPU device (the only reason to pin host memory)."""
    if torch.cuda.is_available():
        return True
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu.is_available())


class CPUBackend(TorchBackend):
    """KV caches in host memory; every operation completes before it returns."""

    name = "cpu"

    def __init__(self, device: str | torch.device = "cpu") -> None:
        super().__init__(device)

    @classmethod
    def is_available(cls) -> bool:
        return True

    def _pin(self, pin_memory: bool) -> bool:
        if pin_memory and not accelerator_present():
            warnings.warn(
                "pin_memory=True ignored: no CUDA or XPU device in this process, so pinning would buy nothing",
                RuntimeWarning,
                stacklevel=3,
            )
            return False
        return pin_memory
