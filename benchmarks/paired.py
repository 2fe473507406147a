"""Paired ratios: the baseline and the subject timed back to back in every round.

On a shared machine the speed of everything drifts within seconds (memory bandwidth here
halves and doubles between runs). Medians of two benchmarks run one after the other see
different machines; a ratio taken inside one round sees the same one on both sides. The
median of the rounds' ratios is what :mod:`benchmarks.conftest` checks against the target.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

ROUNDS = 25


def paired_ratio(
    benchmark,
    group: str,
    subject: str,
    baseline: Callable[[], object],
    measured: Callable[[], object],
    *,
    baseline_name: str,
    target: float | None,
    rounds: int = ROUNDS,
    repeat: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Time ``baseline`` then ``measured`` (each ``repeat`` times) per round; record and return the median
    of ``baseline time / measured time``. A run with benchmarks disabled does one round (it checks that
    both sides work, not how fast). ``clock``: wall time by default; ``time.thread_time`` measures the
    calling thread's CPU alone (what a hot path costs its thread, work handed to other threads excluded)."""
    ratios: list[float] = []
    count = 1 if benchmark.disabled else rounds

    def run() -> None:
        for _ in range(count):
            start = clock()
            for _ in range(repeat):
                baseline()
            middle = clock()
            for _ in range(repeat):
                measured()
            ratios.append((middle - start) / (clock() - middle))

    benchmark.group = group
    benchmark.extra_info["subject"] = subject
    benchmark.pedantic(run, rounds=1, iterations=1)
    if len(ratios) != count or not all(r > 0 for r in ratios):
        raise AssertionError(f"paired timing went wrong: {ratios}")
    ratio = statistics.median(ratios)
    benchmark.extra_info["paired_ratio"] = ratio
    benchmark.extra_info["target"] = target
    benchmark.extra_info["baseline"] = baseline_name
    return ratio
