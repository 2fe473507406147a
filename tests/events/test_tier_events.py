"""Host and storage tier events: exact (a shadow built only from events equals every tier at every step),
emitted on the manager's thread, snapshotted, tagged per group, and scored by a precise-mode Router."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvblocks.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventConsumer,
    EventPublisher,
    EventRecord,
    EventSink,
    KVEvent,
)
from kvblocks.events.transport import InProcessTransport, pump
from kvblocks.hashing import BlockHash
from kvblocks.hybrid import LocalGroup, TieredHybridKVCacheManager
from kvblocks.routing import Router, RouterConfig
from kvblocks.tiers import EntryFormat, MemoryStorage, TierConfig, TieredKVCacheManager
from tests.support.tier_sim import FORMAT, SimEngine, content_of

B = 4
A = list(range(17))  # 4 full blocks + 1 token
OTHER = list(range(100, 117))
PREFIXES = [list(range(1000 * p, 1000 * p + 12)) for p in range(5)]
WEIGHTS = dict(RouterConfig(block_size=B).tier_weights)

_Tag = tuple[int | None, str | None]


class Shadow:
    """Per (tier, group tag): the set of hashes the events say are there. Strict: an event that stores a
    hash already there, or removes one that is not, is an extra event and fails the test."""

    def __init__(self, *, chains_seen: bool = True) -> None:
        """``chains_seen``: every host block's chain came in a device event first (a consumer from the start;
        one that joins with a snapshot checks the chains it knows)."""
        self.chains_seen = chains_seen
        self.sets: dict[tuple[str, _Tag], set[BlockHash]] = {}
        self.threads: set[int] = set()
        self.events: list[KVEvent] = []
        self.chains: dict[BlockHash, tuple[BlockHash | None, tuple[int, ...]]] = {}  # from device events

    def of(self, tier: str, tag: _Tag = (None, None)) -> set[BlockHash]:
        return self.sets.get((tier, tag), set())

    def record(self, record: EventRecord) -> None:
        self.threads.add(threading.get_ident())
        self.apply(record.event)

    def apply(self, event: KVEvent) -> None:
        self.events.append(event)
        held = self.sets.setdefault((event.tier, (event.group, event.group_kind)), set())
        if isinstance(event, BlockStored):
            again = held.intersection(event.block_hashes)
            assert not again, f"{event.tier}: stored again {again}"
            assert len(set(event.block_hashes)) == len(event.block_hashes)
            links = [
                (h, event.parent_hash if i == 0 else event.block_hashes[i - 1])
                for i, h in enumerate(event.block_hashes)
            ]
            tokens = None if event.token_ids is None else tuple(event.token_ids)
            if event.tier == "device" and tokens is not None:
                for i, (h, parent) in enumerate(links):
                    self.chains[h] = (parent, tokens[i * B : (i + 1) * B])
            elif event.tier == "host" and tokens is None:  # a local group's blocks: a batch, no chain
                assert event.parent_hash is None and event.block_size == B
            elif event.tier == "host":  # a written-back run names its chain, as the device said it
                assert event.block_size == B
                for i, (h, parent) in enumerate(links):
                    if self.chains_seen or h in self.chains:
                        assert self.chains[h] == (parent, tokens[i * B : (i + 1) * B])
            elif event.tier != "device":  # storage: a batch, no chain parent; the block size is said
                assert event.parent_hash is None and event.block_size == B
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            absent = set(event.block_hashes) - held
            assert not absent, f"{event.tier}: removed {absent}, never stored"
            held.difference_update(event.block_hashes)
        else:
            assert isinstance(event, AllBlocksCleared)
            held.clear()


def device_hashes(m: TieredKVCacheManager) -> set[BlockHash]:
    tree = m.tree
    return {h for h in (tree.hash_of(b) for b in range(m.num_blocks)) if h is not None}


def host_hashes(m: TieredKVCacheManager) -> set[BlockHash]:
    return set(m.host.hashes()) if m.host is not None else set()


def stored_hashes(m: TieredKVCacheManager) -> set[BlockHash]:
    return set(m.storage.known_hashes()) if m.storage is not None else set()


class TierEventsMachine(RuleBasedStateMachine):
    """Random traffic through device, host and storage; the events alone must rebuild every tier."""

    @initialize(
        host=st.sampled_from([0, 3, 6]),
        host_policy=st.sampled_from(["write-back", "write-through"]),
        storage_policy=st.sampled_from(["write-back", "write-through", "off"]),
        budget=st.sampled_from([None, 6 * (FORMAT.payload_length + 100)]),
        index_size=st.sampled_from([3, 1 << 20]),
    )
    def setup(self, host: int, host_policy: str, storage_policy: str, budget: int | None, index_size: int) -> None:
        self.backend = MemoryStorage(byte_budget=budget)
        tiers = TierConfig(
            num_host_blocks=host,
            host_policy=host_policy,
            storage=self.backend,
            entry_format=FORMAT,
            storage_policy=storage_policy,
            save_on_preempt=True,
            storage_timeout_s=2.0,
            storage_index_size=index_size,
        )
        self.sink = EventSink()
        self.shadow = Shadow()
        self.sink.subscribe(self.shadow.record)
        self.m = TieredKVCacheManager(10, B, tiers=tiers, event_sink=self.sink)
        self.sim = SimEngine(self.m, settle=True)
        self.counter = 0
        self.live: dict[str, list[int]] = {}
        self.served = list(range(len(PREFIXES)))  # prefixes, least recently served first
        self.drained = False  # the last manager call was poll_loads after the I/O threads went idle

    def teardown(self) -> None:
        if hasattr(self, "m"):
            self.m.close(timeout=1)

    def _tokens(self, prefix: int, extra: int) -> list[int]:
        return PREFIXES[prefix] + [prefix * 7 + i for i in range(extra)]

    def _make_room(self) -> None:
        """At most 2 live sequences: the oldest leaves (so traffic keeps flowing through the tiers)."""
        if len(self.live) >= 2:
            oldest = min(self.live, key=lambda s: int(s[1:]))
            self.m.free(oldest)
            del self.live[oldest]

    def _pick(self, data, admitted: bool | None = None, ready: bool = False) -> str | None:
        m = self.m
        names = [
            s for s in self.live if (admitted is None or m.is_admitted(s) == admitted) and (not ready or m.is_ready(s))
        ]
        choice = data.draw(st.integers(0, 7))
        return sorted(names)[choice % len(names)] if names else None

    @rule(prefix=st.integers(0, 4), extra=st.integers(1, 9))
    def add(self, prefix: int, extra: int) -> None:
        self.drained = False
        self._make_room()
        seq = f"s{self.counter}"
        self.counter += 1
        self.m.add_sequence(seq, self._tokens(prefix, extra))
        self.live[seq] = self._tokens(prefix, extra)

    @rule(extra=st.integers(1, 9), keep=st.integers(0, 3))
    def serve_oldest(self, extra: int, keep: int) -> None:
        """The prefix served longest ago comes back: the one most likely to be on host or in storage only."""
        self.serve(prefix=self.served[0], extra=extra, keep=keep)

    @rule(prefix=st.integers(0, 4), extra=st.integers(1, 9), keep=st.integers(0, 3))
    def serve(self, prefix: int, extra: int, keep: int) -> None:
        """A whole request: admit, wait for its copies, compute, commit; free it (kept admitted 1 in 4)."""
        self.drained = False
        self.served.remove(prefix)
        self.served.append(prefix)
        self._make_room()
        seq = f"s{self.counter}"
        self.counter += 1
        tokens = self._tokens(prefix, extra)
        m = self.m
        m.add_sequence(seq, tokens)
        self.live[seq] = tokens
        self.sim.step()
        if m.allocate(seq, len(tokens) - m.lookup(seq).total) is None:
            return
        self.sim.wait_ready(seq)
        if len(m.block_table(seq)) * B < len(tokens):
            if m.allocate(seq, len(tokens) - m.num_computed_tokens(seq)) is None:
                return
            self.sim.step()
        self.sim.compute(seq, len(tokens))
        m.commit(seq, len(tokens))
        if keep:
            m.free(seq)
            del self.live[seq]

    @rule(data=st.data())
    def admit(self, data) -> None:
        self.drained = False
        seq = self._pick(data, admitted=False)
        if seq is not None:
            self.m.allocate(seq, len(self.live[seq]) - self.m.lookup(seq).total)

    @rule()
    def step(self) -> None:
        self.sim.step()
        self.drained = True

    @rule(data=st.data())
    def compute(self, data) -> None:
        self.drained = False
        self.sim.step()
        seq = self._pick(data, admitted=True, ready=True)
        if seq is None:
            return
        tokens = self.live[seq]
        short = len(self.m.block_table(seq)) * B < len(tokens)
        if short and self.m.allocate(seq, len(tokens) - self.m.num_computed_tokens(seq)) is None:
            return
        self.sim.compute(seq, len(tokens))
        self.m.commit(seq, len(tokens))

    @rule(data=st.data())
    def free(self, data) -> None:
        self.drained = False
        seq = self._pick(data)
        if seq is not None:
            self.m.free(seq)
            del self.live[seq]

    @rule(data=st.data())
    def preempt(self, data) -> None:
        self.drained = False
        seq = self._pick(data, admitted=True)
        if seq is not None:
            self.m.preempt(seq)

    @rule(data=st.data(), everything=st.booleans())
    def lose_entries(self, data, everything: bool) -> None:
        """Another node's budget (or an operator) drops stored entries: a later read misses, the index forgets."""
        self.drained = False
        keys = sorted(self.backend._entries)
        if keys:
            self.backend.delete(keys if everything else [keys[data.draw(st.integers(0, len(keys) - 1))]])

    @rule(now=st.integers(0, 3))
    def reset(self, now: int) -> None:
        self.drained = False
        if not now:  # 1 in 4: a reset empties device and host, so most runs should fill them instead
            self.m.reset_prefix_cache()

    @invariant()
    def events_rebuild_every_tier(self) -> None:
        if not hasattr(self, "m"):
            return
        m, shadow = self.m, self.shadow
        assert shadow.threads <= {threading.get_ident()}  # never emitted from an I/O thread
        assert shadow.of("device") == device_hashes(m)
        assert shadow.of("host") == host_hashes(m)
        storage = m.storage
        assert storage.flush(5) and storage.wait_idle(5)
        if self.drained:  # the manager's own poll_loads emitted everything the threads had learnt
            assert shadow.of("storage") == stored_hashes(m)
        storage.publish()  # this thread drives the manager: what the threads learnt since, emitted now
        assert shadow.of("storage") == stored_hashes(m)
        assert set(shadow.sets) <= {("device", (None, None)), ("host", (None, None)), ("storage", (None, None))}
        fresh = Shadow(chains_seen=False)  # a consumer that joins now: the snapshot alone rebuilds every tier
        for event in m.snapshot_events():
            fresh.apply(event)
        for tier in ("device", "host", "storage"):
            assert fresh.of(tier) == shadow.of(tier), tier
        m.check_integrity()


