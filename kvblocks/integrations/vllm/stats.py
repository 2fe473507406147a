"""The connector's counters in vLLM's stats: its periodic "KV Transfer metrics" log line, its Prometheus
endpoint and ``LLM.get_metrics()`` (``vllm:kvblocks_*``, the prefix vLLM's metrics API keeps, as its own
connectors do), in-process and in vLLM's multiprocess mode alike.

vLLM's external hit counter (``vllm:external_prefix_cache_hits``) counts what a connector *promised* when the
request was scheduled, even when every load then failed and vLLM recomputed it; ``load_blocks`` and
``load_failed_blocks`` here say what arrived.

Each connector half (the scheduler's, every worker rank's) reports its *totals so far*, keyed by the half
(``{"sources": {"worker0": {...}, "scheduler": {...}}}``), never increments: vLLM may drop a step's stats (an
output it discards, the last steps of a run), and a dropped increment would be lost for good, where a dropped
total is made good by the next. Merging keeps each half's latest totals (``aggregate``: vLLM merges the ranks of
a step and the steps of a logging interval with the same call); the Prometheus counters grow by the change of
each half's total. Plain ints in plain dicts: the payload crosses processes as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvblocks.integrations.vllm.worker import COUNTERS

__all__ = ["COUNTERS", "METRIC_PREFIX", "KVBlocksConnectorStats", "KVBlocksPromMetrics"]

METRIC_PREFIX = "vllm:kvblocks_"
"""Every counter's Prometheus name is this prefix and its :data:`COUNTERS` key (``_total`` in the exposition)."""


def _sources(data: dict[str, Any]) -> dict[str, dict[str, int]]:
    """The per-half totals of a payload, only well-formed entries of known counters."""
    sources = data.get("sources")
    if not isinstance(sources, dict):
        return {}
    return {
        str(source): {name: value for name, value in counters.items() if name in COUNTERS and type(value) is int}
        for source, counters in sources.items()
        if isinstance(counters, dict)
    }


@dataclass
class KVBlocksConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """``data``: ``{"sources": {half: {counter: total so far}}}`` (see the module docstring)."""

    def reset(self) -> None:
        self.data = dict[str, Any](sources={})

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        mine = self.data.setdefault("sources", {})
        for source, counters in _sources(other.data).items():
            kept = mine.setdefault(source, {})
            for name, value in counters.items():
                kept[name] = max(kept.get(name, 0), value)  # totals only grow: the latest is the largest
        return self

    def totals(self) -> dict[str, int]:
        """Every counter summed over the connector's halves."""
        out = dict.fromkeys(COUNTERS, 0)
        for counters in _sources(self.data).values():
            for name, value in counters.items():
                out[name] += value
        return out

    def reduce(self) -> dict[str, int | float]:
        return {f"kvblocks_{name}_total": value for name, value in self.totals().items() if value}

    def is_empty(self) -> bool:
        return not any(self.totals().values())


class KVBlocksPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """One Prometheus counter per :data:`COUNTERS` entry, labelled per engine as vLLM's own metrics are; each grows
    by the change of every connector half's total since the last observation."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: Any):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=f"{METRIC_PREFIX}{name}", documentation=doc, labelnames=labelnames)
            for name, doc in COUNTERS.items()
        }
        self._children: dict[tuple[int, str], Any] = {}
        self._seen: dict[tuple[int, str, str], int] = {}  # (engine, half, counter) -> the total observed

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for source, counters in _sources(transfer_stats_data).items():
            for name, total in counters.items():
                key = (engine_idx, source, name)
                grown = total - self._seen.get(key, 0)
                if grown <= 0:
                    continue
                self._seen[key] = total
                child = self._children.get((engine_idx, name))
                if child is None:
                    labels = self.per_engine_labelvalues[engine_idx]
                    child = self._children[(engine_idx, name)] = self._counters[name].labels(*labels)
                child.inc(grown)
