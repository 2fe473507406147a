"""A tier added from test code alone: a keyed tier (the medium storage uses) over a peer node's memory, one class
(``tests/support/peer_tier.py``) plus one registry entry, here. ``TierConfig(kinds=...)`` then puts it under a
manager's device blocks, and the manager writes committed blocks into it and loads them back for another manager,
through the same plans, polls and checks the built-in storage tier goes through. The manager contract suite runs
its state machine over it too (the "peer" tier)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from kvblocks import KVCacheManager
from kvblocks.errors import ConfigError, InvalidArgumentError
from kvblocks.hashing import BlockHash
from kvblocks.tiers import TierConfig
from kvblocks.tiers.host import HostTier
from kvblocks.tiers.kinds import TIER_KINDS, TierPlace, register_tier_kind, unregister_tier_kind
from kvblocks.tiers.protocol import KeyedTier, SlotTier
from tests.support.peer_tier import PeerTier

BLOCK = 4
PAYLOAD = 8  # bytes a block's KV takes on the peer


@pytest.fixture
def peer_memory() -> Iterator[dict[BlockHash, bytes]]:
    memory: dict[BlockHash, bytes] = {}

    def build(place: TierPlace) -> PeerTier | None:
        return PeerTier(memory) if place.number == 0 else None  # full attention only

    register_tier_kind("peer", build)
    try:
        yield memory
    finally:
        unregister_tier_kind("peer")


def kv_of(tokens: Sequence[int]) -> bytes:
    """A block's KV in this test: a function of the tokens it holds (and only them)."""
    return bytes((t * 7 + i) % 256 for i, t in enumerate(tokens)).ljust(PAYLOAD, b"\0")


def node(**tiers: object) -> KVCacheManager:
    return KVCacheManager(16, BLOCK, tiers=TierConfig(**tiers))  # type: ignore[arg-type]


def test_the_toy_tier_meets_the_keyed_protocol_and_the_built_in_ones_theirs() -> None:
    assert isinstance(PeerTier({}), KeyedTier)
    assert not isinstance(PeerTier({}), SlotTier)
    assert isinstance(HostTier(2), SlotTier)


def test_a_registered_tier_takes_write_through_blocks_and_serves_them_to_another_node(
    peer_memory: dict[BlockHash, bytes],
) -> None:
    prompt = list(range(100, 114))  # 3 full blocks and 2 tokens
    first = node(kinds=("peer",), storage_policy="write-through")
    assert isinstance(first.storage, PeerTier)
    first.add_sequence("a", prompt)
    first.allocate("a", len(prompt))
    first.commit("a", len(prompt))
    plan = first.take_transfers()
    (saves,) = [part.saves for part in plan.group_transfers]
    assert [save.tier for save in saves] == ["device"] * 3
    table = first.block_table("a")
    assert [save.block for save in saves] == table[:3]
    payloads = [kv_of(prompt[i * BLOCK : (i + 1) * BLOCK]) for i in range(3)]
    first.complete_transfers(plan, saved={0: payloads})
    assert sorted(peer_memory.values()) == sorted(payloads)

    second = node(kinds=("peer",), storage_policy="write-through")
    second.add_sequence("b", [*prompt[:12], 7, 7, 7])
    assert second.lookup("b").storage == 12
    second.allocate("b", 15)
    assert not second.is_ready("b")
    second.take_transfers()
    (result,) = second.poll_loads()
    assert result.seq_id == "b"
    assert result.blocks == tuple(second.block_table("b")[:3])
    assert [bytes(p[0]) for p in result.payloads] == payloads
    assert second.is_ready("b")
    assert second.num_computed_tokens("b") == 12
    second.check_integrity()


def test_the_toy_tier_refuses_a_wrong_payload_and_nothing_changes(peer_memory: dict[BlockHash, bytes]) -> None:
    m = node(kinds=("peer",), storage_policy="write-through")
    m.add_sequence("a", list(range(8)))
    m.allocate("a", 8)
    m.commit("a", 8)
    plan = m.take_transfers()
    with pytest.raises(InvalidArgumentError, match="payload per block"):
        m.complete_transfers(plan, saved={0: [b"short", kv_of(range(4, 8))]})
    assert peer_memory == {}
    m.complete_transfers(plan, saved={0: [kv_of(range(4)), kv_of(range(4, 8))]})
    assert len(peer_memory) == 2


