"""A new eviction policy is one class plus one registry entry: a toy one, defined here, runs a manager."""

from __future__ import annotations

from collections.abc import MutableSequence, Sequence

import pytest

from kvblocks import KVCacheManager
from kvblocks.errors import ConfigError, IntegrityError
from kvblocks.eviction import EVICTION_POLICIES, register_eviction_policy, unregister_eviction_policy


class MostRecentFirst:
    """Evicts the most recently released idle block first (a toy: the opposite of LRU)."""

    name = "toy_mru"

    def __init__(self, num_blocks: int = 0, keys: Sequence[object] = ()) -> None:
        self.idle: dict[int, float] = {}  # insertion order: oldest release first

    def touch(self, block: int) -> None:
        self.idle[block] = self.idle.pop(block)

    def remove(self, block: int) -> None:
        del self.idle[block]

    def victims(
        self,
        count: int,
        blockers: MutableSequence[int] | None = None,
        parent: Sequence[int] | None = None,
        stamps: list[float] | None = None,
    ) -> list[int]:
        out: list[int] = []
        while len(out) < count and self.idle:
            unblocked = [b for b in reversed(self.idle) if blockers is None or not blockers[b]]
            if not unblocked:
                raise IntegrityError("every idle block is blocked")
            b = unblocked[0]
            stamp = self.idle.pop(b)
            if stamps is not None:
                stamps.append(stamp)
            if blockers is not None and parent is not None:
                blockers[parent[b]] -= 1
            out.append(b)
        return out

    def check_integrity(self) -> None:
        """Nothing of its own to check: the pool checks the idle set."""


@pytest.fixture
def toy_policy():
    register_eviction_policy("toy_mru", MostRecentFirst)
    try:
        yield "toy_mru"
    finally:
        unregister_eviction_policy("toy_mru")


A = [0, 1, 2, 3, 4]
B = [10, 11, 12, 13, 14]
C = [20, 21, 22, 23, 24]


def survivor(eviction: str) -> tuple[int, int]:
    """Cache A's block, then B's (released later); C's admission evicts one of them: what is still cached."""
    m = KVCacheManager(3, 4, eviction=eviction)
    for seq, prompt in (("a", A), ("b", B)):
        m.add_sequence(seq, prompt)
        assert m.allocate(seq, 5) is not None
        m.commit(seq, 5)
        m.free(seq)
    m.add_sequence("c", C)
    assert m.allocate("c", 5) is not None  # one fresh block and one eviction
    m.check_integrity()
    return m.match(A).device, m.match(B).device


def test_a_policy_registered_from_a_test_file_decides_what_a_manager_evicts(toy_policy: str) -> None:
    assert survivor("lru") == (0, 4)  # LRU evicts A's block, released first
    assert survivor(toy_policy) == (4, 0)  # the toy evicts B's, released last


def test_registering_is_for_new_names_only(toy_policy: str) -> None:
    assert EVICTION_POLICIES[toy_policy] is MostRecentFirst
    with pytest.raises(ConfigError, match="already registered"):
        register_eviction_policy(toy_policy, MostRecentFirst)
    with pytest.raises(ConfigError, match="built in"):
        unregister_eviction_policy("lru")
    with pytest.raises(ConfigError, match="without ':'"):
        register_eviction_policy("toy:1", MostRecentFirst)
    with pytest.raises(ConfigError, match="callable"):
        register_eviction_policy("toy_two", 3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        KVCacheManager(3, 4, eviction="toy_two")
