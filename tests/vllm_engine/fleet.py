"""A fleet of vLLM engines sharing one store, each engine a process of its own (see ``engine_process``).

Helpers the fleet tests share: run an engine over prompts, damage a store's entries the ways a shared directory
gets damaged, and read a store back block by block at the KV level (every layer's K and V as float arrays), keyed
by the block's position in the prompts' hash chains. Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvblocks.hashing import block_hashes
from kvblocks.tiers.entry import HEADER
from tests.vllm_engine.engine import BLOCK_SIZE

REPO = Path(__file__).resolve().parents[2]
ENGINE_TIMEOUT_S = 600
CONNECTOR = {"kv_connector": "KVBlocksConnector", "kv_connector_module_path": "kvblocks.integrations.vllm"}
TRACED = {"kv_connector": "TracedConnector", "kv_connector_module_path": "tests.vllm_engine.traced_connector"}


def connector_config(store: Path, connector: dict[str, str] = CONNECTOR, **extra: Any) -> dict[str, Any]:
    return {**connector, "kv_role": "kv_both", "kv_connector_extra_config": {"path": str(store), **extra}}


def run_engine(
    model: Path,
    prompts: Sequence[Sequence[int]],
    workdir: Path,
    name: str,
    *,
    max_tokens: int = 8,
    logprobs: int = 1,
    env: dict[str, str] | None = None,
    **engine: Any,
) -> dict[str, Any]:
    """Run one engine in a new process over ``prompts``; its result (see ``engine_process``). Its log is kept
    in ``workdir/<name>.log``; a failed run raises with the log's tail."""
    spec = {
        "model": str(model),
        "prompts": [list(p) for p in prompts],
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "engine": engine,
    }
    spec_path, out_path, log_path = (workdir / f"{name}.{ext}" for ext in ("spec.json", "out.json", "log"))
    spec_path.write_text(json.dumps(spec))
    with log_path.open("w") as log:
        done = subprocess.run(
            [sys.executable, "-m", "tests.vllm_engine.engine_process", str(spec_path), str(out_path)],
            cwd=REPO,
            env={**os.environ, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=ENGINE_TIMEOUT_S,
            check=False,
        )
    if done.returncode != 0:
        tail = log_path.read_text()[-4000:]
        raise AssertionError(f"engine {name} exited with {done.returncode}:\n{tail}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def entries(store: Path) -> dict[str, Path]:
    """Every entry file of a FileStorage directory, by key (the file name)."""
    return {f.name: f for f in store.rglob("*") if f.is_file() and not f.name.startswith(".")}


def hash_of_key(key: str) -> bytes:
    """The block hash a storage key names (``...b<hex>`` or ``...b<hex>.r<rank>``)."""
    parts = key.split(".")
    digest = parts[-1] if not parts[-1].startswith("r") else parts[-2]
    if not digest.startswith("b"):
        raise ValueError(f"{key!r} does not name a bytes hash")
    return bytes.fromhex(digest[1:])


def chain_positions(prompts: Iterable[Sequence[int]], scheme: str = "vllm-sha256") -> dict[bytes, str]:
    """Every full block's hash of the prompts' token chains -> a readable name (``p2:6``: prompt 2, block 6;
    a block the prompts share takes the first prompt's name)."""
    names: dict[bytes, str] = {}
    for i, tokens in enumerate(prompts):
        for j, h in enumerate(block_hashes(list(tokens), BLOCK_SIZE, scheme=scheme)):
            names.setdefault(h, f"p{i}:{j}")
    return names


@dataclass(frozen=True)
class KVBlock:
    """One stored block at the KV level: ``layers[l]`` is layer ``l``'s block as float32 values."""

    layers: tuple[np.ndarray, ...]

    def max_abs_diff(self, other: KVBlock) -> float:
        return max(float(np.max(np.abs(a - b))) for a, b in zip(self.layers, other.layers, strict=True))

    def value_range(self) -> float:
        return max(float(np.max(a) - np.min(a)) for a in self.layers)


def read_kv(path: Path, num_layers: int, payload_bytes: int) -> KVBlock | None:
    """An entry's payload as float32 layers, or None where it is not a whole entry (damaged, half-written)."""
    data = path.read_bytes()
    payload = data[HEADER.size :]
    if len(payload) != payload_bytes:
        return None
    values = np.frombuffer(payload, dtype=np.float32)
    return KVBlock(tuple(np.split(values, num_layers)))


def copy_store(source: Path, target: Path) -> None:
    shutil.copytree(source, target)


def damage_store(store: Path, victims: dict[str, str], donor: str | None = None) -> None:
    """Damage the entries named by key in ``victims`` (key -> how): ``flip-payload``, ``flip-header`` (a byte of
    the version field), ``half``, ``empty``, ``header-only``, ``delete``, ``append``, ``other-key`` (replaced by
    the sound entry under ``donor``)."""
    files = entries(store)
    for key, how in victims.items():
        f = files[key]
        data = bytearray(f.read_bytes())
        if how == "flip-payload":
            data[HEADER.size + 1000] ^= 0x40
        elif how == "flip-header":
            data[8] ^= 0x01  # the format version's low byte
        elif how == "half":
            data = data[: len(data) // 2]
        elif how == "empty":
            data = bytearray()
        elif how == "header-only":
            data = data[: HEADER.size]
        elif how == "append":
            data += b"garbage" * 10
        elif how == "other-key":
            if donor is None:
                raise ValueError("other-key damage needs a donor entry")
            data = bytearray(files[donor].read_bytes())
        elif how == "delete":
            f.unlink()
            continue
        else:
            raise ValueError(f"unknown damage {how!r}")
        f.write_bytes(bytes(data))
