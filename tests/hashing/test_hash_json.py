"""The JSON form of block hashes (what handoffs and event batches carry), and the handoff's batch checks of wire
counts: each fast path gives exactly what its one-value-at-a-time definition gives."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvblocks.disagg.handoff import PLACEHOLDER, _are_wire_counts
from kvblocks.errors import InvalidBlockHashError
from kvblocks.hashing import hashes_from_json, hashes_to_json
from kvblocks.strict_json import MAX_INT

widths = st.integers(min_value=1, max_value=40)


@given(widths.flatmap(lambda w: st.lists(st.binary(min_size=w, max_size=w), max_size=64)))
def test_bytes_hashes_of_one_width_round_trip_through_one_packed_string(hashes: list[bytes]) -> None:
    encoded = hashes_to_json(hashes)
    if hashes:
        assert isinstance(encoded, str) and encoded.startswith(f"{len(hashes[0])}:")
    decoded = hashes_from_json(encoded)
    assert decoded == tuple(hashes)
    assert all(type(h) is bytes for h in decoded)


@given(widths, st.binary(max_size=200))
def test_a_packed_string_is_cut_into_its_width(width: int, data: bytes) -> None:
    text = f"{width}:{data.hex()}"
    if len(data) % width:
        with pytest.raises(InvalidBlockHashError):
            hashes_from_json(text)
    else:
        assert hashes_from_json(text) == tuple(data[k : k + width] for k in range(0, len(data), width))


@pytest.mark.parametrize("text", ["16:" + "0" * 31, "2: 0102", "2:01 02", "0:", "x:0102", "2:zz", "-2:0102", "2:"])
def test_a_malformed_packed_string_is_refused(text: str) -> None:
    if text == "2:":  # no blocks at all: an empty chain
        assert hashes_from_json(text) == ()
        return
    with pytest.raises(InvalidBlockHashError):
        hashes_from_json(text)


wire_values = st.one_of(
    st.integers(min_value=-3, max_value=3),
    st.integers(min_value=MAX_INT - 2, max_value=MAX_INT + 2),
    st.integers(),
    st.booleans(),
    st.floats(allow_nan=False),
    st.text(max_size=2),
    st.none(),
)


@given(st.lists(wire_values, max_size=12).map(tuple), st.sampled_from([0, PLACEHOLDER]))
def test_the_batch_check_of_wire_counts_equals_checking_each_value(values: tuple[object, ...], lowest: int) -> None:
    each = all(type(v) is int and lowest <= v <= MAX_INT for v in values)
    assert _are_wire_counts(values, lowest) is each


def test_a_packed_run_longer_than_what_struct_cuts_decodes_the_same() -> None:
    from kvblocks.hashing.encoding import _CUT_IN_C

    for count in (_CUT_IN_C, _CUT_IN_C + 1):
        data = bytes(range(256)) * (count * 2 // 256 + 1)
        data = data[: count * 2]
        assert hashes_from_json(f"2:{data.hex()}") == tuple(data[k : k + 2] for k in range(0, len(data), 2))