TierEventsMachine.TestCase.settings = settings(
    max_examples=75, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_tier_events_state_machine = TierEventsMachine.TestCase


# ---------------------------------------------------------------- the router scores each tier by its weight


def _wire(r: Router, worker: Hashable, m: TieredKVCacheManager, sink: EventSink):
    """``m``'s events to ``r`` as a producer named ``worker``: publisher -> bytes -> consumer."""
    transport = InProcessTransport()
    publisher = EventPublisher(str(worker), sink, transport, snapshot=m.snapshot_events)
    consumer = EventConsumer(on_events=r.apply_events, on_snapshot=r.replace_index)

    def sync() -> None:
        publisher.publish()
        pump(transport, consumer)
        assert not consumer.needs_resync

    def resync() -> None:
        publisher.publish_snapshot()
        pump(transport, consumer)

    return sync, resync


def _evict_a_to_lower_tiers(m: TieredKVCacheManager) -> list[BlockHash]:
    """Serve A, then OTHER: A's 4 blocks leave the 5-block device for the tier below. Returns A's hashes."""
    sim = SimEngine(m, settle=True)
    sim.serve("a", A)
    m.add_sequence("b", OTHER)
    assert m.allocate("b", len(OTHER)) is not None  # evicts every block of a
    sim.step()
    m.flush(5)
    sim.step()
    m.add_sequence("probe", A)
    hashes = list(m.block_hashes("probe"))[:4]
    m.free("probe")
    m.free("b")
    assert not device_hashes(m) & set(hashes)
    return hashes


def test_a_precise_router_scores_host_and_storage_hits_with_their_tier_weights() -> None:
    r = Router(["host-node", "storage-node"], RouterConfig(block_size=B))
    host_sink, storage_sink = EventSink(), EventSink()
    with (
        TieredKVCacheManager(5, B, tiers=TierConfig(num_host_blocks=8), event_sink=host_sink) as on_host,
        TieredKVCacheManager(
            5, B, tiers=TierConfig(storage=MemoryStorage(), entry_format=FORMAT), event_sink=storage_sink
        ) as on_storage,
    ):
        host_sync, host_resync = _wire(r, "host-node", on_host, host_sink)
        storage_sync, storage_resync = _wire(r, "storage-node", on_storage, storage_sink)
        a = _evict_a_to_lower_tiers(on_host)
        assert _evict_a_to_lower_tiers(on_storage) == a
        assert set(a) <= host_hashes(on_host) and set(a) <= stored_hashes(on_storage)
        host_sync()
        storage_sync()
        expected = {"host-node": 4 * WEIGHTS["host"], "storage-node": 4 * WEIGHTS["storage"]}
        assert r.overlaps(a) == expected
        # a router that joins late (or lost events) rebuilds both tiers from the snapshots
        late = Router(["host-node", "storage-node"], RouterConfig(block_size=B))
        _, late_host = _wire(late, "host-node", on_host, EventSink())
        _, late_storage = _wire(late, "storage-node", on_storage, EventSink())
        late_host()
        late_storage()
        assert late.overlaps(a) == expected
        host_resync()
        storage_resync()
        assert r.overlaps(a) == expected
        # the host tier is emptied: the router stops crediting it
        assert on_host.reset_prefix_cache()
        host_sync()
        assert "host-node" not in r.overlaps(a)
        r.check_integrity()


def test_storage_events_are_emitted_on_the_managers_thread_only_at_its_calls() -> None:
    """The writer and reader threads learn what is stored; the sink hears of it at the next
    take_transfers / complete_transfers / poll_loads, on the thread that makes that call."""
    backend = MemoryStorage()
    config = TierConfig(storage=backend, entry_format=FORMAT, storage_policy="write-through")
    sink = EventSink()
    threads: list[int] = []
    sink.subscribe(lambda record: threads.append(threading.get_ident()))
    shadow = Shadow()
    sink.subscribe(shadow.record)
    main = threading.get_ident()
    with TieredKVCacheManager(8, B, tiers=config, event_sink=sink) as m:
        sim = SimEngine(m)
        sim.serve("a", A)
        plan = m.take_transfers()  # the write-through saves of a's 4 blocks
        m.complete_transfers(plan, saved=[content_of(s.block_hash) for s in plan.saves])
        assert m.flush(5) and len(stored_hashes(m)) == 4  # the writer thread knows them now ...
        assert not shadow.of("storage")  # ... but emitted nothing
        m.take_transfers()
        assert shadow.of("storage") == stored_hashes(m)
        # a read of an entry that vanished: the reader forgets it, poll_loads tells the sink
        backend.delete(m.storage.keys_of(next(iter(stored_hashes(m)))))
        m.reset_prefix_cache()  # device and tree emptied: the next admission reads storage
        m.add_sequence("c", A)
        assert m.storage.wait_idle(5)
        assert m.allocate("c", len(A) - m.lookup("c").total) is not None
        m.take_transfers()
        assert m.storage.wait_idle(5)
        before = len(shadow.events)
        sim.apply(m.poll_loads())
        assert any(isinstance(e, BlockRemoved) and e.tier == "storage" for e in shadow.events[before:])
        assert shadow.of("storage") == stored_hashes(m) and len(stored_hashes(m)) == 3
        # another node on the same store learns by probing; its sink hears at its own poll
        other_sink = EventSink()
        other = Shadow()
        other_sink.subscribe(other.record)
        with TieredKVCacheManager(
            8, B, tiers=TierConfig(storage=backend, entry_format=FORMAT), event_sink=other_sink
        ) as n:
            n.add_sequence("r", A)
            assert n.storage.wait_idle(5) and stored_hashes(n)
            assert not other.events
            n.poll_loads()
            assert other.of("storage") == stored_hashes(n)
            assert other.threads == {main}
    assert set(threads) == {main}


def test_no_sink_no_tier_events_and_no_notes() -> None:
    with TieredKVCacheManager(
        5,
        B,
        tiers=TierConfig(
            num_host_blocks=8, storage=MemoryStorage(), entry_format=FORMAT, storage_policy="write-through"
        ),
    ) as m:
        _evict_a_to_lower_tiers(m)
        assert m.host is not None and m.host._log is None and m.host.events is None
        assert m.storage is not None and m.storage._log is None and m.storage.events is None
        assert host_hashes(m) and stored_hashes(m)  # the tiers work as before


# ---------------------------------------------------------------- hybrid: local groups' tiers are tagged


def _hybrid(sink: EventSink) -> TieredHybridKVCacheManager:
    window_format = EntryFormat("xxh3-128", "uint8", (16,), 2, 16)
    tiers = TierConfig(
        num_host_blocks=2,
        group_host_blocks=(2,),
        storage=MemoryStorage(),
        entry_format=FORMAT,
        group_entry_formats=(window_format,),
    )
    return TieredHybridKVCacheManager(
        5, B, tiers=tiers, local_groups=[LocalGroup("sliding_window", span=6, num_blocks=5)], event_sink=sink
    )


def _full_only(events: Iterable[KVEvent]) -> list[KVEvent]:
    return [e for e in events if e.group_kind in (None, "full")]


def test_hybrid_tier_events_are_tagged_per_group_and_the_router_follows_the_full_group() -> None:
    sink = EventSink()
    shadow = Shadow()
    sink.subscribe(shadow.record)
    r = Router(["w"], RouterConfig(block_size=B))
    full_only = Router(["w"], RouterConfig(block_size=B))
    with _hybrid(sink) as m:
        sync, resync = _wire(r, "w", m, sink)
        m.add_sequence("a", A)
        m.allocate("a", 17)
        m.commit("a", 17)
        m.free("a")
        m.add_sequence("b", OTHER)
        m.allocate("b", 17)  # evicts a's blocks in both groups: 2 to each host tier, the rest saved
        plan = m.take_transfers()
        m.complete_transfers(
            plan,
            saved=[content_of(s.block_hash) for s in plan.saves],
            saved_groups={1: [bytes(16)] * len(plan.groups[0].saves)},
        )
        assert m.flush(5)
        m.take_transfers()
        tags = {(e.tier, e.group, e.group_kind) for e in shadow.events}
        assert {("host", 0, "full"), ("storage", 0, "full")} <= tags
        assert {("host", 1, "sliding_window"), ("storage", 1, "sliding_window")} <= tags
        assert all(e.group is not None for e in shadow.events)  # a hybrid manager tags everything
        # per group and tier, the events rebuild exactly what that tier holds
        for group, kind in ((0, "full"), (1, "sliding_window")):
            host, storage = m.group_host(group), m.group_storage(group)
            assert shadow.of("host", (group, kind)) == set(host.hashes()) != set()
            assert shadow.of("storage", (group, kind)) == set(storage.known_hashes()) != set()
        # the router indexes the full group only: exactly what a router fed the full group's events holds
        sync()
        full_only.apply_events("w", _full_only(shadow.events))
        m.free("b")
        m.add_sequence("c", A)
        a = list(m.block_hashes("c"))[:4]
        full_host = set(m.group_host(0).hashes())
        expected = sum(WEIGHTS["host"] if h in full_host else WEIGHTS["storage"] for h in a)
        assert r.overlaps(a) == full_only.overlaps(a) == {"w": expected}
        assert len(full_host & set(a)) == 2  # both tiers below the device count, each with its weight
        # the window group's events name the same hashes in other tiers: applied as the prefix's, they would
        # credit a's blocks the group-0 storage tier holds at the window group's host weight
        blind = Router(["w"], RouterConfig(block_size=B))
        blind.apply_events("w", [replace(e, group=None, group_kind=None) for e in shadow.events])
        assert blind.overlaps(a)["w"] > expected
        # the snapshot carries every group's tiers, tagged, and resyncs the router to the same view
        snapshot = Shadow(chains_seen=False)
        for event in m.snapshot_events():
            snapshot.apply(event)
        assert snapshot.sets == {k: v for k, v in shadow.sets.items() if v or k in snapshot.sets}
        resync()
        assert r.overlaps(a) == {"w": expected}
        r.check_integrity()


def _hybrid_step(m: TieredHybridKVCacheManager) -> None:
    """Run the step's plan with dummy payloads, wait for the I/O threads, report finished reads."""
    plan = m.take_transfers()
    saved_groups = {g.group: [bytes(16)] * len(g.saves) for g in plan.groups if g.saves}
    m.complete_transfers(plan, saved=[bytes(16)] * len(plan.saves) or None, saved_groups=saved_groups)
    assert m.flush(5)
    for group in (0, 1):
        assert m.group_storage(group).wait_idle(5)
    m.poll_loads()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 9)), min_size=1, max_size=12))
