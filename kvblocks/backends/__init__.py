"""Torch tensor backends (CPU, CUDA, XPU) that allocate and move the real KV blocks.

Importing this package does not import torch: :class:`KVCacheSpec` and the placement rule
are plain Python, and the torch-backed names below load on first use.

>>> from kvblocks.backends import KVCacheSpec, get_backend
>>> spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
>>> cache = get_backend("cpu").allocate(spec, num_blocks=16)
>>> tuple(cache.key(0).shape)          # NHD: [num_blocks, block_size, num_kv_heads, head_dim]
(16, 4, 2, 8)
"""

from __future__ import annotations

import importlib
from typing import Any

from kvblocks.backends.placement import Placement, Role, plan_placement
from kvblocks.backends.spec import KVCacheSpec

__all__ = [
    "AcceleratorBackend",
    "Backend",
    "CPUBackend",
    "CUDABackend",
    "CacheRegistry",
    "KVCache",
    "KVCacheSpec",
    "LayerKV",
    "Placement",
    "Role",
    "TorchBackend",
    "TransferHandle",
    "XPUBackend",
    "attach_shared",
    "available_backends",
    "get_backend",
    "plan_placement",
    "publish_shared",
    "register_backend",
]

_LAZY = {
    "AcceleratorBackend": "kvblocks.backends.accelerator",
    "Backend": "kvblocks.backends.base",
    "TorchBackend": "kvblocks.backends.base",
    "TransferHandle": "kvblocks.backends.base",
    "CPUBackend": "kvblocks.backends.cpu",
    "CUDABackend": "kvblocks.backends.cuda",
    "XPUBackend": "kvblocks.backends.xpu",
    "KVCache": "kvblocks.backends.cache",
    "LayerKV": "kvblocks.backends.cache",
    "available_backends": "kvblocks.backends.registry",
    "get_backend": "kvblocks.backends.registry",
    "register_backend": "kvblocks.backends.registry",
    "CacheRegistry": "kvblocks.backends.sharing",
    "publish_shared": "kvblocks.backends.sharing",
    "attach_shared": "kvblocks.backends.sharing",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvblocks.backends' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
