"""The ``kvblocks`` entry point: parse, run one command, and turn every way it ends into an exit status."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Sequence
from typing import Any

from kvblocks.cli.arguments import _attach_dash_values, _one_line, _parser
from kvblocks.cli.plan import _cmd_plan
from kvblocks.cli.replay import _cmd_replay
from kvblocks.cli.sweep import _cmd_sweep
from kvblocks.errors import KVBlocksError


def _status(code: object) -> int:
    return code if isinstance(code, int) else 0 if code is None else 2


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
