"""Request traces: reading them (every line checked before anything is replayed), and a built-in one.

Two line formats, one JSON object per line, detected per file from its first request:

* Mooncake (``hash_ids``): ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``
  with one id per 512-token block of the prompt, the last one possibly partial. Ids are block
  identities already (two prompts share a prefix for as many leading ids as they share).
* Tokens (``token_ids``): ``{"token_ids": [...], "output_length": m, "timestamp": t}`` (only
  ``token_ids`` is required); the replayer hashes them.

A malformed line raises :class:`TraceFormatError` naming the file, the line number and what was
wrong, before any request is replayed, so a partial run is never reported as a result. It is the
only exception a trace file can provoke: damaged gzip data, bad UTF-8, JSON nested too deeply,
numbers out of range all become one. Token ids must be in ``[0, 2**32)`` (what the hasher packs),
hash ids in ``[0, 2**64)`` and distinct within a request (one chain), timestamps finite.
Files ending in ``.gz`` are read through gzip. JSON is read strictly (:mod:`kvblocks.strict_json`):
a key given twice in one request, ``NaN`` or ``Infinity`` is an error, not a silent choice. A line may
hold at most :data:`MAX_LINE_CHARS` characters: a longer one (a file with no newline, ``/dev/zero``)
is an error once that many are read, never a read of the whole into memory.
"""

from __future__ import annotations

import gzip
import io
import math
import random
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import IO

from kvblocks import strict_json
from kvblocks.errors import KVBlocksError
from kvblocks.hashing import TOKEN_LIMIT

__all__ = [
    "BUNDLED_TRACES",
    "HASH_ID_LIMIT",
    "MAX_LINE_CHARS",
    "MOONCAKE_BLOCK_TOKENS",
    "Trace",
    "TraceFormatError",
    "TraceRequest",
    "load_trace",
    "synthetic_chat",
]

MOONCAKE_BLOCK_TOKENS = 512
MAX_LINE_CHARS = 1 << 25
"""The longest line a trace may have, in characters (its newline not counted): 32 Mi, a request of over two
million token ids of ten digits each. A longer line is a :class:`TraceFormatError` once that many are read."""
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


HASH_ID_LIMIT = 1 << 64
"""Hash ids of a Mooncake trace must be ints in ``[0, 2**64)`` (the published ones are small)."""


def _show(value: object, limit: int = 60) -> str:
    """A short repr for an error message: a line may hold megabytes, or a value Python cannot print."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int over the digit limit, a nesting too deep to print
        text = f"<{type(value).__name__}>"
    return _brief(text, limit)


def _brief(text: str, limit: int = 120) -> str:
    """``text`` on one line, at most ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _int(record: dict[str, object], key: str, where: str, *, required: bool = True, minimum: int = 0) -> int:
    value = record.get(key)
    if value is None and not required:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceFormatError(f"{where}: {key!r} must be an int >= {minimum}, got {_show(value)}")
    return value


def _int_list(record: dict[str, object], key: str, where: str, limit: int) -> tuple[int, ...]:
    """A list of ints in ``[0, limit)``; the message names the first bad position."""
    value = record.get(key)
    if not isinstance(value, list):
        raise TraceFormatError(f"{where}: {key!r} must be a list of ints in [0, {_power(limit)}), got {_show(value)}")
    for index, item in enumerate(value):
        if type(item) is not int or not 0 <= item < limit:
            raise TraceFormatError(
                f"{where}: {key!r} must be a list of ints in [0, {_power(limit)}); position {index} is {_show(item)}"
            )
    return tuple(value)


def _power(limit: int) -> str:
    return f"2**{limit.bit_length() - 1}"


def _distinct(ids: tuple[int, ...], where: str) -> None:
    """One request's hash ids are one chain: a repeat would make it a cycle (the manager refuses it)."""
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        for index, h in enumerate(ids):
            if h in seen:
                raise TraceFormatError(f"{where}: 'hash_ids' position {index} repeats an earlier id ({h})")
            seen.add(h)


