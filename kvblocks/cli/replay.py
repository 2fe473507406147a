"""``kvblocks replay``: replay one trace and report hit rates, evictions and speed."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvblocks.cli.progress import _CHECKING, _Progress
from kvblocks.cli.workload import _load, _replay_options


def _percent(x: float) -> str:
    return f"{100 * x:.2f}%"


def _tiers(result: Any) -> str:
    total = result.prompt_tokens or 1
    parts = [f"device {_percent(result.hit_tokens_device / total)}"]
    if result.host_blocks:
        parts.append(f"host {_percent(result.hit_tokens_host / total)}")
    if result.storage_blocks:
        parts.append(f"storage {_percent(result.hit_tokens_storage / total)}")
    return ", ".join(parts) + " of prompt tokens"


def _host_evictions(result: Any) -> str:
    return f", {result.host_evicted_blocks:,} host blocks" if result.host_blocks else ""


def _cmd_replay(args: argparse.Namespace, out: Any) -> None:
    from kvblocks.replay import replay

    trace = _load(args.trace)
    options = _replay_options(args, trace)
    progress = _Progress(len(trace), "kvblocks replay", _CHECKING if args.check else "")
    try:
        result = replay(trace, blocks=args.blocks, progress=progress.update, **options)
    finally:
        progress.close()
    if args.json:
        out.write(json.dumps(result.as_dict(), indent=2) + "\n")
        return
    out.write(_report(args, trace, result))


def _check_line(result: Any) -> str:
    if result.check_seconds is None:
        return "not run (--check runs check_integrity on every manager)"
    return f"check_integrity passed on every manager ({result.check_seconds:.2f} s)"


def _report(args: argparse.Namespace, trace: Any, result: Any) -> str:
    kind = "hash ids" if trace.kind == "hash_ids" else "token ids"
    capacity = "unlimited: nothing is evicted" if args.blocks is None else f"{args.blocks:,} blocks"
    lines = [
        ("trace", f"{trace.name}: {len(trace):,} requests ({kind}, {result.block_size}-token blocks)"),
        ("capacity", f"{capacity} ({result.capacity_blocks:,} blocks over {result.workers} worker(s))"),
        ("prompt tokens", f"{result.prompt_tokens:,}"),
        ("hit rate", f"{_percent(result.token_hit_rate)} of tokens, {_percent(result.block_hit_rate)} of blocks"),
        ("by tier", _tiers(result)),
        ("evictions", f"{result.evicted_blocks:,} device blocks" + _host_evictions(result)),
        (
            "peak usage",
            f"{result.peak_blocks_in_use:,} blocks ({_percent(result.peak_blocks_in_use / result.capacity_blocks)})",
        ),
        ("replay speed", f"{result.requests_per_second:,.0f} requests/s ({result.seconds:.2f} s)"),
        ("setup", f"{result.setup_seconds:.2f} s creating {result.capacity_blocks:,} blocks before the first request"),
        ("check", _check_line(result)),
    ]
    if result.load_balance is not None:
        lines.append(("load balance", f"max/min prefill tokens per worker {result.load_balance:.2f}"))
    if args.eviction is not None:
        lines.append(("eviction", f"{result.eviction} (every tier)"))
    if args.reference:
        lines.append(("counting", "every hash id as a full block (Mooncake's published definition)"))
    width = max(len(k) for k, _ in lines)
    return "".join(f"{k:<{width}}  {v}\n" for k, v in lines)
