"""CachedTokens refuses impossible breakdowns; counters separate admissions from re-admissions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvblocks import CachedTokens, HitCounters
from kvblocks.errors import AccountingError


def test_total_and_to_compute() -> None:
    c = CachedTokens(16, 32, 8, num_prompt_tokens=100)
    assert (c.device, c.host, c.storage, c.total, c.to_compute) == (16, 32, 8, 56, 44)


@given(device=st.integers(0, 300), host=st.integers(0, 300), storage=st.integers(0, 300), prompt=st.integers(0, 600))
def test_total_never_exceeds_the_prompt(device: int, host: int, storage: int, prompt: int) -> None:
    if device + host + storage <= prompt:
        assert CachedTokens(device, host, storage, num_prompt_tokens=prompt).total == device + host + storage
    else:
        with pytest.raises(AccountingError, match="exceed"):
            CachedTokens(device, host, storage, num_prompt_tokens=prompt)


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((-1,), {"num_prompt_tokens": 5}),
        ((1.0,), {"num_prompt_tokens": 5}),
        ((True,), {"num_prompt_tokens": 5}),
        ((0,), {"num_prompt_tokens": -1}),
        ((1,), {}),
    ],
)
def test_bad_parts_are_refused(args, kwargs) -> None:
    with pytest.raises(AccountingError):
        CachedTokens(*args, **kwargs)


def test_cached_tokens_is_immutable() -> None:
    c = CachedTokens(4, num_prompt_tokens=8)
    with pytest.raises(AttributeError):
        c.device = 8  # type: ignore[misc]


def test_counters_keep_readmissions_apart() -> None:
    counters = HitCounters()
    counters.record(CachedTokens(10, 2, 0, num_prompt_tokens=20), readmission=False)
    counters.record(CachedTokens(5, num_prompt_tokens=30), readmission=True)
    d = counters.as_dict()
    assert (d["admissions"], d["queried_tokens"], d["hit_tokens_device"], d["hit_tokens_host"]) == (1, 20, 10, 2)
    assert (d["readmissions"], d["readmission_queried_tokens"], d["readmission_hit_tokens_device"]) == (1, 30, 5)
