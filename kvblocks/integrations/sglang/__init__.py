"""kvblocks inside SGLang: a HiCache storage backend over kvblocks' storage tier (``kvblocks[sglang]``).

SGLang loads it by name (``--hicache-storage-backend dynamic`` with ``"module_path":
"kvblocks.integrations.sglang", "class_name": "KVBlocksHiCacheStorage"``; see docs/sglang.md). Only
:mod:`kvblocks.integrations.sglang.backend` imports SGLang; the settings and the page format are plain kvblocks.
"""

from __future__ import annotations

from typing import Any

from kvblocks.integrations.sglang.pages import SglangPageFormat
from kvblocks.integrations.sglang.settings import HiCacheSettings

__all__ = ["HiCacheSettings", "KVBlocksHiCacheStorage", "SglangPageFormat"]


def __getattr__(name: str) -> Any:
    if name == "KVBlocksHiCacheStorage":
        try:
            from kvblocks.integrations.sglang import backend
        except ImportError as error:
            if error.name is not None and error.name.split(".")[0] == "sglang":
                from kvblocks.errors import MissingExtraError

                raise MissingExtraError(f"{__name__}.{name} needs SGLang", "sglang") from error
            raise
        return backend.KVBlocksHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
