"""The XPU backend (Intel GPUs): native ``torch.xpu``, or the one ``intel_extension_for_pytorch`` provides.

Selection, in order: a torch with ``torch.xpu`` that sees a device; otherwise, after
importing ``intel_extension_for_pytorch`` (which installs ``torch.xpu`` on older torch
builds), the same check again; otherwise unavailable, and selecting it raises
:class:`~kvblocks.errors.BackendUnavailableError` naming what is missing.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvblocks.backends._torch import torch
from kvblocks.backends.accelerator import AcceleratorBackend

__all__ = ["XPUBackend", "xpu_status"]

IPEX_MODULE = "intel_extension_for_pytorch"


def _native_xpu() -> Any:
    return getattr(torch, "xpu", None)


def xpu_status() -> tuple[bool, str]:
    """(available, how or why not). Imports ``intel_extension_for_pytorch`` only when native XPU is absent."""
    xpu = _native_xpu()
    if xpu is not None and xpu.is_available():
        return True, "native torch.xpu"
    try:
        importlib.import_module(IPEX_MODULE)
    except ImportError:
        if xpu is None:
            return False, f"torch {torch.__version__} has no torch.xpu and {IPEX_MODULE} is not installed"
        return False, f"torch.xpu sees no XPU device and {IPEX_MODULE} is not installed"
    xpu = _native_xpu()
    if xpu is not None and xpu.is_available():
        return True, f"torch.xpu provided by {IPEX_MODULE}"
    return False, f"{IPEX_MODULE} is installed but no XPU device is visible"


class XPUBackend(AcceleratorBackend):
    """KV caches in Intel XPU device memory (``xpu`` or ``xpu:N``)."""

    name = "xpu"

    @classmethod
    def is_available(cls) -> bool:
        return xpu_status()[0]

    @classmethod
    def unavailable_reason(cls) -> str:
        return f"XPU is unavailable: {xpu_status()[1]}"
