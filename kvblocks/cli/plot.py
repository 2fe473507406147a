"""The plot ``sweep --plot`` draws: matplotlib (the extra kvblocks[plot]) on its file-only backend."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

from kvblocks.errors import ConfigError, MissingExtraError

_PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def _plotter(path: str) -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or a clear error naming the extra."""
    if Path(path).suffix.lower() not in _PLOT_SUFFIXES:
        raise ConfigError(f"--plot {path}: give a file ending in {', '.join(_PLOT_SUFFIXES)}")
    try:
        importlib.import_module("matplotlib").use("Agg")
        return importlib.import_module("matplotlib.pyplot")
    except ImportError:
        raise MissingExtraError("--plot needs matplotlib", "plot") from None


def _what_ran(args: argparse.Namespace, trace: Any, options: dict[str, Any]) -> str:
    """One line naming the trace and every setting that changes the curve."""
    parts = [f"{options['workers']} worker{'s' if options['workers'] != 1 else ''}"]
    parts.append(f"concurrency {options['concurrency']}")
    if options["host_blocks"]:
        parts.append(f"host tier {options['host_blocks']:,} blocks")
    if options["storage_blocks"]:
        parts.append(f"storage tier {options['storage_blocks']:,} entries")
    if options["reference"]:
        parts.append("every hash id a full block")
    return f"{trace.name}: {', '.join(parts)}"


def _draw(
    plot: Any,
    path: str,
    title: str,
    curves: dict[str, list[tuple[int, float]]],
    options: dict[str, Any],
    unlimited: int,
) -> None:
    """One curve per eviction policy (labelled unless its name is ""), in capacity order, hit rate from 0, ticks
    chosen by matplotlib (they never overprint) with the share of the unlimited capacity on the top axis."""
    ticker = importlib.import_module("matplotlib.ticker")
    figure, axes = plot.subplots(figsize=(7, 4.5), layout="constrained")
    for label, points in curves.items():
        axes.plot([c for c, _ in points], [100 * r for _, r in points], marker="o", label=label or None)
    if any(curves):
        axes.legend(title="eviction")
    best = max(r for points in curves.values() for _, r in points)
    axes.set_xlim(left=0)
    axes.set_ylim(bottom=0, top=max(1.0, min(100.0, 1.15 * 100 * best)))
    axes.xaxis.set_major_locator(ticker.MaxNLocator(nbins=6, integer=True))
    axes.xaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:,.0f}"))
    axes.yaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:.0f}%"))
    axes.set_xlabel(f"capacity (blocks of {options['block_size']} tokens, all workers together)")
    axes.set_ylabel("prefix hit rate (% of prompt tokens)")
    top = axes.secondary_xaxis("top", functions=(lambda c: 100 * c / unlimited, lambda p: p * unlimited / 100))
    top.xaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:.0f}%"))
    top.set_xlabel(f"share of the unlimited capacity ({unlimited:,} blocks: nothing evicted)")
    figure.suptitle(title, fontsize=11, fontweight="bold")
    axes.grid(True, alpha=0.3)
    figure.savefig(path, dpi=120)
    plot.close(figure)
