"""The ``kvblocks`` command: replay a trace, sweep cache capacities, plan KV memory.

    kvblocks replay [TRACE] [--blocks N] [--workers N] [--concurrency N] [--reference] [--check] [--json]
    kvblocks sweep TRACE --capacities 1000,5000,10%,50% [--eviction lru,s3fifo:0.75] [--csv PATH] [--plot PATH]
    kvblocks plan (--model NAME | --layers L --kv-heads H --head-dim D) --dtype T --block-size B --memory 40GiB
    kvblocks plan --model gemma-3-27b --memory 40G [--context 32768]   (a hybrid preset: memory per group)

TRACE is a Mooncake or token-id JSONL file (``.gz`` too) or a bundled trace name
(``mooncake-conversation``, ``mooncake-synthetic``); without one, ``replay`` runs a built-in
synthetic multi-turn chat workload.

Every bad input ends the command with exit status 2 and one line on stderr
(``kvblocks <command>: error: ...``), nothing on stdout. Values, output paths and the whole
trace are checked before any replay starts, so no work is thrown away for a typo. Ctrl-C ends it
with exit status 130 and one line.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib
import io
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any, NoReturn

from kvblocks.errors import ConfigError, KVBlocksError, MissingExtraError
from kvblocks.replay import LIMITS, MAX_BLOCKS

__all__ = ["DTYPE_ALIASES", "MODEL_PRESETS", "main"]

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128},
    "llama-3-70b": {"num_layers": 80, "num_kv_heads": 8, "head_dim": 128},
    "mistral-7b": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128},
    "qwen2.5-7b": {"num_layers": 28, "num_kv_heads": 4, "head_dim": 128},
    "qwen2.5-72b": {"num_layers": 80, "num_kv_heads": 8, "head_dim": 128},
    "deepseek-v3": {"mla": {"num_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64}},
}
"""Published model shapes (KV heads after GQA; DeepSeek-V3 caches one MLA latent per token)."""

DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "e5m2": "float8_e5m2",
}
"""Short dtype names and the spec's canonical (torch) names they stand for; fp8 is e4m3 as in vLLM."""

MAX_MEMORY = 1 << 60
"""The largest ``plan --memory`` (1 EiB)."""

PLAN_LIMITS = {"layers": 1024, "kv_heads": 1024, "head_dim": 1 << 16, "block_size": 1 << 16, "context": 1 << 27}
"""Upper bounds of ``plan``'s shape flags and ``--context`` (each at least 1)."""

DEFAULT_CONTEXT = 32768
"""Tokens per running sequence a hybrid plan is sized for when ``--context`` is not given."""

# Single letters and the "i" forms are binary (as docker, the JVM and free(1) read them); "B" forms are decimal.
_UNITS = {"": 1, "b": 1}
for _power, _letter in enumerate("kmgtpe", 1):
    _UNITS.update({_letter: 1 << 10 * _power, _letter + "i": 1 << 10 * _power, _letter + "ib": 1 << 10 * _power})
    _UNITS[_letter + "b"] = 10 ** (3 * _power)

_PLOT_SUFFIXES = (".png", ".svg", ".pdf")
_CHECKING = "checking integrity"
_MAX_PERCENT = 10_000


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``kvblocks <cmd>: error: ...``) rather than usage + error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_one_line(message)}\n")


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(text: str) -> str:
    return _one_line(repr(text), 40)


def _int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an int in ``[low, high]``, with a message that says which side it missed."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_short(text)} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:,}, got {_one_line(text, 40)}")
        return value

    return parse


def _setting(name: str) -> Callable[[str], int]:
    return _int_in(*LIMITS[name])


