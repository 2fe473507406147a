"""The connector's settings: vLLM's ``kv_connector_extra_config``, checked once, as a dataclass.

::

    kv_transfer_config = {
        "kv_connector": "KVBlocksConnector",
        "kv_connector_module_path": "kvblocks.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"storage": "file", "path": "/mnt/kv"},   # or
        #                            {"storage": "redis", "redis_url": "redis://10.0.0.5:6379/0"},
    }

Every key is optional; an unknown key or a bad value raises :class:`~kvblocks.errors.ConfigError`
when the engine starts, not at the first request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvblocks.integrations.store_settings import StoreSettings

__all__ = ["ConnectorSettings", "DEFAULT_PATH"]

DEFAULT_PATH = "~/.cache/kvblocks/vllm"


@dataclass(frozen=True)
class ConnectorSettings(StoreSettings):
    """What ``kv_connector_extra_config`` may say (see the module docstring): the store
    (:class:`~kvblocks.integrations.store_settings.StoreSettings`) and how long a lookup may wait."""

    where: ClassVar[str] = "kv_connector_extra_config"

    path: str = DEFAULT_PATH
    lookup_timeout_s: float = 1.0
    """Longest a request waits for the store to say which of its blocks it holds (then: what is known)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_number("lookup_timeout_s", low=0)