def _timestamp(record: dict[str, object], where: str) -> float:
    value = record.get("timestamp", 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceFormatError(f"{where}: 'timestamp' must be a number, got {_show(value)}")
    try:
        stamp = float(value)
    except OverflowError:  # an int beyond a float's range
        stamp = math.inf
    if not math.isfinite(stamp):
        raise TraceFormatError(f"{where}: 'timestamp' must be a finite number, got {_show(value)}")
    return stamp


def _record(line: str, where: str) -> dict[str, object]:
    try:
        record = strict_json.parse(line)
    except strict_json.StrictJSONError as e:  # bad JSON, nested too deeply, a repeated key, NaN, huge ints
        raise TraceFormatError(f"{where}: not JSON ({_brief(str(e))})") from None
    if not isinstance(record, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def _request(record: dict[str, object], kind: str, where: str) -> TraceRequest:
    stamp = _timestamp(record, where)
    output = _int(record, "output_length", where, required=False)
    if kind == "hash_ids":
        length = _int(record, "input_length", where, minimum=1)
        ids = _int_list(record, "hash_ids", where, HASH_ID_LIMIT)
        blocks = -(-length // MOONCAKE_BLOCK_TOKENS)
        if len(ids) != blocks:
            raise TraceFormatError(
                f"{where}: {len(ids)} hash_ids for {_brief(str(length), 40)} tokens; "
                f"{MOONCAKE_BLOCK_TOKENS}-token blocks need {_brief(str(blocks), 40)}"
            )
        _distinct(ids, where)
        return TraceRequest(length, output, stamp, hash_ids=ids)
    tokens = _int_list(record, "token_ids", where, TOKEN_LIMIT)
    if not tokens:
        raise TraceFormatError(f"{where}: 'token_ids' is empty")
    return TraceRequest(len(tokens), output, stamp, token_ids=tokens)


def _lines(handle: IO[str], name: str) -> Iterator[tuple[int, str]]:
    """Numbered lines, each read with a bound (:data:`MAX_LINE_CHARS`); a read that fails (bad gzip data,
    bad UTF-8, a truncated file) or a line too long names its line."""
    number = 0
    limit = MAX_LINE_CHARS
    while True:
        try:
            line = handle.readline(limit + 1)  # room for the newline of a line of exactly the limit
        except (OSError, EOFError, ValueError, zlib.error) as e:  # ValueError: UnicodeDecodeError
            raise TraceFormatError(f"{name}, line {number + 1}: cannot read it ({_brief(str(e))})") from None
        if not line:
            return
        number += 1
        if len(line) > limit and not line.endswith("\n"):
            raise TraceFormatError(f"{name}, line {number}: longer than {limit} characters, the most a line may hold")
        yield number, line


_ENCODING = "utf-8-sig"
"""UTF-8, a leading byte order mark skipped: editors on Windows write one; it belongs to the file, not to JSON
(wire payloads, read by :mod:`kvblocks.strict_json`, refuse it)."""


def _parse(handle: IO[str], name: str) -> Trace:
    requests: list[TraceRequest] = []
    kind: str | None = None
    for number, line in _lines(handle, name):
        if not line.strip():
            continue
        where = f"{name}, line {number}"
        record = _record(line, where)
        this = "hash_ids" if "hash_ids" in record else "token_ids" if "token_ids" in record else None
        if this is None:
            raise TraceFormatError(f"{where}: a request needs 'hash_ids' (Mooncake) or 'token_ids'")
        if kind is None:
            kind = this
        elif this != kind:
            raise TraceFormatError(f"{where}: has {this!r} but the file's first request had {kind!r}")
        requests.append(_request(record, this, where))
    if kind is None:
        raise TraceFormatError(f"{name}: no requests")
    ordered = sorted(requests, key=lambda r: r.timestamp)
    return Trace(name, kind, tuple(ordered), MOONCAKE_BLOCK_TOKENS if kind == "hash_ids" else None)


def load_trace(source: str | Path) -> Trace:
    """Read a trace file (``.jsonl`` or ``.jsonl.gz``), or a bundled one by name (``BUNDLED_TRACES``).

    Raises only :class:`TraceFormatError`, whatever the file holds.
    """
    text = str(source)
    try:
        path = Path(text)
        exists = path.exists()
    except (OSError, ValueError) as e:  # an embedded NUL, a name too long
        raise TraceFormatError(f"{_show(text)}: not a usable path ({e})") from None
    if not exists and text in BUNDLED_TRACES:
        data = resources.files("kvblocks.data").joinpath(BUNDLED_TRACES[text]).read_bytes()
        return _parse(io.TextIOWrapper(gzip.GzipFile(fileobj=io.BytesIO(data)), _ENCODING), text)
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding=_ENCODING) as handle:
                return _parse(handle, text)
        with open(path, encoding=_ENCODING) as handle:
            return _parse(handle, text)
    except TraceFormatError:
        raise
    except FileNotFoundError:
        known = ", ".join(BUNDLED_TRACES)
        raise TraceFormatError(f"{text}: no such file (bundled traces: {known})") from None
    except (OSError, ValueError, EOFError, zlib.error) as e:  # opening it: a directory, no permission
        raise TraceFormatError(f"{text}: cannot read it ({_brief(str(e))})") from None


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
