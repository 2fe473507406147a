"""``kvblocks sweep``: hit rate versus cache capacity (and eviction policy), as CSV and a plot."""

from __future__ import annotations

import argparse
import csv
import os
from pathlib import Path
from typing import Any

from kvblocks.cli.plot import _draw, _plotter, _what_ran
from kvblocks.cli.progress import _CHECKING, _Progress
from kvblocks.cli.workload import _load, _replay_options
from kvblocks.errors import ConfigError
from kvblocks.replay import MAX_BLOCKS


def _check_output(path: str, flag: str) -> None:
    """Refuse an output path that could not be written, before the run it would hold."""
    if not path.strip():
        hint = " (without --csv, the CSV goes to standard output)" if flag == "--csv" else ""
        raise ConfigError(f"{flag} {path!r}: give a file name{hint}")
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: directory {str(parent)!r} does not exist")
    writable = os.access(target, os.W_OK) if target.exists() else os.access(parent, os.W_OK | os.X_OK)
    if not writable:
        raise ConfigError(f"{flag} {path}: not writable")


def _open_csv(path: str) -> Any:
    try:
        return open(path, "w", encoding="utf-8", newline="")  # the sweep closes it
    except OSError as e:
        raise ConfigError(f"--csv {path}: cannot write it ({e.strerror})") from None


def _sweep_capacities(args: argparse.Namespace, trace: Any, options: dict[str, Any], unlimited: int) -> list[int]:
    """Block counts for --capacities (a percentage is of the unlimited capacity), each checked against the
    trace before the first replay."""
    from kvblocks.replay import min_blocks

    least = min_blocks(trace, block_size=options["block_size"], workers=args.workers, reference=args.reference)
    out = []
    for item in args.capacities:
        blocks = max(1, round(unlimited * float(item[:-1]) / 100)) if item.endswith("%") else int(item)
        if blocks > MAX_BLOCKS:
            raise ConfigError(f"--capacities {item} is {blocks:,} blocks, over the bound {MAX_BLOCKS:,}")
        if blocks < least:
            raise ConfigError(
                f"--capacities {item} is {blocks:,} blocks; {args.workers} worker(s) need at least {least:,} "
                "to hold the trace's largest request"
            )
        out.append(blocks)
    return out


def _columns(args: argparse.Namespace) -> list[str]:
    names = ["eviction"] if args.eviction is not None else []
    names += ["capacity_blocks", "share_of_unlimited", "token_hit_rate", "block_hit_rate", "evicted_blocks"]
    if args.host_blocks or args.storage_blocks:
        names.append("device_token_hit_rate")
        names += ["host_token_hit_rate"] if args.host_blocks else []
        names += ["storage_token_hit_rate"] if args.storage_blocks else []
    return names


def _row(args: argparse.Namespace, capacity: int, unlimited: int, result: Any) -> list[object]:
    row: list[object] = [result.eviction] if args.eviction is not None else []
    row += [capacity, f"{capacity / unlimited:.4f}", f"{result.token_hit_rate:.6f}"]
    row += [f"{result.block_hit_rate:.6f}", result.evicted_blocks]
    total = result.prompt_tokens or 1
    if args.host_blocks or args.storage_blocks:
        row.append(f"{result.hit_tokens_device / total:.6f}")
        row += [f"{result.hit_tokens_host / total:.6f}"] if args.host_blocks else []
        row += [f"{result.hit_tokens_storage / total:.6f}"] if args.storage_blocks else []
    return row


def _cmd_sweep(args: argparse.Namespace, out: Any) -> None:
    from kvblocks.replay import replay, unlimited_blocks

    for path, flag in ((args.csv, "--csv"), (args.plot, "--plot")):
        if path is not None:
            _check_output(path, flag)
    plot = _plotter(args.plot) if args.plot is not None else None
    trace = _load(args.trace)
    options = _replay_options(args, trace)
    sizes = {name: options[name] for name in ("block_size", "concurrency", "workers")}
    unlimited = unlimited_blocks(trace, **sizes)
    capacities = _sweep_capacities(args, trace, options, unlimited)
    handle = _open_csv(args.csv) if args.csv is not None else None
    sink = handle if handle is not None else out
    policies = args.eviction if args.eviction is not None else ["lru"]
    options.pop("eviction", None)  # one replay per policy
    runs = len(capacities) * len(policies)
    progress = _Progress(runs * len(trace), "kvblocks sweep", _CHECKING if args.check else "")
    curves: dict[str, list[tuple[int, float]]] = {}
    try:
        writer = csv.writer(sink, lineterminator="\n")
        writer.writerow(_columns(args))
        for policy in policies:
            for capacity in capacities:
                result = replay(trace, blocks=capacity, progress=progress.update, eviction=policy, **options)
                curves.setdefault(policy, []).append((capacity, result.token_hit_rate))
                progress.clear()
                writer.writerow(_row(args, capacity, unlimited, result))
                sink.flush()
    finally:
        progress.close()
        if handle is not None:
            handle.close()
    if plot is not None:
        labelled = args.eviction is not None
        points = {(policy if labelled else ""): sorted(curve) for policy, curve in curves.items()}
        _draw(plot, args.plot, _what_ran(args, trace, options), points, options, unlimited)
