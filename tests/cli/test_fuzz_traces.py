"""Trace files are outside bytes: whatever they hold, loading raises only TraceFormatError, and the
``kvblocks`` command answers with exit status 2, one line on stderr and nothing on stdout.

The inputs are valid traces (token ids and Mooncake hash ids, plain and gzipped) mutated the ways a
file gets damaged or hand-edited: flipped bytes, truncation, inserted bytes, a line replaced with
random JSON, deep nesting, huge numbers and wrong types in each field.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvblocks.cli import main
from kvblocks.traces import MAX_LINE_CHARS, Trace, TraceFormatError, load_trace

TOKEN_LINES = [{"token_ids": list(range(k, k + 24 + 8 * k)), "output_length": 4, "timestamp": k} for k in range(4)] + [
    {"token_ids": list(range(40)), "timestamp": 0.5}
]
MOONCAKE_LINES = [
    {"timestamp": 0, "input_length": 700, "output_length": 10, "hash_ids": [1, 2]},
    {"timestamp": 5, "input_length": 1030, "output_length": 3, "hash_ids": [1, 2, 3]},
    {"timestamp": 9, "input_length": 300, "output_length": 1, "hash_ids": [4]},
]
FIELDS = ["token_ids", "hash_ids", "input_length", "output_length", "timestamp"]

huge_numbers = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.integers(min_value=0, max_value=4000).map(lambda k: 10**k),  # 4300 digits is the most json writes
    st.sampled_from([2**32, 2**32 - 1, 2**64, -1, 1e308, -0.0, 1.5]),
)
json_values = st.recursive(
    st.none() | st.booleans() | huge_numbers | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=4), inner),
    max_leaves=8,
)


def raw_json(value: Any) -> str:
    """JSON text the way a careless writer produces it (NaN and Infinity included)."""
    return json.dumps(value, allow_nan=True)


@st.composite
def edited_line(draw: st.DrawFn, record: dict[str, Any]) -> str:
    """One request line, with a field set to another type, a huge number, a list of those, or removed."""
    record = dict(record)
    key = draw(st.sampled_from(FIELDS))
    action = draw(st.sampled_from(["value", "item", "drop", "deep"]))
    if action == "value":
        record[key] = draw(json_values)
    elif action == "item" and isinstance(record.get(key), list) and record[key]:
        items = list(record[key])
        items[draw(st.integers(0, len(items) - 1))] = draw(json_values)
        record[key] = items
    elif action == "drop":
        record.pop(key, None)
    else:
        depth = draw(st.integers(1, 5000))
        text = raw_json({k: v for k, v in record.items() if k != key})
        return text[:-1] + f', "{key}": ' + "[" * depth + "]" * depth + "}"
    return raw_json(record)


@st.composite
def valid_line(draw: st.DrawFn, mooncake: bool) -> str:
    """A request that is valid but odd: ids from a tiny space (shared, reordered), extreme stamps and ids."""
    stamp = draw(st.one_of(st.integers(-(10**6), 10**6), st.floats(allow_nan=False, allow_infinity=False)))
    if mooncake:
        ids = draw(st.lists(st.integers(0, 6) | st.sampled_from([2**64 - 1]), min_size=1, max_size=5, unique=True))
        length = 512 * (len(ids) - 1) + draw(st.integers(1, 512))
        return raw_json({"hash_ids": ids, "input_length": length, "timestamp": stamp})
    tokens = draw(st.lists(st.integers(0, 3) | st.sampled_from([2**32 - 1]), min_size=1, max_size=70))
    return raw_json({"token_ids": tokens, "timestamp": stamp, "output_length": draw(st.integers(0, 10**20))})


@st.composite
def trace_text(draw: st.DrawFn) -> bytes:
    """A valid trace with zero or more of its lines edited, replaced or added."""
    base = draw(st.sampled_from([TOKEN_LINES, MOONCAKE_LINES]))
    lines = [raw_json(r) for r in base]
    for _ in range(draw(st.sampled_from([0, 1, 1, 2, 3]))):
        where = draw(st.integers(0, len(lines)))
        kind = draw(st.sampled_from(["valid", "valid", "edit", "random", "deep", "digits", "blank"]))
        if kind == "valid":
            line = draw(valid_line(base is MOONCAKE_LINES))
        elif kind == "edit":
            line = draw(edited_line(base[where % len(base)]))
        elif kind == "random":
            line = raw_json(draw(json_values))
        elif kind == "deep":
            depth = draw(st.integers(500, 200_000))
            line = draw(st.sampled_from(["[", '{"a": '])) * depth
        elif kind == "digits":
            line = '{"token_ids": [' + "7" * draw(st.integers(1, 6000)) + "]}"
        else:
            line = draw(st.sampled_from(["", "   ", "\t", "\x00", "\ufeff{}"]))
        lines[where : where + draw(st.integers(0, 1))] = [line]
    return ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")


@st.composite
def damaged(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` with a few bytes flipped, cut short, or with bytes inserted."""
    out = bytearray(data)
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2, 3]))):
        if not out:
            break
        kind = draw(st.sampled_from(["flip", "truncate", "insert"]))
        at = draw(st.integers(0, len(out) - 1))
        if kind == "flip":
            out[at] ^= draw(st.integers(1, 255))
        elif kind == "truncate":
            del out[at:]
        else:
            out[at:at] = draw(st.binary(min_size=1, max_size=4))
    return bytes(out)


