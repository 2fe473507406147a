"""``kvblocks plan``: bytes per block and the blocks/tokens a memory budget holds; for a hybrid preset, memory
per group of layers."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvblocks.errors import ConfigError

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128},
    "llama-3-70b": {"num_layers": 80, "num_kv_heads": 8, "head_dim": 128},
    "mistral-7b": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128},
    "qwen2.5-7b": {"num_layers": 28, "num_kv_heads": 4, "head_dim": 128},
    "qwen2.5-72b": {"num_layers": 80, "num_kv_heads": 8, "head_dim": 128},
    "deepseek-v3": {"mla": {"num_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64}},
}
"""Published model shapes (KV heads after GQA; DeepSeek-V3 caches one MLA latent per token)."""

DEFAULT_CONTEXT = 32768
"""Tokens per running sequence a hybrid plan is sized for when ``--context`` is not given."""

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
    from kvblocks.layouts.presets import HYBRID_PRESETS

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
    from kvblocks.layouts.presets import hybrid_preset

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
