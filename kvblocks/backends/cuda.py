"""The CUDA backend: ``torch.cuda`` devices, asynchronous transfers on a side stream."""

from __future__ import annotations

from kvblocks.backends._torch import torch
from kvblocks.backends.accelerator import AcceleratorBackend

__all__ = ["CUDABackend"]


class CUDABackend(AcceleratorBackend):
    """KV caches in CUDA device memory (``cuda`` or ``cuda:N``)."""

    name = "cuda"

    @classmethod
    def is_available(cls) -> bool:
        return bool(torch.cuda.is_available())

    @classmethod
    def unavailable_reason(cls) -> str:
        if torch.version.cuda is None:
            return f"CUDA is unavailable: this torch build ({torch.__version__}) has no CUDA support"
        return "CUDA is unavailable: torch has CUDA support but sees no GPU (driver, CUDA_VISIBLE_DEVICES?)"
