"""Ratio reporting: each benchmark names its subject; ratios compare medians measured in the same run.

Absolute times on shared machines are noise; a ratio between two things measured
minutes apart in one process is not. At the end of a ``--benchmark-enable`` run
this prints every ratio below with its target, and ``--kvblocks-ratios PATH``
writes them as JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Ratio:
    group: str
    subject: str
    baseline: str
    target: float | None  # minimum of baseline_median / subject_median, or None (report only)
    meaning: str


RATIOS = [
    *(
        Ratio(f"hash-{size}", "kvblocks xxh3-128", "pickle+xxh3-128", 3.0, "speedup over vLLM-style hashing")
        for size in ("1k", "32k", "128k")
    ),
    *(
        Ratio(f"hash-{size}", "kvblocks sha256", "pickle+sha256", None, "speedup over pickle+sha256")
        for size in ("1k", "32k", "128k")
    ),
    *(
        Ratio(f"hash-{size}", "kvblocks xxh3-64-1337", "pickle+xxh3-128", None, "interop scheme vs vLLM-style")
        for size in ("1k", "32k", "128k")
    ),
    Ratio("lifecycle-chat", "kvblocks", "floor", 0.5, "speed relative to the dict+deque floor (0.5 = 2x slower)"),
    Ratio("lifecycle-hashes", "kvblocks", "floor", 0.5, "speed relative to the dict+deque floor (0.5 = 2x slower)"),
]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--kvblocks-ratios", default=None, help="write the benchmark ratios as JSON to this path")


def _medians(config: pytest.Config) -> dict[tuple[str, str], float]:
    session = getattr(config, "_benchmarksession", None)
    out: dict[tuple[str, str], float] = {}
    for bench in getattr(session, "benchmarks", []) or []:
        subject = bench.extra_info.get("subject")
        if bench and subject:
            out[(bench.group, subject)] = bench.stats.median
    return out


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    medians = _medians(config)
    rows = []
    for r in RATIOS:
        subject, baseline = medians.get((r.group, r.subject)), medians.get((r.group, r.baseline))
        if subject is None or baseline is None:
            continue
        value = baseline / subject
        verdict = "-" if r.target is None else ("met" if value >= r.target else "MISSED")
        rows.append(
            {
                "group": r.group,
                "subject": r.subject,
                "baseline": r.baseline,
                "subject_median_s": subject,
                "baseline_median_s": baseline,
                "ratio": value,
                "target": r.target,
                "verdict": verdict,
                "meaning": r.meaning,
            }
        )
    if not rows:
        return
    tr = terminalreporter
    tr.write_sep("-", "kvblocks ratios (baseline median / subject median, same run)")
    for row in rows:
        target = "" if row["target"] is None else f">= {row['target']:.2f}"
        tr.write_line(
            f"{row['group']:<18} {row['subject']:<24} vs {row['baseline']:<16} "
            f"{row['subject_median_s'] * 1e3:10.3f} ms vs {row['baseline_median_s'] * 1e3:10.3f} ms  "
            f"ratio {row['ratio']:6.2f} {target:>8} {row['verdict']}"
        )
    path = config.getoption("--kvblocks-ratios")
    if path:
        with open(path, "w") as fh:
            json.dump(rows, fh, indent=2)
