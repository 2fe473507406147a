"""The connector's counters in vLLM's stats: its periodic "KV Transfer metrics" log line, its Prometheus
endpoint and ``LLM.get_metrics()`` (``vllm:kvblocks_*``, the prefix vLLM's metrics API keeps, as its own
connectors do), in-process and in vLLM's multiprocess mode alike.

vLLM's external hit counter (``vllm:external_prefix_cache_hits``) counts what a connector *promised* when the
request was scheduled, even when every load then failed and vLLM recomputed it; ``loaded_blocks`` and
``load_failed_blocks`` here say what arrived. Each worker reports what changed since its last report (vLLM sums
the ranks' reports and the steps of a logging interval), as plain ints, so the payload crosses processes as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvblocks.integrations.vllm.worker import COUNTERS

__all__ = ["COUNTERS", "METRIC_PREFIX", "KVBlocksConnectorStats", "KVBlocksPromMetrics"]

METRIC_PREFIX = "vllm:kvblocks_"
"""Every counter's Prometheus name is this prefix and its :data:`COUNTERS` key (``_total`` in the exposition)."""


@dataclass
class KVBlocksConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """``data``: counter name -> increase since the previous report (see :data:`COUNTERS`)."""

    def reset(self) -> None:
        self.data = dict[str, int]()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if name in COUNTERS and isinstance(value, int):
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: int(value) for name, value in self.data.items() if name in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in COUNTERS)


class KVBlocksPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """One Prometheus counter per :data:`COUNTERS` entry, labelled per engine as vLLM's own metrics are."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: Any):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=f"{METRIC_PREFIX}{name}", documentation=doc, labelnames=labelnames)
            for name, doc in COUNTERS.items()
        }
        self._children: dict[tuple[int, str], Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            counter = self._counters.get(name)
            if counter is None or not isinstance(value, int) or value <= 0:
                continue
            child = self._children.get((engine_idx, name))
            if child is None:
                child = self._children[(engine_idx, name)] = counter.labels(*self.per_engine_labelvalues[engine_idx])
            child.inc(value)