def test_hybrid_tier_events_rebuild_every_groups_tiers(requests: list[tuple[int, int]]) -> None:
    sink = EventSink()
    shadow = Shadow()
    sink.subscribe(shadow.record)
    with _hybrid(sink) as m:
        for number, (prefix, extra) in enumerate(requests):
            seq = f"r{number}"
            tokens = PREFIXES[prefix] + [prefix * 7 + i for i in range(extra)]
            m.add_sequence(seq, tokens)
            _hybrid_step(m)
            if m.allocate(seq, len(tokens) - m.lookup(seq).total) is not None:
                for _ in range(100):
                    _hybrid_step(m)
                    if m.is_ready(seq):
                        break
                short = len(tokens) - m.num_computed_tokens(seq)
                if len(m.block_table(seq)) * B >= len(tokens) or m.allocate(seq, short) is not None:
                    _hybrid_step(m)
                    m.commit(seq, len(tokens))
            m.free(seq)
            for group, kind in ((0, "full"), (1, "sliding_window")):
                storage = m.group_storage(group)
                storage.publish()  # what the threads learnt since the last poll (this thread drives m)
                assert shadow.of("host", (group, kind)) == set(m.group_host(group).hashes())
                assert shadow.of("storage", (group, kind)) == set(storage.known_hashes())
            assert shadow.of("device", (0, "full")) == device_hashes(m)
            assert shadow.threads <= {threading.get_ident()}


