"""A role added from this file alone: one facade (its calls) and one component (what the manager asks it), registered
once; ``manager_for_role`` then builds it over any group layout and tiers, and the manager consults it at every
point where a sequence may change or leave -- the same seam the prefill and decode roles use."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any, ClassVar

import pytest

from kvblocks import CacheConfig, DisaggConfig, KVCacheManager, manager_for_role
from kvblocks.accounting import CachedTokens
from kvblocks.core.sequence import _Sequence
from kvblocks.disagg import ROLE_MANAGERS, register_role, unregister_role
from kvblocks.errors import ConfigError, IntegrityError, SequenceStateError
from kvblocks.hybrid import LocalGroup
from kvblocks.tiers import TierConfig


class ReviewRole:
    """A toy role: sequences can be put on hold (they may not grow, commit, be preempted or freed until released),
    and the role keeps every admission's hits per request."""

    name = "review"

    def __init__(self, manager: ReviewManager, disagg: DisaggConfig) -> None:
        self.held: set[Hashable] = set()
        self.admissions: dict[Hashable, list[CachedTokens]] = {}
        manager._review = self

    def guard(self, seq_id: Hashable, what: str) -> None:
        if seq_id in self.held:
            raise SequenceStateError(f"sequence {seq_id!r} is on hold; it cannot {what}")

    def admitted(self, seq_id: Hashable, cached: CachedTokens) -> None:
        self.admissions.setdefault(seq_id, []).append(cached)

    def leaving(self, seq_id: Hashable, *, freeing: bool) -> None:
        self.guard(seq_id, "be freed" if freeing else "be preempted")

    def forget(self, seq_id: Hashable) -> None:
        self.admissions.pop(seq_id, None)

    def window_token(self, s: _Sequence) -> int:
        return s.num_committed

    def check(self, manager: Any) -> None:
        if not self.held <= set(manager._seqs):
            raise IntegrityError("a sequence on hold left")


class ReviewManager(KVCacheManager):
    role: ClassVar[str] = "review"
    _role_component = ReviewRole
    _review: ReviewRole

    def hold(self, seq_id: Hashable) -> None:
        self._get(seq_id)
        self._review.held.add(seq_id)

    def release_hold(self, seq_id: Hashable) -> None:
        self._review.held.discard(seq_id)

    def admissions_of(self, seq_id: Hashable) -> list[CachedTokens]:
        return list(self._review.admissions.get(seq_id, ()))


@pytest.fixture
def review_role() -> Iterator[None]:
    register_role(ReviewManager)
    try:
        yield
    finally:
        unregister_role("review")


@pytest.mark.parametrize("tiered", [False, True])
@pytest.mark.parametrize("hybrid", [False, True])
def test_a_role_added_from_a_test_file_is_built_and_asked_by_the_manager(
    review_role: None, tiered: bool, hybrid: bool
) -> None:
    tiers = TierConfig(num_host_blocks=8) if tiered else None
    groups = [LocalGroup("sliding_window", span=8, num_blocks=16)] if hybrid else []
    m = manager_for_role(CacheConfig(16, 4), DisaggConfig(role="review"), tiers=tiers, groups=groups)
    assert type(m) is ReviewManager and m.role == "review" and ROLE_MANAGERS["review"] is ReviewManager
    assert isinstance(m, ReviewManager)
    prompt = list(range(10))
    m.add_sequence("a", prompt)
    assert m.allocate("a", 10) is not None
    m.commit("a", 10)
    m.hold("a")
    before = (m.num_allocated_tokens("a"), m.num_computed_tokens("a"), m.num_free_blocks)
    calls = [
        lambda: m.allocate("a", 1),
        lambda: m.commit("a", 10),
        lambda: m.preempt("a"),
        lambda: m.free("a"),
        lambda: m.step(["a"], [10], [[7]]),  # the batched step asks the role before anything changes
    ]
    for call in calls:
        with pytest.raises(SequenceStateError, match="on hold"):
            call()
    assert (m.num_allocated_tokens("a"), m.num_computed_tokens("a"), m.num_free_blocks) == before
    assert m.num_tokens("a") == 10
    m.check_integrity()
    m.release_hold("a")
    m.free("a")
    m.add_sequence("b", prompt + [99])
    assert m.allocate("b", 11 - m.lookup("b").total) is not None
    assert [c.device for c in m.admissions_of("b")] == [8]  # a's two full blocks, counted by the manager once
    assert m.stats.hit_tokens_device == 8
    m.check_integrity()
    m.close()


def test_registering_a_role_is_for_new_names_and_real_facades_only(review_role: None) -> None:
    with pytest.raises(ConfigError, match="already registered"):
        register_role(ReviewManager)
    with pytest.raises(ConfigError, match="KVCacheManager subclass"):
        register_role(object)  # type: ignore[arg-type]

    class Nameless(KVCacheManager):
        role: ClassVar[str] = "nameless"

    with pytest.raises(ConfigError, match="no role component"):
        register_role(Nameless)
    with pytest.raises(ConfigError, match="built in"):
        unregister_role("decode")
    with pytest.raises(ConfigError, match="role must be one of mixed, prefill, decode, review"):
        DisaggConfig(role="nameless")


def test_an_unregistered_role_is_unknown_again() -> None:
    register_role(ReviewManager)
    unregister_role("review")
    with pytest.raises(ConfigError, match="role must be one of mixed, prefill, decode; got 'review'"):
        DisaggConfig(role="review")
    with pytest.raises(ConfigError, match="unknown role"):
        unregister_role("review")
