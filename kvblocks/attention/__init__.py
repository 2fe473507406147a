"""What an attention kernel needs from kvblocks each step: the step's tensors on the cache's device
(block tables, slot mapping, positions, sequence lengths, query start offsets), built incrementally
from the manager's tables, and the K/V write and read of a layer.

``import kvblocks.attention`` imports no torch; the names below load it on first use (the ``torch``
extra). See docs/attention.md.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["PAD", "StepMetadata", "StepMetadataBuilder", "gather_kv", "write_kv"]

_LAZY = {
    "PAD": "kvblocks.attention.step_metadata",
    "StepMetadata": "kvblocks.attention.step_metadata",
    "StepMetadataBuilder": "kvblocks.attention.step_metadata",
    "gather_kv": "kvblocks.attention.kv_io",
    "write_kv": "kvblocks.attention.kv_io",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvblocks.attention' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
