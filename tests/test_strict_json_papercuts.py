"""Strict JSON papercuts (issue 30: 16): a UTF-8 byte order mark, an integer beyond Python's digit limit.

:func:`kvblocks.strict_json.parse` reads every JSON kvblocks takes from outside (event batches, handoffs and,
with the strict trace reader, trace lines).
"""

from __future__ import annotations

import json
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvblocks.strict_json import StrictJSONError, parse

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@given(json_values)
def test_a_leading_byte_order_mark_is_ignored_in_text_and_bytes(value: object) -> None:
    text = json.dumps(value)
    assert parse("\ufeff" + text) == parse(text) == value
    assert parse(b"\xef\xbb\xbf" + text.encode()) == value


def test_a_byte_order_mark_anywhere_else_is_still_an_error() -> None:
    with pytest.raises(StrictJSONError):
        parse('{"a": 1}\ufeff')
    with pytest.raises(StrictJSONError):
        parse("\ufeff\ufeff{}")


def test_an_integer_beyond_the_digit_limit_is_named_without_python_s_advice_to_the_programmer() -> None:
    with pytest.raises(StrictJSONError) as refused:
        parse('{"token_ids": [' + "9" * 5000 + "]}")
    message = str(refused.value)
    assert message == f"not valid JSON: an integer of more than {sys.get_int_max_str_digits():,} digits"
    assert "set_int_max_str_digits" not in message
