"""Hypothesis strategies for bytes from outside the process: valid encodings damaged at the byte level or at
the JSON level, and random prefill handoffs (shared by the decoder fuzz tests and the hybrid handoff tests)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from kvblocks import CachedTokens, PrefillHandoff


@st.composite
def byte_mutations(draw: st.DrawFn, valid: bytes) -> bytes:
    """``valid`` after one to three byte-level edits: flips, truncation, insertion, deletion, duplication."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "duplicate", "set"]))
        if op == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and at < len(data):
            data[at] = draw(st.sampled_from(b'{}[]",:0123456789-.eE \\nt\x00\xff\x80'))
        elif op == "truncate":
            del data[at:]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        elif op == "duplicate":
            data[at:at] = data[at : at + draw(st.integers(1, 32))]
    return bytes(data)


JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**62, max_value=2**130),
    st.integers(min_value=-(2**130), max_value=-1),
    st.sampled_from([2**32, 2**63, 2**64, 10**309, -(10**309)]),  # u32, i64, u64 edges; beyond a float
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["16:" + "ab" * 16, "2:0102", "0:", "-1:00", "ff", "", "\ud800", "S", "R", "C", "device"]),
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)

# JSON text json.dumps cannot write: beyond int's digit limit, deep nesting, NaN, surrogates, huge widths.
RAW_TEXTS = st.sampled_from(
    [
        "9" * 5000,
        "-" + "9" * 5000,
        "1" + "0" * 400,
        "1e999",
        "-1e999",
        "NaN",
        "Infinity",
        "[" * 3000 + "]" * 3000,
        '{"a":' * 3000 + "1" + "}" * 3000,
        "[" * 990 + "]" * 990,
        '"' + "9" * 5000 + ':00"',
        '"99999999999:00"',
        '"\\ud800"',
        '"\\udfff\\ud800"',
        "1" * 4300,
        "18446744073709551616",
        "9223372036854775808",
        "4294967296",
        "-0",
        "0.0",
        "true",
        "[]",
        "{}",
    ]
)
_HOLE = "\x00hole\x00"


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            out += _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            out += _paths(child, (*prefix, index))
    return out


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _replace(value[head], rest, new)}
    return [_replace(v, rest, new) if i == head else v for i, v in enumerate(value)]


def _similar(node: Any) -> st.SearchStrategy[Any]:
    if type(node) in (int, float):
        return st.one_of(
            st.integers(-2, 2**33),
            st.integers(2**62, 2**64),
            st.sampled_from([node - 1, node + 1, 10**309, -(10**309)]),
            st.floats(allow_nan=False),
        )
    if type(node) is str:
        hexed = node.partition(":")[2]
        return st.one_of(
            st.text(max_size=8),
            st.just(node[:-1]),
            st.just(node + "00"),
            st.sampled_from(["1:" + hexed, "32:" + hexed, "0" + node, "9" * 5000 + ":" + hexed]),
        )
    if type(node) is list and node:
        return st.one_of(
            st.permutations(node).map(list),
            st.just(node[1:]),
            st.just(node + node[-1:]),
            st.just([node[0], *node]),
        )
    return JSON_VALUES


@st.composite
def json_mutations(draw: st.DrawFn, valid: bytes) -> bytes:
    """``valid`` with one node of its JSON replaced by another JSON value, raw JSON text, a deeper
    nesting of itself, or with a key repeated."""
    tree = json.loads(valid)
    path = draw(st.sampled_from(_paths(tree)))
    kind = draw(st.sampled_from(["similar", "similar", "value", "raw", "nest", "duplicate", "drop"]))
    if kind == "similar":  # a value of the same JSON type: reaches the checks behind the type checks
        node = tree
        for step in path:
            node = node[step]
        return json.dumps(_replace(tree, path, draw(_similar(node)))).encode()
    if kind == "duplicate" and isinstance(tree, dict):
        key = draw(st.sampled_from(sorted(tree)))
        text = json.dumps(draw(JSON_VALUES))
        return valid.replace(b"{", b"{" + json.dumps(key).encode() + b":" + text.encode() + b",", 1)
    if kind == "drop" and path:
        parent = tree
        for step in path[:-1]:
            parent = parent[step]
        parent = parent.copy()
        del parent[path[-1]]
        return json.dumps(_replace(tree, path[:-1], parent)).encode()
    if kind == "nest":
        node = tree
        for step in path:
            node = node[step]
        return json.dumps(_replace(tree, path, [[node]] if draw(st.booleans()) else {"x": node})).encode()
    if kind == "value":
        return json.dumps(_replace(tree, path, draw(JSON_VALUES))).encode()
    text = json.dumps(_replace(tree, path, _HOLE))
    return text.replace(json.dumps(_HOLE), draw(RAW_TEXTS)).encode()


@st.composite
def handoffs(draw: st.DrawFn) -> PrefillHandoff:
    size = draw(st.integers(1, 8))
    prompt = draw(st.integers(1, 40))
    full, total = prompt // size, -(-prompt // size)
    if draw(st.booleans()):
        hashes = tuple(draw(st.lists(st.binary(min_size=16, max_size=16), min_size=full, max_size=full)))
    else:
        hashes = tuple(draw(st.lists(st.integers(0, 2**64 - 1), min_size=full, max_size=full)))
    device = draw(st.integers(0, prompt))
    host = draw(st.integers(0, prompt - device))
    return PrefillHandoff(
        seq_id=draw(st.text(max_size=6) | st.integers(0, 2**70)),
        num_prompt_tokens=prompt,
        block_hashes=hashes,
        source_blocks=tuple(draw(st.lists(st.integers(0, 2**40), min_size=total, max_size=total))),
        cached=CachedTokens(device, host, num_prompt_tokens=prompt),
        scheme=draw(st.sampled_from(["xxh3-128", "sha256", "xxh3-64-1337"])),
        block_size=size,
        key_space=draw(st.text(alphabet="0123456789abcdef", min_size=16, max_size=16)),
    )
