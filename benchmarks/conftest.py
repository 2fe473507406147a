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

from tests.conftest import redis_url  # noqa: F401  - a real Redis for the storage benchmarks


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
    Ratio("lifecycle-tiers", "host tier", "device only", None, "host tier doing its write-backs and swap-ins"),
    Ratio("tier-layer", "tiered, no tiers", "device only", 0.8, "cost of the tier layer when nothing is below"),
    Ratio("handoff-2k", "accept handoff", "mixed admission", 0.5, "from bytes + accept + receive vs admit + commit"),
    *(
        Ratio(f"route-2k-{n}", "route", "hash only", 0.5, "route (hash + score) vs hashing alone (0.5 = 2x)")
        for n in (8, 64)
    ),
    Ratio("fleet-apply", "kvblocks", "dict floor", None, "events into the index vs a bare dict of worker masks"),
    Ratio("fleet-route-2k", "route", "hash only", None, "scoring a 2k prompt at 1k workers vs hashing it"),
    Ratio("fleet-route-32k", "route 32k", "route 2k head", None, "16x the run; the hash check is linear (in C)"),
    Ratio("fleet-walk-32k", "overlaps 32k", "overlaps 2k head", 0.5, "sublinear walk: 16x the run, <= 2x the time"),
    Ratio("overlaps-idle", "1,000 workers", "8 workers", 0.8, "overlaps: 992 idle workers beside the 8 holders"),
    Ratio("dynamo-route-32k", "kvblocks route", "Dynamo find_matches", 1.0, "fully cached 32k, 512 workers"),
    Ratio("dynamo-route-2k", "kvblocks route", "Dynamo find_matches", None, "typical 2k prompts, 512 workers"),
    Ratio("dynamo-apply", "kvblocks apply_events", "Dynamo apply_event", None, "same events (Dynamo's as JSON)"),
    Ratio("lookup-2k", "kvblocks", "floor", None, "one lookup, 128 cached blocks"),
    Ratio("admit-free-2k", "kvblocks", "floor", None, "admission with 128 hits + free"),
    Ratio("decode-step", "kvblocks", "floor", None, "append + allocate + commit of one token"),
    *(
        Ratio(f"cpu-move-{shape}", op, "contiguous copy", 0.7, "share of one contiguous copy's bandwidth")
        for shape in ("2MiB", "128KiB", "64KiB")
        for op in ("gather", "scatter")
    ),
    *(
        Ratio(f"cpu-move-{shape}", "transfer block-major", "contiguous copy", 0.7, "cache to cache, scattered ids")
        for shape in ("2MiB", "64KiB")
    ),
    *(
        Ratio(f"cpu-move-{shape}", "transfer layer-major", "contiguous copy", None, "cache to cache, scattered ids")
        for shape in ("2MiB", "64KiB")
    ),
    *(
        Ratio(f"file-{op}-{size}", "FileStorage", "raw files", 0.7, "share of plain file I/O throughput")
        for op in ("put", "get")
        for size in ("2MiB-block", "256KiB-layer-group")
    ),
    *(
        Ratio(f"redis-{op}-{size}", "RedisStorage", "raw pipeline", 0.8, "share of a bare redis-py pipeline")
        for op in ("put", "get")
        for size in ("2MiB-block", "256KiB-layer-group")
    ),
    Ratio("cuda-host-2MiB", "to device", "contiguous to device", 0.8, "share of one contiguous pinned copy"),
    Ratio("cuda-host-2MiB", "to host", "contiguous to host", 0.8, "share of one contiguous pinned copy"),
    Ratio("cuda-device-2MiB", "copy_blocks", "contiguous copy", 0.7, "share of one contiguous device copy"),
]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--kvblocks-ratios", default=None, help="write the benchmark ratios as JSON to this path")


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:9.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:9.3f} us"


def _finished(config: pytest.Config) -> list:
    session = getattr(config, "_benchmarksession", None)
    return [b for b in getattr(session, "benchmarks", []) or [] if b and b.extra_info.get("subject")]


def _medians(config: pytest.Config) -> dict[tuple[str, str], float]:
    return {(b.group, b.extra_info["subject"]): b.stats.median for b in _finished(config)}


def _throughput_lines(config: pytest.Config) -> list[str]:
    """Requests/s and microseconds per block for the lifecycle benchmarks (medians)."""
    lines = []
    for bench in _finished(config):
        info = bench.extra_info
        if "requests" in info and "blocks" in info:
            median = bench.stats.median
            lines.append(
                f"{bench.group:<18} {info['subject']:<10} {info['requests'] / median:10.0f} requests/s "
                f"{median / info['blocks'] * 1e6:8.3f} us/block  "
                f"({info['requests']} requests, {info['blocks']} blocks, "
                f"pool {info['pool_blocks']} of a {info['working_set_blocks']}-block working set)"
            )
    return lines


def _bandwidth_lines(config: pytest.Config) -> list[str]:
    """MB/s (and entries/s where counted) for benchmarks that record the bytes they move."""
    lines = []
    for bench in _finished(config):
        info = bench.extra_info
        if "bytes" in info:
            median = bench.stats.median
            line = f"{bench.group:<28} {info['subject']:<22} {info['bytes'] / median / 1e6:10.0f} MB/s"
            if "entries" in info:
                line += f" {info['entries'] / median:10.0f} entries/s"
            lines.append(line)
    return lines


def _paired_rows(config: pytest.Config) -> list[dict]:
    """Ratios a benchmark measured itself, round by round against its baseline (``paired_ratio``)."""
    rows = []
    for bench in _finished(config):
        info = bench.extra_info
        if "paired_ratio" in info:
            target = info.get("target")
            rows.append(
                {
                    "group": bench.group,
                    "subject": info["subject"],
                    "baseline": info.get("baseline", "baseline") + ", paired",
                    "subject_median_s": None,
                    "baseline_median_s": None,
                    "ratio": info["paired_ratio"],
                    "target": target,
                    "verdict": "-" if target is None else ("met" if info["paired_ratio"] >= target else "MISSED"),
                    "meaning": "median over rounds of (baseline time / subject time)",
                }
            )
    return rows


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
    rows += _paired_rows(config)
    if not rows:
        return
    tr = terminalreporter
    tr.write_sep("-", "kvblocks ratios (baseline median / subject median, same run)")
    for row in rows:
        target = "" if row["target"] is None else f">= {row['target']:.2f}"
        if row["subject_median_s"] is None:  # paired: no medians to show
            times = f"{'paired rounds':>29}"
        else:
            times = f"{_duration(row['subject_median_s'])} vs {_duration(row['baseline_median_s'])}"
        tr.write_line(
            f"{row['group']:<18} {row['subject']:<24} vs {row['baseline']:<16} "
            f"{times}  ratio {row['ratio']:6.2f} {target:>8} {row['verdict']}"
        )
    throughput = _throughput_lines(config) + _bandwidth_lines(config)
    if throughput:
        tr.write_sep("-", "kvblocks throughput (medians)")
        for line in throughput:
            tr.write_line(line)
    path = config.getoption("--kvblocks-ratios")
    if path:
        with open(path, "w") as fh:
            json.dump(rows, fh, indent=2)
