"""The ``kvblocks`` command: replay a trace, sweep cache capacities, plan KV memory.

    kvblocks replay [TRACE] [--blocks N] [--workers N] [--concurrency N] [--reference] [--json]
    kvblocks sweep TRACE --capacities 1000,5000,10%,50% [--csv PATH] [--plot PATH]
    kvblocks plan (--model NAME | --layers L --kv-heads H --head-dim D) --dtype T --block-size B --memory 40GiB

TRACE is a Mooncake or token-id JSONL file (``.gz`` too) or a bundled trace name
(``mooncake-conversation``, ``mooncake-synthetic``); without one, ``replay`` runs a built-in
synthetic multi-turn chat workload. Errors go to stderr with exit status 2, and nothing is
printed as a result before the whole trace has been read and checked.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import io
import json
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvblocks.errors import KVBlocksError

__all__ = ["MODEL_PRESETS", "main"]

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128},
    "llama-3-70b": {"num_layers": 80, "num_kv_heads": 8, "head_dim": 128},
    "mistral-7b": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128},
    "qwen2.5-7b": {"num_layers": 28, "num_kv_heads": 4, "head_dim": 128},
    "qwen2.5-72b": {"num_layers": 80, "num_kv_heads": 8, "head_dim": 128},
    "deepseek-v3": {"mla": {"num_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64}},
}
"""Published model shapes (KV heads after GQA; DeepSeek-V3 caches one MLA latent per token)."""

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20}
_UNITS.update({"gib": 2**30, "tib": 2**40})


def _memory(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size (e.g. 40GiB, 512MiB, 8e9 is not accepted)")
    return int(float(match.group(1)) * _UNITS[unit])


def _capacities(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    for item in items:
        if not re.fullmatch(r"[0-9]+(\.[0-9]+)?%|[0-9]+", item):
            raise argparse.ArgumentTypeError(f"{item!r} is neither a block count nor a percentage like 25%")
    if not items:
        raise argparse.ArgumentTypeError("give at least one capacity")
    return items


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvblocks", description="KV-cache replay, capacity sweeps and planning.")
    commands = parser.add_subparsers(dest="command", required=True)

    def trace_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--block-size", type=int, default=16, help="tokens per block for token-id traces (16)")
        p.add_argument("--concurrency", type=int, default=1, help="requests running at once per worker (1)")
        p.add_argument("--workers", type=int, default=1, help="route over N workers, each with blocks/N (1)")
        p.add_argument("--host-blocks", type=int, default=0, help="a host tier of N blocks (split over workers)")
        p.add_argument("--storage-blocks", type=int, default=0, help="a shared storage tier of N entries")
        p.add_argument(
            "--reference",
            action="store_true",
            help="count every hash id as a full block, as Mooncake's published hit rates do",
        )

    replay = commands.add_parser("replay", help="replay a trace and report hit rates, evictions and speed")
    replay.add_argument("trace", nargs="?", help="trace file or bundled name; default: a built-in chat workload")
    replay.add_argument("--blocks", type=int, default=None, help="total cache capacity in blocks (default: unlimited)")
    trace_options(replay)
    replay.add_argument("--json", action="store_true", help="print the result as JSON")

    sweep = commands.add_parser("sweep", help="hit rate versus cache capacity, as CSV (and a PNG plot)")
    sweep.add_argument("trace", help="trace file or bundled name")
    sweep.add_argument("--capacities", type=_capacities, required=True, help="blocks or % of the working set")
    trace_options(sweep)
    sweep.add_argument("--csv", help="write the CSV here instead of standard output")
    sweep.add_argument("--plot", help="also draw the curve into this PNG (needs the 'plot' extra: matplotlib)")

    plan = commands.add_parser("plan", help="bytes per block and the blocks/tokens a memory budget holds")
    plan.add_argument("--model", choices=sorted(MODEL_PRESETS), help="a preset model shape")
    plan.add_argument("--layers", type=int)
    plan.add_argument("--kv-heads", type=int)
    plan.add_argument("--head-dim", type=int)
    plan.add_argument("--dtype", default="bfloat16")
    plan.add_argument("--block-size", type=int, default=16)
    plan.add_argument("--memory", type=_memory, required=True, help="KV memory budget, e.g. 40GiB")
    plan.add_argument("--json", action="store_true")
    return parser


def _load(name: str | None) -> Any:
    from kvblocks.traces import load_trace, synthetic_chat

    return synthetic_chat() if name is None else load_trace(name)


def _progress(total: int) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    """A tqdm bar on stderr that appears only if the run takes more than a second or two."""
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:
        return None, lambda: None
    bar = tqdm(total=total, unit="req", delay=1.5, file=sys.stderr, disable=not sys.stderr.isatty(), leave=False)
    return bar.update, bar.close


def _replay_options(args: argparse.Namespace) -> dict[str, Any]:
    """The replay settings shared by ``replay`` and ``sweep``."""
    names = ("block_size", "concurrency", "workers", "reference", "host_blocks", "storage_blocks")
    return {name: getattr(args, name) for name in names}


def _replay(args: argparse.Namespace) -> Any:
    from kvblocks.replay import replay

    trace = _load(args.trace)
    update, close = _progress(len(trace))
    try:
        return trace, replay(trace, blocks=args.blocks, progress=update, **_replay_options(args))
    finally:
        close()


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


def _cmd_replay(args: argparse.Namespace, out: io.TextIOBase) -> None:
    trace, result = _replay(args)
    if args.json:
        out.write(json.dumps(result.as_dict(), indent=2) + "\n")
        return
    kind = "hash ids" if trace.kind == "hash_ids" else "token ids"
    capacity = "unlimited" if args.blocks is None else f"{args.blocks:,} blocks"
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
    ]
    if result.load_balance is not None:
        lines.append(("load balance", f"max/min prefill tokens per worker {result.load_balance:.2f}"))
    if args.reference:
        lines.append(("counting", "every hash id as a full block (Mooncake's published definition)"))
    width = max(len(k) for k, _ in lines)
    out.write("".join(f"{k:<{width}}  {v}\n" for k, v in lines))


def _cmd_sweep(args: argparse.Namespace, out: io.TextIOBase) -> None:
    from kvblocks.replay import replay, working_set_blocks

    trace = _load(args.trace)
    working_set = working_set_blocks(trace, args.block_size)
    capacities = [
        max(1, round(working_set * float(c[:-1]) / 100)) if c.endswith("%") else int(c) for c in args.capacities
    ]
    plot: Any = None
    if args.plot:
        try:
            importlib.import_module("matplotlib").use("Agg")
            plot = importlib.import_module("matplotlib.pyplot")
        except ImportError:
            raise KVBlocksError('--plot needs matplotlib: pip install "kvblocks[plot]"') from None
    rows = []
    for capacity in capacities:
        result = replay(trace, blocks=capacity, **_replay_options(args))
        rows.append(
            (capacity, capacity / working_set, result.token_hit_rate, result.block_hit_rate, result.evicted_blocks)
        )
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["capacity_blocks", "share_of_working_set", "token_hit_rate", "block_hit_rate", "evicted_blocks"])
    for capacity, share, tokens, blocks, evicted in rows:
        writer.writerow([capacity, f"{share:.4f}", f"{tokens:.6f}", f"{blocks:.6f}", evicted])
    if args.csv:
        with open(args.csv, "w", encoding="utf-8") as handle:
            handle.write(text.getvalue())
    else:
        out.write(text.getvalue())
    if plot is not None:
        figure, axes = plot.subplots(figsize=(6, 4))
        axes.plot([r[0] for r in rows], [100 * r[2] for r in rows], marker="o")
        axes.set_xlabel("cache capacity (blocks)")
        axes.set_ylabel("prefix hit rate (% of prompt tokens)")
        axes.set_title(trace.name)
        axes.grid(True, alpha=0.3)
        figure.tight_layout()
        figure.savefig(args.plot, dpi=120)
        plot.close(figure)


def _cmd_plan(args: argparse.Namespace, out: io.TextIOBase) -> None:
    from kvblocks.backends.spec import KVCacheSpec

    if args.model:
        preset = MODEL_PRESETS[args.model]
        if "mla" in preset:
            spec = KVCacheSpec.mla(**preset["mla"], dtype=args.dtype, block_size=args.block_size)
        else:
            spec = KVCacheSpec(**preset, dtype=args.dtype, block_size=args.block_size)
    else:
        missing = [f"--{n}" for n in ("layers", "kv-heads", "head-dim") if getattr(args, n.replace("-", "_")) is None]
        if missing:
            raise KVBlocksError(
                f"give --model or all of --layers, --kv-heads, --head-dim (missing {', '.join(missing)})"
            )
        spec = KVCacheSpec(
            num_layers=args.layers,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            dtype=args.dtype,
            block_size=args.block_size,
        )
    blocks = spec.num_blocks_for(args.memory)
    plan = {
        "model": args.model,
        "bytes_per_block": spec.bytes_per_block,
        "bytes_per_token": spec.bytes_per_block // spec.block_size,
        "memory_bytes": args.memory,
        "blocks": blocks,
        "tokens": blocks * spec.block_size,
    }
    if args.json:
        out.write(json.dumps(plan, indent=2) + "\n")
        return
    out.write(
        f"bytes per block  {spec.bytes_per_block:,} ({spec.block_size} tokens, "
        f"{spec.bytes_per_block // spec.block_size:,} bytes per token)\n"
        f"memory           {args.memory:,} bytes\n"
        f"blocks           {blocks:,}\n"
        f"tokens           {blocks * spec.block_size:,}\n"
    )


def main(argv: Sequence[str] | None = None, out: io.TextIOBase | None = None) -> int:
    """Run the command; returns the exit status (0, or 2 for a usage or input error)."""
    args = _parser().parse_args(argv)
    stream: Any = out if out is not None else sys.stdout
    commands = {"replay": _cmd_replay, "sweep": _cmd_sweep, "plan": _cmd_plan}
    try:
        commands[args.command](args, stream)
    except KVBlocksError as error:
        print(f"kvblocks {args.command}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
