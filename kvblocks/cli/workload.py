"""The trace and the replay settings that ``replay`` and ``sweep`` run with, checked against the trace."""

from __future__ import annotations

import argparse
from typing import Any

from kvblocks.errors import ConfigError


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
