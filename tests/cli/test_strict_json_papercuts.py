"""Strict JSON papercuts (issue 30: 16): a UTF-8 byte order mark in a trace file, an integer beyond Python's digit
limit.

:func:`kvblocks.strict_json.parse` reads every JSON kvblocks takes from outside (event batches, handoffs and,
with the strict trace reader, trace lines).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvblocks.strict_json import StrictJSONError, parse
from kvblocks.traces import load_trace

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@given(json_values)
def test_a_trace_file_with_a_leading_byte_order_mark_reads_as_one_without(value: object) -> None:
    """Editors on Windows start a file with a byte order mark: the trace reader skips it (it belongs to the file);
    a wire payload with one is still refused (JSON on the wire must not carry one, RFC 8259 section 8.1)."""
    text = json.dumps(value)
    with pytest.raises(StrictJSONError):
        parse("\ufeff" + text)
    with tempfile.TemporaryDirectory() as folder:
        plain, marked = Path(folder, "plain.jsonl"), Path(folder, "marked.jsonl")
        line = json.dumps({"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]}) + "\n"
        plain.write_text(line * 2, encoding="utf-8")
        marked.write_bytes(b"\xef\xbb\xbf" + (line * 2).encode())
        assert load_trace(marked).requests == load_trace(plain).requests


def test_an_integer_beyond_the_digit_limit_is_named_without_python_s_advice_to_the_programmer() -> None:
    with pytest.raises(StrictJSONError) as refused:
        parse('{"token_ids": [' + "9" * 5000 + "]}")
    message = str(refused.value)
    assert message == f"not valid JSON: an integer of more than {sys.get_int_max_str_digits():,} digits"
    assert "set_int_max_str_digits" not in message