def _memory(text: str) -> int:
    """A byte count such as 40G, 40GiB (binary) or 40GB (decimal); fractions allowed (1.5T)."""
    match = re.fullmatch(r"\s*([-+]?)\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(3).lower() if match else ""
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{_short(text)} is not a memory size (e.g. 40G, 40GiB, 512MiB, 40GB)")
    if match.group(1) == "-":
        raise argparse.ArgumentTypeError(f"must be > 0 bytes, got {_short(text)}")
    try:
        size = int(Fraction(match.group(2)) * _UNITS[unit])
    except ValueError:  # more digits than Python converts
        raise argparse.ArgumentTypeError(f"{_short(text)} is too large (at most 1EiB)") from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be > 0 bytes, got {_short(text)}")
    if size > MAX_MEMORY:
        raise argparse.ArgumentTypeError(f"must be <= 1EiB, got {_short(text)}")
    return size


def _dtype(text: str) -> str:
    from kvblocks.backends.spec import DTYPE_SIZES

    name = DTYPE_ALIASES.get(text.lower(), text.removeprefix("torch."))
    if name not in DTYPE_SIZES:
        known = ", ".join([*DTYPE_SIZES, *DTYPE_ALIASES])
        raise argparse.ArgumentTypeError(f"{_short(text)} is not a KV cache dtype; known: {known}")
    return name


def _capacities(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    for item in items:
        if re.fullmatch(r"[0-9]{1,6}(\.[0-9]{1,6})?%", item):
            if not 0 < float(item[:-1]) <= _MAX_PERCENT:
                raise argparse.ArgumentTypeError(f"{item!r}: a percentage must be > 0% and <= {_MAX_PERCENT}%")
        elif re.fullmatch(r"[0-9]+", item):
            _setting("blocks")(item)
        else:
            raise argparse.ArgumentTypeError(f"{_short(item)} is neither a block count nor a percentage like 25%")
    if not items:
        raise argparse.ArgumentTypeError("give at least one capacity")
    return items


def _evictions(text: str) -> list[str]:
    from kvblocks.eviction import check_eviction

    names = [t.strip() for t in text.split(",") if t.strip()]
    for name in names:
        try:
            check_eviction(name)
        except ConfigError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    if not names:
        raise argparse.ArgumentTypeError("give at least one eviction policy")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{_short(text)} names a policy twice")
    return names


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvblocks")
    except PackageNotFoundError:  # run from a source tree
        import kvblocks

        return str(getattr(kvblocks, "__version__", "unknown"))


def _trace_options(p: argparse.ArgumentParser) -> None:
    top = LIMITS
    p.add_argument(
        "--block-size",
        type=_setting("block_size"),
        default=None,
        help=f"tokens per block for token-id traces (default 16, at most {top['block_size'][1]:,}); "
        "a Mooncake trace fixes its own (512): another value there is an error",
    )
    p.add_argument(
        "--concurrency",
        type=_setting("concurrency"),
        default=1,
        help=f"requests running at once per worker (default 1, at most {top['concurrency'][1]:,})",
    )
    p.add_argument(
        "--workers",
        type=_setting("workers"),
        default=1,
        help=f"route over N workers, each with blocks/N (default 1, at most {top['workers'][1]:,})",
    )
    p.add_argument(
        "--host-blocks",
        type=_setting("host_blocks"),
        default=0,
        help=f"a host tier of N blocks, split over the workers (default 0: none; at most {MAX_BLOCKS:,})",
    )
    p.add_argument(
        "--storage-blocks",
        type=_setting("storage_blocks"),
        default=0,
        help="a storage tier of N entries shared by the workers "
        f"(default 0: none; at most {top['storage_blocks'][1]:,})",
    )
    p.add_argument(
        "--eviction",
        type=_evictions,
        default=None,
        metavar="NAME[,NAME...]",
        help="eviction policy of every tier: lru (default), s3fifo, or s3fifo:SHARE (its small queue's share of "
        "the idle blocks, default 0.1); sweep takes a comma-separated list and adds an eviction column, one curve "
        "per policy",
    )
    p.add_argument(
        "--reference",
        action="store_true",
        help="count every hash id as a full block, as Mooncake's published hit rates do (Mooncake traces only)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="after each replay, check every manager's invariants (check_integrity) and report the time it took; "
        "on millions of blocks it takes longer than the replay",
    )


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvblocks",
        description="KV-cache replay, capacity sweeps and planning. Errors: exit status 2, one line on stderr.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    replay = commands.add_parser("replay", help="replay a trace and report hit rates, evictions and speed")
    replay.add_argument("trace", nargs="?", help="trace file or bundled name; default: a built-in chat workload")
    replay.add_argument(
        "--blocks",
        type=_setting("blocks"),
        default=None,
        help=f"total cache capacity in blocks, 1 to {MAX_BLOCKS:,} (default: unlimited, room for the whole trace "
        "on every worker: nothing is evicted)",
    )
    _trace_options(replay)
    replay.add_argument("--json", action="store_true", help="print the result as one JSON object")

    sweep = commands.add_parser("sweep", help="hit rate versus cache capacity, as CSV (and a plot)")
    sweep.add_argument("trace", help="trace file or bundled name")
    sweep.add_argument(
        "--capacities",
        type=_capacities,
        required=True,
        help=f"comma-separated capacities: block counts (1 to {MAX_BLOCKS:,}) or percentages of the unlimited "
        "capacity such as 25%% (100%% is replay's default: nothing is evicted)",
    )
    _trace_options(sweep)
    sweep.add_argument("--csv", metavar="PATH", help="write the CSV to PATH instead of standard output")
    sweep.add_argument(
        "--plot",
        metavar="PATH",
        help="also draw the curve into PATH (.png, .svg or .pdf; needs the extra kvblocks[plot], matplotlib)",
    )

    from kvblocks.hybrid.presets import HYBRID_PRESETS

    plan = commands.add_parser("plan", help="bytes per block and the blocks/tokens a memory budget holds")
    plan.add_argument(
        "--model",
        choices=sorted([*MODEL_PRESETS, *HYBRID_PRESETS]),
        help="a preset model shape (excludes the shape flags); hybrid presets "
        f"({', '.join(HYBRID_PRESETS)}) report memory per group of layers",
    )
    limits = PLAN_LIMITS
    plan.add_argument(
        "--layers", type=_int_in(1, limits["layers"]), help=f"number of layers (1 to {limits['layers']:,})"
    )
    plan.add_argument(
        "--kv-heads",
        type=_int_in(1, limits["kv_heads"]),
        help=f"KV heads per layer after GQA (1 to {limits['kv_heads']:,})",
    )
    plan.add_argument(
        "--head-dim", type=_int_in(1, limits["head_dim"]), help=f"size of one head (1 to {limits['head_dim']:,})"
    )
    plan.add_argument(
        "--dtype",
        type=_dtype,
        default="bfloat16",
        help="KV cache element type (default bfloat16): float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, "
        "int8, uint8, or bf16, fp16, fp32, fp8 (= float8_e4m3fn), fp8_e5m2",
    )
    plan.add_argument(
        "--block-size",
        type=_int_in(1, limits["block_size"]),
        default=16,
        help=f"tokens per block (default 16; 1 to {limits['block_size']:,}, as KVCacheManager takes)",
    )
    plan.add_argument(
        "--memory",
        type=_memory,
        required=True,
        help="KV memory budget, at least one block and at most 1EiB: 40G, 40GiB or 40Gi are binary (2**30), 40GB is "
        "decimal (10**9); also K/M/T/P/E",
    )
    plan.add_argument(
        "--context",
        type=_int_in(1, limits["context"]),
        default=None,
        help=f"tokens per running sequence the memory split of a hybrid preset is sized for (default "
        f"{DEFAULT_CONTEXT:,}; 1 to {limits['context']:,}); hybrid presets only",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    return parser


# ------------------------------------------------------------------ checks before any work


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


def _plotter(path: str) -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or a clear error naming the extra."""
    if Path(path).suffix.lower() not in _PLOT_SUFFIXES:
        raise ConfigError(f"--plot {path}: give a file ending in {', '.join(_PLOT_SUFFIXES)}")
    try:
        importlib.import_module("matplotlib").use("Agg")
        return importlib.import_module("matplotlib.pyplot")
    except ImportError:
        raise MissingExtraError("--plot needs matplotlib", "plot") from None


def _load(name: str | None) -> Any:
    from kvblocks.traces import load_trace, synthetic_chat

    return synthetic_chat() if name is None else load_trace(name)


def _block_size(args: argparse.Namespace, trace: Any) -> int:
    """The block size to replay with: a Mooncake trace's own (its hashes fix it), else --block-size or 16."""
    own = trace.block_tokens
    if own is not None and args.block_size is not None and args.block_size != own:
        raise ConfigError(
            f"--block-size {args.block_size}: the trace's hash ids are {own}-token blocks; drop --block-size"
        )
    return int(own or args.block_size or 16)


def _replay_options(args: argparse.Namespace, trace: Any) -> dict[str, Any]:
    """The replay settings shared by ``replay`` and ``sweep``, checked against the trace."""
    if args.reference and trace.kind != "hash_ids":
        raise ConfigError("--reference applies to hash-id traces (the published Mooncake figures)")
    names = ("concurrency", "workers", "reference", "host_blocks", "storage_blocks", "check")
    options = {name: getattr(args, name) for name in names}
    options["block_size"] = _block_size(args, trace)
    if args.eviction is not None:
        if args.command == "replay" and len(args.eviction) != 1:
            raise ConfigError(f"--eviction {','.join(args.eviction)}: replay runs one policy; sweep compares several")
        options["eviction"] = args.eviction[0]
    return options


# ------------------------------------------------------------------ progress


class _Progress:
    """Progress on stderr, only when stderr is a terminal: a tqdm bar if tqdm is installed (shown after
    1.5 s), else a plain line redrawn a few times a second. Closing it clears it."""

    def __init__(self, total: int, label: str, then: str = "") -> None:
        self._stream = sys.stderr
        self._total, self._label, self._done, self._then = total, label, 0, then
        self._bar: Any = None
        self._shown, self._last = False, -1.0
        self.enabled = bool(getattr(self._stream, "isatty", lambda: False)())
        if self.enabled:
            try:
                from tqdm import tqdm  # type: ignore[import-untyped]
            except ImportError:
                return
            self._bar = tqdm(total=total, unit="req", desc=label, delay=1.5, file=self._stream, leave=False)

    def update(self, n: int = 1) -> None:
        self._done += n
        last = self._done == self._total
        then = f"; {self._then}" if last and self._then else ""
        if self._bar is not None:
            self._bar.update(n)
            if then:
                self._bar.set_postfix_str(self._then)
        elif self.enabled and (time.monotonic() - self._last >= 0.25 or last):
            self._last = time.monotonic()
            self._stream.write(f"\r{self._label}: {self._done:,}/{self._total:,} requests{then}")
            self._stream.flush()
            self._shown = True

    def clear(self) -> None:
        """Take the line off the terminal (before a result row is printed beside it)."""
        if self._bar is not None:
            self._bar.clear()
        elif self._shown:
            self._stream.write("\r\x1b[K")
            self._stream.flush()
            self._shown, self._last = False, -1.0

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            self.clear()


# ------------------------------------------------------------------ replay


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


# ------------------------------------------------------------------ sweep


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


# ------------------------------------------------------------------ plan


_SHAPE_FLAGS = ("layers", "kv_heads", "head_dim")


def _spec(args: argparse.Namespace) -> Any:
    from kvblocks.backends.spec import KVCacheSpec

    given = [f"--{n.replace('_', '-')}" for n in _SHAPE_FLAGS if getattr(args, n) is not None]
    if args.model:
        if given:
            raise ConfigError(f"--model {args.model} sets the shape: drop {', '.join(given)} (or --model)")
        preset = MODEL_PRESETS[args.model]
        if "mla" in preset:
            return KVCacheSpec.mla(**preset["mla"], dtype=args.dtype, block_size=args.block_size)
        return KVCacheSpec(**preset, dtype=args.dtype, block_size=args.block_size)
    missing = [f"--{n.replace('_', '-')}" for n in _SHAPE_FLAGS if getattr(args, n) is None]
    if missing:
        raise ConfigError(f"give --model or all of --layers, --kv-heads, --head-dim (missing {', '.join(missing)})")
    return KVCacheSpec(
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        block_size=args.block_size,
    )


def _cmd_plan(args: argparse.Namespace, out: Any) -> None:
    from kvblocks.hybrid.presets import HYBRID_PRESETS

    if args.model in HYBRID_PRESETS:
        _cmd_plan_hybrid(args, out)
        return
    if args.context is not None:
        raise ConfigError(f"--context sizes the per-group split of a hybrid preset ({', '.join(HYBRID_PRESETS)})")
    spec = _spec(args)
    blocks = spec.num_blocks_for(args.memory)
    if blocks == 0:
        raise ConfigError(f"--memory {_bytes(args.memory)} is smaller than one block ({_bytes(spec.bytes_per_block)})")
    plan = {
        "model": args.model,
        "dtype": spec.dtype,
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
        f"bytes per block  {spec.bytes_per_block:,} ({spec.block_size} tokens of {spec.dtype}, "
        f"{spec.bytes_per_block // spec.block_size:,} bytes per token)\n"
        f"memory           {args.memory:,} bytes\n"
        f"blocks           {blocks:,}\n"
        f"tokens           {blocks * spec.block_size:,}\n"
    )


def _bytes(count: int) -> str:
    return f"{count:,} byte{'s' if count != 1 else ''}"


def _group_json(plan: Any) -> dict[str, Any]:
    group = plan.group
    entry: dict[str, Any] = {"index": plan.index, "kind": group.kind, "num_layers": group.num_layers}
    entry["layers"] = list(group.layers)
    for name in ("window", "chunk", "encoder_tokens"):
        if getattr(group, name) is not None:
            entry[name] = getattr(group, name)
    if group.kind == "recurrent":
        entry["state_tensors"] = [
            {"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in group.state.tensors
        ]
        entry.update(
            bytes_per_state=group.bytes_per_state, states=plan.units, states_per_sequence=plan.units_per_sequence
        )
    else:
        entry.update(dtype=group.spec.dtype, block_size=group.block_size, bytes_per_block=group.bytes_per_block)
        entry.update(blocks=plan.units, blocks_per_sequence=plan.units_per_sequence)
    entry["bytes_per_sequence"] = plan.units_per_sequence * group.unit_bytes
    entry["bytes"] = plan.bytes
    return entry


def _group_kind(group: Any) -> str:
    span = {"window": group.window, "chunk": group.chunk, "encoder": group.encoder_tokens}
    return str(group.kind) + "".join(f" ({name} {value:,})" for name, value in span.items() if value is not None)


def _cmd_plan_hybrid(args: argparse.Namespace, out: Any) -> None:
    """A hybrid preset: memory per group, split so that every group holds the same running sequences."""
    from kvblocks.hybrid.presets import hybrid_preset

    given = [f"--{n.replace('_', '-')}" for n in _SHAPE_FLAGS if getattr(args, n) is not None]
    if given:
        raise ConfigError(f"--model {args.model} sets the shape: drop {', '.join(given)} (or --model)")
    layout = hybrid_preset(args.model, dtype=args.dtype, block_size=args.block_size)
    context = DEFAULT_CONTEXT if args.context is None else args.context
    plan = layout.split(args.memory, context)
    if plan.used_bytes == 0:
        least = min(g.group.unit_bytes for g in plan.groups)
        raise ConfigError(
            f"--memory {_bytes(args.memory)} is smaller than one block of any group (the least is {_bytes(least)})"
        )
    all_full = layout.all_full().held_bytes(context)
    groups = [_group_json(g) for g in plan.groups]
    for entry, g in zip(groups, plan.groups, strict=True):
        entry["share"] = g.bytes / args.memory
    if args.json:
        document = {
            "model": args.model,
            "dtype": args.dtype,
            "num_layers": layout.num_layers,
            "memory_bytes": args.memory,
            "context_tokens": context,
            "bytes_per_sequence": plan.bytes_per_sequence,
            "all_full_bytes_per_sequence": all_full,
            "sequences": plan.sequences,
            "used_bytes": plan.used_bytes,
            "groups": groups,
        }
        out.write(json.dumps(document, indent=2) + "\n")
        return
    saving = (
        ""
        if all_full == plan.bytes_per_sequence
        else (f" ({plan.bytes_per_sequence / all_full:.3f} of {all_full:,} if every attention layer were full)")
    )
    out.write(
        f"model            {args.model}: {layout.num_layers} layers in {len(plan.groups)} groups "
        f"({args.dtype} KV, {args.block_size}-token blocks)\n"
        f"memory           {args.memory:,} bytes ({plan.used_bytes:,} used)\n"
        f"context          {context:,} tokens per running sequence\n"
        f"per sequence     {plan.bytes_per_sequence:,} bytes held{saving}\n"
        f"sequences        {plan.sequences:,} running at that context, in every group\n"
    )
    header = ("group", "kind", "layers", "bytes per unit", "per sequence", "blocks/states", "memory", "share")
    rows = [header]
    for g in plan.groups:
        unit = g.group.unit
        rows.append(
            (
                str(g.index),
                _group_kind(g.group),
                str(g.group.num_layers),
                f"{g.group.unit_bytes:,} per {unit}",
                f"{g.units_per_sequence:,} {unit}{'s' if g.units_per_sequence != 1 else ''}",
                f"{g.units:,} {unit}s",
                f"{g.bytes:,} bytes",
                f"{100 * g.bytes / args.memory:.1f}%",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n")


# ------------------------------------------------------------------ entry point


def _status(code: object) -> int:
    return code if isinstance(code, int) else 0 if code is None else 2


def _attach_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--memory -1G`` as ``--memory=-1G``: argparse takes a value that starts with "-" and is not a plain
    number for an option and answers "expected one argument"; attached, the value's own check answers."""
    takes_value = {
        option
        for p in _parsers(parser)
        for action in p._actions
        if action.nargs is None and action.option_strings
        for option in action.option_strings
    }
    out: list[str] = []
    for token in argv:
        if out and out[-1] in takes_value and re.match(r"-[0-9.]", token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parser and its subcommands' parsers."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found += list(action.choices.values())
    return found


def main(argv: Sequence[str] | None = None, out: io.TextIOBase | None = None) -> int:
    """Run the command; returns the exit status (0; 2 for a usage or input error, with one line on stderr;
    130 for Ctrl-C, with one line)."""
    try:
        return _main(argv, out)
    except KeyboardInterrupt:  # Ctrl-C before a command started
        print("kvblocks: interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None, out: io.TextIOBase | None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(_attach_dash_values(parser, list(sys.argv[1:] if argv is None else argv)))
    except SystemExit as stop:  # --help, --version, or a usage error argparse already reported
        return _status(stop.code)
    stream: Any = out if out is not None else sys.stdout
    commands = {"replay": _cmd_replay, "sweep": _cmd_sweep, "plan": _cmd_plan}
    try:
        commands[args.command](args, stream)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback (a progress line was cleared on the way out)
        print(f"kvblocks {args.command}: interrupted", file=sys.stderr)
        return 130
    except KVBlocksError as error:
        print(f"kvblocks {args.command}: error: {_one_line(str(error))}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (`kvblocks sweep ... | head`): stop quietly, as a shell tool does
        if stream is sys.stdout:
            with contextlib.suppress(OSError):  # the interpreter's final flush must not fail again
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE
    except OSError as error:  # an output that failed midway (disk full); rows written so far stay written
        print(f"kvblocks {args.command}: error: {_one_line(str(error))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
