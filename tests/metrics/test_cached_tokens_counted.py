"""CachedTokens.counted: the unchecked constructor the admission path uses builds what the checked one does."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvblocks import AccountingError
from kvblocks.accounting import CachedTokens

counts = st.integers(0, 1 << 40)


@given(counts, counts, counts, counts)
def test_counted_equals_the_checked_constructor(device: int, host: int, storage: int, extra: int) -> None:
    prompt = device + host + storage + extra
    made = CachedTokens.counted(device, prompt, host, storage)
    checked = CachedTokens(device, host, storage, num_prompt_tokens=prompt)
    assert made == checked and hash(made) == hash(checked) and repr(made) == repr(checked)
    assert dataclasses.asdict(made) == dataclasses.asdict(checked)
    assert (made.total, made.to_compute) == (checked.total, checked.to_compute)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.device = 0  # type: ignore[misc]


def test_the_checked_constructor_still_refuses_what_counted_takes_on_trust() -> None:
    with pytest.raises(AccountingError):
        CachedTokens(64, 64, num_prompt_tokens=100)
    assert CachedTokens.counted(64, 100, 64).total == 128  # the caller vouches for its counts