def test_a_slot_tier_stays_above_the_toy_tier(peer_memory: dict[BlockHash, bytes]) -> None:
    """Blocks evicted from the device go to host; a host entry evicted for room goes to the peer, saved from
    its host block before the swap-out that overwrites it."""
    m = KVCacheManager(2, BLOCK, tiers=TierConfig(kinds=("host", "peer"), num_host_blocks=1))
    assert isinstance(m.host, HostTier) and isinstance(m.storage, PeerTier)
    for n, seq in enumerate("abc"):
        tokens = list(range(10 * n, 10 * n + 8))  # two full blocks each, nothing shared
        m.add_sequence(seq, tokens)
        m.allocate(seq, 8)  # evicts the previous sequence's two cached blocks
        m.commit(seq, 8)
        m.free(seq)
        plan = m.take_transfers()
        (part,) = plan.group_transfers
        payloads = [kv_of(range(10 * (n - 1) + 4 * i, 10 * (n - 1) + 4 * i + 4)) for i in range(2)] if n else []
        if n == 0:
            assert not plan
        elif n == 1:  # a's first block to host; its second finds host full (pending) and goes to the peer
            assert [s.tier for s in part.saves] == ["device"] and len(part.swap_outs) == 1
            m.complete_transfers(plan, saved={0: payloads[1:]})
        else:  # b's blocks: the host entry (a's first) is saved from host before b's first overwrites it
            assert [s.tier for s in part.saves] == ["host", "device"] and len(part.swap_outs) == 1
            m.complete_transfers(plan, saved={0: [kv_of(range(4)), payloads[1]]})
    assert sorted(peer_memory.values()) == sorted([kv_of(range(4)), kv_of(range(4, 8)), kv_of(range(14, 18))])
    m.check_integrity()
    with pytest.raises(ConfigError, match="slot tier above one keyed"):
        KVCacheManager(2, BLOCK, tiers=TierConfig(kinds=("peer", "host"), num_host_blocks=1))


def test_unknown_and_doubled_kinds_are_refused(peer_memory: dict[BlockHash, bytes]) -> None:
    with pytest.raises(ConfigError, match="unknown tier kinds"):
        node(kinds=("host", "nvme"), num_host_blocks=2)
    with pytest.raises(ConfigError, match="distinct"):
        TierConfig(kinds=("peer", "peer"))
    with pytest.raises(ConfigError, match="already registered"):
        register_tier_kind("peer", lambda place: None)
    with pytest.raises(ConfigError, match="may be removed"):
        unregister_tier_kind("host")
    assert set(TIER_KINDS) == {"host", "storage", "peer"}


def test_a_kind_that_builds_nothing_leaves_the_manager_untiered(peer_memory: dict[BlockHash, bytes]) -> None:
    m = node(kinds=("host", "storage"))  # no host blocks, no backend: nothing below the device
    assert m.host is None and m.storage is None
    assert m.take_transfers().group_transfers == ()


class _HalfTier:
    """Says it is keyed but answers none of the keyed calls."""

    medium = "keyed"


@pytest.mark.parametrize("made", [object(), _HalfTier(), "storage"], ids=["object", "half-a-tier", "str"])
def test_a_kind_that_builds_something_else_than_a_tier_is_refused(made: object) -> None:
    register_tier_kind("odd", lambda place: made)  # type: ignore[arg-type,return-value]
    try:
        with pytest.raises(ConfigError, match="neither a SlotTier nor a KeyedTier"):
            node(kinds=("odd",))
    finally:
        unregister_tier_kind("odd")


def test_a_stack_refused_halfway_closes_the_tiers_it_built() -> None:
    """Storage above host is refused once both are built: the storage tier's threads stop again."""
    closed: list[str] = []

    class Closing(PeerTier):
        def close(self, timeout: float | None) -> None:
            closed.append("peer")

    register_tier_kind("closing", lambda place: Closing({}))
    try:
        with pytest.raises(ConfigError, match="slot tier above one keyed"):
            node(kinds=("closing", "host"), num_host_blocks=2)
        assert closed == ["peer"]
    finally:
        unregister_tier_kind("closing")
