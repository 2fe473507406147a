"""The connector's counters in vLLM's stats (kvblocks.integrations.vllm.stats): totals per connector half, so a
step's stats that vLLM drops are made good by the next; Prometheus counters grow by each half's change."""

from __future__ import annotations

from typing import Any, ClassVar

from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks.integrations.vllm.stats import KVBlocksConnectorStats, KVBlocksPromMetrics
from kvblocks.integrations.vllm.worker import COUNTERS


def _stats(source: str, **totals: int) -> KVBlocksConnectorStats:
    return KVBlocksConnectorStats(data={"sources": {source: totals}})


def test_merging_keeps_each_halfs_latest_totals_and_sums_the_halves() -> None:
    merged = _stats("worker0", load_blocks=3)
    for later in (_stats("worker1", load_blocks=2), _stats("worker0", load_blocks=5), _stats("worker0", load_blocks=4)):
        merged.aggregate(later)
    merged.aggregate(_stats("scheduler", plan_errors=1))
    assert merged.totals()["load_blocks"] == 7 and merged.totals()["plan_errors"] == 1
    assert merged.reduce() == {"kvblocks_load_blocks_total": 7, "kvblocks_plan_errors_total": 1}
    assert not merged.is_empty() and KVBlocksConnectorStats().is_empty()
    junk = KVBlocksConnectorStats(data={"sources": {"w": {"load_blocks": "x", "nope": 3}}, "other": 1})
    assert junk.is_empty()  # what is not a known counter's int is ignored


class _Counter:
    """prometheus_client's Counter, as much as the connector's metrics use of it."""

    made: ClassVar[dict[str, _Counter]] = {}

    def __init__(self, name: str, documentation: str, labelnames: list[str]) -> None:
        self.values: dict[tuple[Any, ...], float] = {}
        _Counter.made[name] = self

    def labels(self, *values: Any) -> Any:
        counter = self

        class Child:
            def inc(self, amount: float) -> None:
                counter.values[values] = counter.values.get(values, 0) + amount

        return Child()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["worker0", "worker1", "scheduler"]), st.integers(0, 5), st.booleans())))
def test_prometheus_counters_end_at_the_totals_whatever_steps_are_dropped(steps: list[tuple[str, int, bool]]) -> None:
    """Each step a half counts some more loads; vLLM delivers the step's stats or drops them. Once the last totals
    of every half arrive, the counter holds exactly the sum of what all halves counted."""
    from vllm.v1.metrics.loggers import Counter, Gauge, Histogram

    _Counter.made.clear()
    metrics = KVBlocksPromMetrics(
        type("Config", (), {"kv_transfer_config": None})(),
        {Counter: _Counter, Gauge: _Counter, Histogram: _Counter},
        ["engine"],
        {0: ["0"]},
    )
    assert set(_Counter.made) == {f"vllm:kvblocks_{name}" for name in COUNTERS}
    totals = {"worker0": 0, "worker1": 0, "scheduler": 0}
    for source, more, delivered in steps:
        totals[source] += more
        if delivered:
            metrics.observe(_stats(source, load_blocks=totals[source]).data, 0)
    metrics.observe(KVBlocksConnectorStats(data={"sources": {s: {"load_blocks": t} for s, t in totals.items()}}).data)
    assert _Counter.made["vllm:kvblocks_load_blocks"].values.get(("0",), 0) == sum(totals.values())
