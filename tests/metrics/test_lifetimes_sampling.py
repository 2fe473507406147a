"""BlockLifetimes.passes_over: the evicting path's shortcut observes exactly the evictions observe alone would."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvblocks.accounting import BlockLifetimes

batches = st.lists(
    st.tuples(st.integers(1, 40), st.one_of(st.none(), st.integers(1, 8))),  # (evicted, sample_every set before)
    max_size=30,
)


def _feed(lifetimes: BlockLifetimes, evicted: int, first: int, shortcut: bool) -> None:
    blocks = list(range(first, first + evicted))
    taken_at = [0.0] * (first + evicted)
    pairs = [(b, float(b)) for b in blocks]  # each eviction's idle time tells which one was observed
    if shortcut and lifetimes.passes_over(evicted):
        return
    lifetimes.observe(float(first + evicted) * 10, taken_at, iter(pairs), evicted)


@given(batches)
def test_passing_over_observes_exactly_what_observe_alone_does(plan: list[tuple[int, int | None]]) -> None:
    plain, quick = BlockLifetimes(sample_every=3), BlockLifetimes(sample_every=3)
    first = 0
    for evicted, every in plan:
        if every is not None:  # sample_every may change between evictions
            plain.sample_every = quick.sample_every = every
        _feed(plain, evicted, first, shortcut=False)
        _feed(quick, evicted, first, shortcut=True)
        first += evicted
        assert quick.idle.counts == plain.idle.counts
        assert quick.idle.sum == plain.idle.sum
        assert quick.lifetime.sum == plain.lifetime.sum
        assert quick._skip == plain._skip


def test_passes_over_refuses_a_batch_holding_a_due_sample() -> None:
    lifetimes = BlockLifetimes(sample_every=4)
    assert not lifetimes.passes_over(1)  # the first eviction is due: nothing counted
    assert lifetimes._skip == 0
    lifetimes.observe(1.0, [0.0], iter([(0, 0.5)]), 1)  # observed: the next three are not due
    assert lifetimes.passes_over(3) and lifetimes._skip == 0
    assert not lifetimes.passes_over(1)
