"""Request traces: reading them (every line checked before anything is replayed), and a built-in one.

Two line formats, one JSON object per line, detected per file from its first request:

* Mooncake (``hash_ids``): ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``
  with one id per 512-token block of the prompt, the last one possibly partial. Ids are block
  identities already (two prompts share a prefix for as many leading ids as they share).
* Tokens (``token_ids``): ``{"token_ids": [...], "output_length": m, "timestamp": t}`` (only
  ``token_ids`` is required); the replayer hashes them.

A malformed line raises :class:`TraceFormatError` naming the file, the line number and what was
wrong, before any request is replayed, so a partial run is never reported as a result.
Files ending in ``.gz`` are read through gzip.
"""

from __future__ import annotations

import gzip
import io
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kvblocks.errors import KVBlocksError

__all__ = [
    "BUNDLED_TRACES",
    "MOONCAKE_BLOCK_TOKENS",
    "Trace",
    "TraceFormatError",
    "TraceRequest",
    "load_trace",
    "synthetic_chat",
]

MOONCAKE_BLOCK_TOKENS = 512
BUNDLED_TRACES = {
    "mooncake-conversation": "mooncake_conversation.jsonl.gz",
    "mooncake-synthetic": "mooncake_synthetic.jsonl.gz",
}
"""Mooncake's FAST'25 traces, shipped with the package (see ``kvblocks/data/README.md``)."""


class TraceFormatError(KVBlocksError, ValueError):
    """A trace file is unreadable or one of its lines is not a request."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: its prompt as block ids or as tokens, and its length."""

    num_tokens: int
    output_tokens: int = 0
    timestamp: float = 0.0
    hash_ids: tuple[int, ...] | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Trace:
    """A whole trace, in timestamp order (stable for equal stamps)."""

    name: str
    kind: str  # "hash_ids" or "token_ids"
    requests: tuple[TraceRequest, ...]
    block_tokens: int | None = None  # the trace's own block size (hash-id traces)

    def __len__(self) -> int:
        return len(self.requests)


def _int(record: dict[str, object], key: str, where: str, *, required: bool = True, minimum: int = 0) -> int:
    value = record.get(key)
    if value is None and not required:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceFormatError(f"{where}: {key!r} must be an int >= {minimum}, got {value!r}")
    return value


def _int_list(record: dict[str, object], key: str, where: str) -> tuple[int, ...]:
    value = record.get(key)
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise TraceFormatError(f"{where}: {key!r} must be a list of ints >= 0")
    return tuple(value)


def _timestamp(record: dict[str, object], where: str) -> float:
    value = record.get("timestamp", 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceFormatError(f"{where}: 'timestamp' must be a number, got {value!r}")
    return float(value)


def _parse(lines: Iterator[str], name: str) -> Trace:
    requests: list[TraceRequest] = []
    kind: str | None = None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name}, line {number}"
        try:
            record = json.loads(line)
        except ValueError as e:
            raise TraceFormatError(f"{where}: not JSON ({e})") from None
        if not isinstance(record, dict):
            raise TraceFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
        this = "hash_ids" if "hash_ids" in record else "token_ids" if "token_ids" in record else None
        if this is None:
            raise TraceFormatError(f"{where}: a request needs 'hash_ids' (Mooncake) or 'token_ids'")
        if kind is None:
            kind = this
        elif this != kind:
            raise TraceFormatError(f"{where}: has {this!r} but the file's first request had {kind!r}")
        stamp = _timestamp(record, where)
        output = _int(record, "output_length", where, required=False)
        if this == "hash_ids":
            length = _int(record, "input_length", where, minimum=1)
            ids = _int_list(record, "hash_ids", where)
            blocks = -(-length // MOONCAKE_BLOCK_TOKENS)
            if len(ids) != blocks:
                raise TraceFormatError(
                    f"{where}: {len(ids)} hash_ids for {length} tokens; "
                    f"{MOONCAKE_BLOCK_TOKENS}-token blocks need {blocks}"
                )
            requests.append(TraceRequest(length, output, stamp, hash_ids=ids))
        else:
            tokens = _int_list(record, "token_ids", where)
            if not tokens:
                raise TraceFormatError(f"{where}: 'token_ids' is empty")
            requests.append(TraceRequest(len(tokens), output, stamp, token_ids=tokens))
    if kind is None:
        raise TraceFormatError(f"{name}: no requests")
    ordered = sorted(requests, key=lambda r: r.timestamp)
    return Trace(name, kind, tuple(ordered), MOONCAKE_BLOCK_TOKENS if kind == "hash_ids" else None)


def load_trace(source: str | Path) -> Trace:
    """Read a trace file (``.jsonl`` or ``.jsonl.gz``), or a bundled one by name (``BUNDLED_TRACES``)."""
    text = str(source)
    path = Path(text)
    if not path.exists() and text in BUNDLED_TRACES:
        data = resources.files("kvblocks.data").joinpath(BUNDLED_TRACES[text]).read_bytes()
        return _parse(iter(io.TextIOWrapper(gzip.GzipFile(fileobj=io.BytesIO(data)), "utf-8")), text)
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as handle:
                return _parse(iter(handle), text)
        with open(path, encoding="utf-8") as handle:
            return _parse(iter(handle), text)
    except FileNotFoundError:
        known = ", ".join(BUNDLED_TRACES)
        raise TraceFormatError(f"{text}: no such file (bundled traces: {known})") from None
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise TraceFormatError(f"{text}: cannot read it ({e})") from None


def synthetic_chat(
    *,
    conversations: int = 200,
    system_prompts: int = 4,
    turns: tuple[int, int] = (2, 5),
    seed: int = 0,
    vocab: int = 32_000,
) -> Trace:
    """A multi-turn chat workload over a few shared system prompts; each turn re-sends the history.

    Deterministic for a seed (its own generator; no global state). Turns interleave across
    conversations, so a conversation's next turn arrives after many others.
    """
    rng = random.Random(seed)

    def tokens(low: int, high: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randint(low, high))]

    systems = [tokens(256, 1024) for _ in range(system_prompts)]
    history = [list(systems[rng.randrange(system_prompts)]) for _ in range(conversations)]
    num_turns = [rng.randint(*turns) for _ in range(conversations)]
    requests: list[TraceRequest] = []
    clock = 0.0
    for turn in range(max(num_turns)):
        order = [c for c in range(conversations) if num_turns[c] > turn]
        rng.shuffle(order)
        for c in order:
            prompt = history[c] + tokens(32, 384)
            output = tokens(16, 128)
            requests.append(TraceRequest(len(prompt), len(output), clock, token_ids=tuple(prompt)))
            history[c] = prompt + output
            clock += 1.0
    return Trace("synthetic-chat", "token_ids", tuple(requests))