@st.composite
def trace_file(draw: st.DrawFn) -> tuple[str, bytes]:
    """(suffix, file bytes): plain JSONL, or gzip of it; the damage hits the bytes as stored."""
    text = draw(trace_text())
    if draw(st.booleans()):
        return ".jsonl.gz", draw(damaged(gzip.compress(text, mtime=0)))
    return ".jsonl", draw(damaged(text))


_names = itertools.count()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz_traces")


def write(folder: Path, suffix: str, data: bytes) -> Path:
    path = folder / f"t{next(_names)}{suffix}"
    path.write_bytes(data)
    return path


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(file=trace_file())
def test_loading_any_damaged_trace_raises_only_trace_format_error(folder: Path, file: tuple[str, bytes]) -> None:
    path = write(folder, *file)
    try:
        trace = load_trace(path)
    except TraceFormatError as error:
        message = str(error)
        event("trace error")
        assert message.startswith(str(path)) and "\n" not in message and len(message) < 500
    else:
        event("loaded")
        assert isinstance(trace, Trace) and len(trace) > 0
        assert trace.kind in ("hash_ids", "token_ids")
        stamps = [r.timestamp for r in trace.requests]
        assert stamps == sorted(stamps)
    finally:
        path.unlink()


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(file=trace_file(), reference=st.booleans())
def test_the_command_answers_any_damaged_trace_with_a_result_or_one_error_line(
    folder: Path, file: tuple[str, bytes], reference: bool
) -> None:
    path = write(folder, *file)
    out, err = io.StringIO(), io.StringIO()
    argv = ["replay", str(path), "--json", "--concurrency", "2"] + (["--reference"] if reference else [])
    try:
        with contextlib.redirect_stderr(err):
            status = main(argv, out=out)  # type: ignore[arg-type]
    finally:
        path.unlink()
    event(f"exit {status}")
    if status == 0:
        assert json.loads(out.getvalue())["requests"] > 0 and err.getvalue() == ""
    else:
        assert status == 2 and out.getvalue() == ""
        assert err.getvalue().startswith("kvblocks replay: error: ") and err.getvalue().count("\n") == 1


def test_a_huge_input_length_is_named_briefly(tmp_path: Path) -> None:
    """Found by hypothesis in CI: a 200-digit ``input_length`` was printed whole in the error message."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1' + "0" * 200 + ', "output_length": 10, "hash_ids": [1, 2]}\n')
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    message = str(info.value)
    assert message.startswith(str(path)) and len(message) < 500 and "hash_ids" in message


@pytest.mark.parametrize(
    "line",
    [
        '{"token_ids": [1, 2, 3], "token_ids": [4]}',
        '{"timestamp": 0, "input_length": 700, "hash_ids": [1, 2], "hash_ids": [3, 4]}',
        '{"token_ids": [1, 2], "timestamp": 1, "timestamp": 2}',
    ],
)
def test_a_key_given_twice_is_refused_not_read_as_its_last_value(tmp_path: Path, line: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TraceFormatError, match=r"line 1: not JSON .*repeats a key"):
        load_trace(path)


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_a_line_with_no_end_is_refused_at_the_limit() -> None:
    """``kvblocks replay /dev/zero``: one line that never ends. Read up to the limit, then refused (it
    used to be read whole: a MemoryError traceback)."""
    with pytest.raises(TraceFormatError, match=f"/dev/zero, line 1: longer than {MAX_LINE_CHARS} characters"):
        load_trace("/dev/zero")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["replay", "/dev/zero"]) == 2
    assert err.getvalue().startswith("kvblocks replay: error: /dev/zero, line 1: longer than")
    assert err.getvalue().count("\n") == 1


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_lines_up_to_the_limit_are_read_and_longer_ones_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str
) -> None:
    line = '{"token_ids": [1, 2, 3], "timestamp": 0}'
    monkeypatch.setattr("kvblocks.traces.MAX_LINE_CHARS", len(line))

    def load(text: str) -> Trace:
        path = tmp_path / f"t{next(_names)}{suffix}"
        data = text.encode()
        path.write_bytes(gzip.compress(data, mtime=0) if suffix.endswith(".gz") else data)
        return load_trace(path)

    assert len(load(f"{line}\n{line}\n")) == 2
    assert len(load(f"{line}\n{line}")) == 2  # the last line without its newline
    longer = line[:-1] + " }"
    for text in (f"{line}\n{longer}\n", f"{line}\n{longer}"):
        with pytest.raises(TraceFormatError, match=f"line 2: longer than {len(line)} characters"):
            load(text)
