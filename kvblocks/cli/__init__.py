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

Modules: ``arguments`` (the parser and its value types), ``entry`` (``main``: exit statuses), ``replay``,
``sweep`` and ``plan`` (one command each), ``workload`` (the trace and replay settings replay and sweep share),
``progress`` (the terminal progress line), ``plot`` (the sweep's matplotlib figure).
"""

from kvblocks.cli.arguments import DTYPE_ALIASES
from kvblocks.cli.entry import main
from kvblocks.cli.plan import MODEL_PRESETS

__all__ = ["DTYPE_ALIASES", "MODEL_PRESETS", "main"]
