"""Damaged stored entries for fuzz tests: whatever a file or a shared store may come to hold."""

from __future__ import annotations

from hypothesis import strategies as st

from kvblocks.tiers.entry import HEADER


def damaged(entry: bytes, data: st.DataObject) -> bytes:
    """``entry`` with one damage drawn from ``data``: a flipped byte, cut short (anywhere, to its header,
    to a few bytes), extended, or replaced by random bytes."""
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "random", "header-only", "tiny"]))
    if how == "flip":
        at = data.draw(st.integers(0, len(entry) - 1))
        return entry[:at] + bytes([entry[at] ^ data.draw(st.integers(1, 255))]) + entry[at + 1 :]
    if how == "truncate":
        return entry[: data.draw(st.integers(0, len(entry) - 1))]
    if how == "extend":
        return entry + data.draw(st.binary(min_size=1, max_size=300))
    if how == "header-only":
        return entry[: HEADER.size]
    if how == "tiny":
        return entry[: data.draw(st.integers(0, 12))]
    return data.draw(st.binary(max_size=2 * len(entry)))
