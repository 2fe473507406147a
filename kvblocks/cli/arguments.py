"""What the ``kvblocks`` command line accepts: the parser, its value types and bounds, and argv's
preprocessing (``--memory -1G`` read as ``--memory=-1G``)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any, NoReturn

from kvblocks.cli.plan import DEFAULT_CONTEXT, MODEL_PRESETS
from kvblocks.errors import ConfigError
from kvblocks.replay import LIMITS, MAX_BLOCKS

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

# Single letters and the "i" forms are binary (as docker, the JVM and free(1) read them); "B" forms are decimal.
_UNITS = {"": 1, "b": 1}
for _power, _letter in enumerate("kmgtpe", 1):
    _UNITS.update({_letter: 1 << 10 * _power, _letter + "i": 1 << 10 * _power, _letter + "ib": 1 << 10 * _power})
    _UNITS[_letter + "b"] = 10 ** (3 * _power)

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
    from kvblocks.core.eviction import check_eviction

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


class _VersionAction(argparse.Action):
    """``--version``: kvblocks' version and whether its hot modules run compiled (worked out only when asked)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        from kvblocks import native

        print(f"{parser.prog} {_version()} ({native.describe()})")
        parser.exit()


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
    parser.add_argument("--version", action=_VersionAction, help="show the version and how the hot modules run")
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

    from kvblocks.layouts.presets import HYBRID_PRESETS

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