def test_host_events_chain_written_back_blocks_with_their_parent_and_tokens() -> None:
    """As SGLang publishes host pages: a write-back evicts a chain children first, and the host tier's
    ``BlockStored`` names it parent first, with the parent of its first block and every block's token ids; a
    write-through copies blocks as they are committed, each run chained onto the block before it."""
    for policy in ("write-back", "write-through"):
        sink = EventSink()
        events: list[KVEvent] = []
        sink.subscribe(lambda record, events=events: events.append(record.event))
        tiers = TierConfig(num_host_blocks=8, host_policy=policy)
        with TieredKVCacheManager(5, B, tiers=tiers, event_sink=sink) as m:
            m.add_sequence("a", A)
            m.allocate("a", 17)
            m.commit("a", 8)  # blocks 0, 1
            m.complete_transfers(m.take_transfers())  # write-through: their copies land now
            m.commit("a", 17)  # blocks 2, 3
            chain = list(m.block_hashes("a"))
            m.free("a")
            m.add_sequence("b", OTHER)
            m.allocate("b", 17)  # takes every device block: a's 4 go down
            m.complete_transfers(m.take_transfers())  # the copies land: the host entries are ready
        host = [e for e in events if isinstance(e, BlockStored) and e.tier == "host"]
        runs = [(list(e.block_hashes), e.parent_hash, list(e.token_ids or ())) for e in host]
        if policy == "write-back":
            assert runs == [(chain, None, A[:16])]
        else:
            assert runs == [(chain[:2], None, A[:8]), (chain[2:], chain[1], A[8:16])]
