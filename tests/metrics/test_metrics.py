"""Prometheus metrics: scripted scenarios scraped from a real HTTP endpoint, expected values worked out by hand."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvblocks import DecodeManager, KVCacheManager, PrefillManager, TieredDecodeManager
from kvblocks.errors import BackendUnavailableError, InvalidArgumentError
from kvblocks.metrics import KVBlocksCollector, RouterMetrics, exposition, start_http_server
from kvblocks.routing import Router, RouterConfig
from kvblocks.tiers import FileStorage, MemoryStorage, TierConfig, TieredKVCacheManager, file_storage
from tests.support.tier_sim import FORMAT, SimEngine

B = 4

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """GET the endpoint and parse its text exposition into {(sample name, labels): value}."""
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture
def served() -> Iterator[tuple[KVBlocksCollector, str]]:
    collector = KVBlocksCollector()
    server = start_http_server(collector, port=0, addr="127.0.0.1")
    assert server.port > 0
    yield collector, server.url
    server.close()


# ---------------------------------------------------------------- a device-only manager


def test_hits_readmissions_evictions_and_usage_of_a_scripted_sequence(served) -> None:
    collector, url = served
    m = KVCacheManager(num_blocks=6, block_size=B)
    collector.add_manager("gpu0", m)

    # a: 10 tokens, nothing cached. Its 2 full blocks are committed; it keeps running.
    m.add_sequence("a", list(range(10)))
    m.allocate("a", 10)
    m.commit("a", 10)
    # b: 13 tokens sharing a's first 2 blocks (8 tokens), then its own.
    m.add_sequence("b", [*range(8), 100, 101, 102, 103, 104])
    m.allocate("b", 5)
    # b is preempted before committing anything, and admitted again: a still holds the 2 shared blocks.
    m.preempt("b")
    m.allocate("b", 5)
    m.free("a")
    m.free("b")
    # Now 2 blocks are cached (a's) and 4 are fresh; c needs all 6 blocks, so both cached ones are evicted.
    m.add_sequence("c", list(range(1000, 1024)))
    m.allocate("c", 24)

    s = scrape(url)
    cache = {"cache": "gpu0"}
    assert value(s, "kvblocks_prefix_queried_tokens_total", **cache) == 10 + 13 + 24
    assert value(s, "kvblocks_prefix_hit_tokens_total", **cache, tier="device") == 2 * B  # b's first admission
    assert value(s, "kvblocks_prefix_hit_tokens_total", **cache, tier="host") == 0
    assert value(s, "kvblocks_prefix_hit_tokens_total", **cache, tier="storage") == 0
    assert value(s, "kvblocks_readmission_queried_tokens_total", **cache) == 13
    assert value(s, "kvblocks_readmission_hit_tokens_total", **cache, tier="device") == 2 * B
    assert value(s, "kvblocks_admissions_total", **cache, kind="first") == 3
    assert value(s, "kvblocks_admissions_total", **cache, kind="readmission") == 1
    assert value(s, "kvblocks_evicted_blocks_total", **cache, tier="device") == 2
    device = {**cache, "tier": "device"}
    assert value(s, "kvblocks_blocks", **device, state="in_use") == 6
    assert value(s, "kvblocks_blocks_capacity", **device) == 6
    assert value(s, "kvblocks_blocks", **device, state="evictable") == 0  # c has committed nothing yet
    assert value(s, "kvblocks_blocks", **device, state="fresh") == 0
    assert value(s, "kvblocks_preemptions_total", **cache) == 1  # b
    assert value(s, "kvblocks_usage_ratio", **device) == 1.0
    host_series = {name for name, labels in s if ("tier", "host") in labels}
    assert host_series == {"kvblocks_prefix_hit_tokens_total", "kvblocks_readmission_hit_tokens_total"}  # no host tier

    m.commit("c", 24)
    m.free("c")
    s = scrape(url)  # gauges follow the manager; counters do not go back
    assert value(s, "kvblocks_blocks", **device, state="in_use") == 0
    assert value(s, "kvblocks_blocks", **device, state="evictable") == 6
    assert value(s, "kvblocks_usage_ratio", **device) == 0.0
    assert value(s, "kvblocks_prefix_queried_tokens_total", **cache) == 47


# ---------------------------------------------------------------- host and storage tiers


def test_host_hits_swaps_storage_writes_and_reads(served) -> None:
    collector, url = served
    storage = MemoryStorage()
    tiers = TierConfig(num_host_blocks=6, storage=storage, entry_format=FORMAT, storage_policy="write-through")
    m = TieredKVCacheManager(5, B, tiers=tiers)
    collector.add_manager("tiered", m)
    sim = SimEngine(m)
    a, other = list(range(17)), list(range(100, 117))  # 4 full blocks + 1 token each: a0..a3, b0..b3
    try:
        sim.serve("a", a)  # committing a0..a3 queues them for storage (write-through)
        sim.serve("b", other)  # evicts a0..a3 from device to 4 of the 6 host blocks; b0..b3 are queued too
        sim.run_plan()
        assert m.flush(5)
        # c = a: a0..a3 are host hits. c's 5 device blocks evict b3, b2, b1, b0 (leaves first): b3 and b2
        # take the 2 free host blocks; b1 and b0 find no room (a's host blocks are held by c's swap-ins).
        m.add_sequence("c", a)
        assert m.lookup("c").host == 16
        m.free("c")  # registered only to look; serve() registers it again
        sim.serve("c", a)
        # d = b: b0 is not on host, so all 4 blocks are storage hits -- but b1's entry is gone: the load
        # yields b0 only, and d computes b1..b3 (b1 is written again on commit; b2, b3 are still known).
        m.add_sequence("d", other)
        assert m.lookup("d").storage == 16
        storage.delete(m.storage.keys_of(m.block_hashes("d")[1]))
        m.free("d")
        sim.serve("d", other)
        sim.run_plan()
        assert m.flush(5)

        s = scrape(url)
        cache = {"cache": "tiered"}
        assert value(s, "kvblocks_prefix_queried_tokens_total", **cache) == 4 * 17
        assert value(s, "kvblocks_prefix_hit_tokens_total", **cache, tier="device") == 0
        assert value(s, "kvblocks_prefix_hit_tokens_total", **cache, tier="host") == 16  # c
        assert value(s, "kvblocks_prefix_hit_tokens_total", **cache, tier="storage") == 4  # d: b0 only
        assert value(s, "kvblocks_admissions_total", **cache, kind="first") == 4
        assert value(s, "kvblocks_evicted_blocks_total", **cache, tier="device") == 3 * 4  # by b, c and d
        assert value(s, "kvblocks_evicted_blocks_total", **cache, tier="host") == 0
        assert value(s, "kvblocks_swaps_total", **cache, direction="out", result="ok") == 4 + 2  # a0..a3, b3, b2
        assert value(s, "kvblocks_swaps_total", **cache, direction="in", result="ok") == 4  # a0..a3 for c
        assert value(s, "kvblocks_swaps_total", **cache, direction="out", result="failed") == 0
        assert value(s, "kvblocks_swaps_total", **cache, direction="in", result="failed") == 0
        assert value(s, "kvblocks_host_writes_dropped_total", **cache) == 2  # b1, b0
        assert value(s, "kvblocks_storage_writes_total", **cache, result="written") == 4 + 4 + 1
        for result in ("skipped_existing", "dropped", "failed", "no_payload"):
            assert value(s, "kvblocks_storage_writes_total", **cache, result=result) == 0
        assert value(s, "kvblocks_storage_reads_requested_total", **cache) == 4
        assert value(s, "kvblocks_storage_reads_total", **cache, result="hit") == 1
        assert value(s, "kvblocks_storage_reads_total", **cache, result="missing") == 1
        for result in ("corrupt", "wrong_key", "timeout", "error", "cancelled"):
            assert value(s, "kvblocks_storage_reads_total", **cache, result=result) == 0
        assert value(s, "kvblocks_storage_backend_errors_total", **cache, op="put") == 0
        entry_bytes = storage.nbytes // len(storage)  # every entry has the same size
        assert len(storage) == 8
        assert value(s, "kvblocks_storage_written_bytes_total", **cache) == 9 * entry_bytes
        assert value(s, "kvblocks_evicted_blocks_total", **cache, tier="storage") == 0
        host = {**cache, "tier": "host"}
        assert value(s, "kvblocks_blocks_capacity", **host) == 6
        assert value(s, "kvblocks_blocks", **host, state="evictable") == 6
        assert value(s, "kvblocks_blocks", **host, state="in_use") == 0
        assert value(s, "kvblocks_blocks", **host, state="fresh") == 0
        assert value(s, "kvblocks_usage_ratio", **host) == 0.0  # nothing in flight: all 6 are evictable
    finally:
        m.close(timeout=1)


def test_failed_saves_corrupt_entries_and_odd_files_show_without_any_logging(served, tmp_path, monkeypatch) -> None:
    """What kvblocks logs as warnings (a save that failed, a corrupt entry removed) goes nowhere when the
    application configured no logging (a NullHandler on ``kvblocks``): the counters must say it."""
    collector, url = served
    storage = FileStorage(tmp_path)
    m = TieredKVCacheManager(
        5, B, tiers=TierConfig(storage=storage, entry_format=FORMAT, storage_policy="write-through")
    )
    collector.add_manager("files", m)
    sim = SimEngine(m)
    a, b, c = list(range(17)), list(range(100, 117)), list(range(200, 217))  # 4 full blocks each; 5 fill the device
    real_open = open

    def failing_open(file, mode="r", *args, **kwargs):  # the directory went read-only: every save fails
        if set(mode) & set("wxa"):
            raise PermissionError(13, "Permission denied", file)
        return real_open(file, mode, *args, **kwargs)

    try:
        for tokens in (a, c):
            sim.serve(str(tokens[0]), tokens)
            sim.run_plan()
            assert m.flush(5)
        with monkeypatch.context() as patch:
            patch.setattr(file_storage, "open", failing_open, raising=False)
            sim.serve("b", b)  # evicts c from the device; b0..b3 cannot be saved
            sim.run_plan()
            assert m.flush(5)
        first: dict[str, str] = {}
        for name, tokens in (("a2", a), ("c2", c)):
            m.add_sequence(name, tokens)
            assert m.lookup(name).storage == 16  # storage holds (it says) all four blocks
            first[name] = m.storage.keys_of(m.block_hashes(name)[0])[0]
            m.free(name)
        with real_open(storage._file(first["a2"]), "r+b") as entry:  # a0: its last payload byte flipped
            entry.seek(-1, os.SEEK_END)
            last = entry.read(1)[0]
            entry.seek(-1, os.SEEK_END)
            entry.write(bytes([last ^ 1]))
        os.unlink(storage._file(first["c2"]))
        os.mkfifo(storage._file(first["c2"]))  # c0: a FIFO (a reader once hung on it)
        for name, tokens in (("a2", a), ("c2", c)):
            sim.serve(name, tokens)  # asks storage for a0..a3 (c0..c3): the first entry is bad
            sim.run_plan()
        s = scrape(url)
        cache = {"cache": "files"}
        assert value(s, "kvblocks_storage_writes_total", **cache, result="failed") == 4  # b0..b3
        assert value(s, "kvblocks_storage_backend_errors_total", **cache, op="put") == 4
        assert value(s, "kvblocks_storage_reads_total", **cache, result="corrupt") == 1  # a0, removed
        assert value(s, "kvblocks_storage_reads_total", **cache, result="missing") == 1  # c0
        assert value(s, "kvblocks_storage_backend_errors_total", **cache, op="get") == 1  # c0
        assert value(s, "kvblocks_storage_skipped_entries_total", **cache) == 1  # c0
        assert value(s, "kvblocks_prefix_hit_tokens_total", **cache, tier="storage") == 0
    finally:
        m.close(5)


def test_host_blocks_held_by_copies_in_flight_are_in_use_until_the_plan_completes() -> None:
    collector = KVBlocksCollector()
    m = TieredKVCacheManager(5, B, tiers=TierConfig(num_host_blocks=8))
    collector.add_manager("t", m)
    m.add_sequence("a", list(range(17)))
    m.allocate("a", 17)
    m.commit("a", 17)
    m.free("a")
    m.add_sequence("b", list(range(100, 117)))
    m.allocate("b", 17)  # evicts a's 4 cached blocks: 4 host blocks are reserved for their copies
    plan = m.take_transfers()

    def host_blocks() -> dict[str, float]:
        families = text_string_to_metric_families(exposition(collector).decode())
        samples = [s for f in families if f.name == "kvblocks_blocks" for s in f.samples]
        return {s.labels["state"]: s.value for s in samples if s.labels["tier"] == "host"}

    assert host_blocks() == {"in_use": 4, "evictable": 0, "fresh": 4}
    m.complete_transfers(plan)
    assert host_blocks() == {"in_use": 0, "evictable": 4, "fresh": 4}


def test_a_tiered_decode_node_exports_its_handoffs_and_its_tiers() -> None:
    collector = KVBlocksCollector()
    prefill = PrefillManager(num_blocks=16, block_size=B)
    decode = TieredDecodeManager(4, B, tiers=TierConfig(num_host_blocks=8), reserve_blocks_per_sequence=0)
    collector.add_manager("d", decode)
    for seq, tokens in ((1, list(range(12))), (2, list(range(100, 112)))):
        prefill.add_sequence(seq, tokens)
        prefill.allocate(seq, 12)
        prefill.commit(seq, 12)
        assert decode.accept_handoff(prefill.finish_prefill(seq), tokens) is not None  # 2: evicts 1's 2 blocks
        decode.complete_transfers(decode.take_transfers())
        decode.receive_done(seq)
        decode.free(seq)
    families = text_string_to_metric_families(exposition(collector).decode())
    samples = {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}
    assert value(samples, "kvblocks_decode_handoffs_total", cache="d", result="accepted") == 2
    assert value(samples, "kvblocks_decode_transferred_blocks_total", cache="d") == 6
    assert value(samples, "kvblocks_blocks", cache="d", tier="host", state="evictable") == 2  # written back


# ---------------------------------------------------------------- routers


def test_router_decisions_overlap_and_load_per_worker(served) -> None:
    collector, url = served
    router = Router(["w0", "w1"], RouterConfig(block_size=B, mode="approximate"))
    observer = RouterMetrics()
    collector.add_router("front", router, observer)
    p1, p2 = list(range(17)), list(range(100, 117))  # 4 full blocks + 1 token each

    first = observer.route(router, p1)  # both empty and idle: the earlier-added w0, no overlap
    second = observer.route(router, p2)  # w0 is busy with 17 prefill tokens: w1, no overlap
    assert (first.worker, second.worker) == ("w0", "w1")
    s = scrape(url)
    assert value(s, "kvblocks_router_running", router="front", worker="w0") == 1
    assert value(s, "kvblocks_router_running", router="front", worker="w1") == 1
    assert value(s, "kvblocks_router_inflight_prefill_tokens", router="front", worker="w0") == 17
    assert value(s, "kvblocks_router_cached_blocks", router="front", worker="w1") == 4  # remembers p2
    first.release()
    second.release()

    third = observer.route(router, p1)  # w0 holds p1's 4 blocks and is idle again
    assert third.worker == "w0"
    third.prefill_done()
    s = scrape(url)
    assert value(s, "kvblocks_router_running", router="front", worker="w0") == 1
    assert value(s, "kvblocks_router_inflight_prefill_tokens", router="front", worker="w0") == 0
    third.release()

    s = scrape(url)
    assert value(s, "kvblocks_router_decisions_total", router="front") == 3
    assert value(s, "kvblocks_router_worker_decisions_total", router="front", worker="w0") == 2
    assert value(s, "kvblocks_router_worker_decisions_total", router="front", worker="w1") == 1
    for worker in ("w0", "w1"):  # every lease was released
        assert value(s, "kvblocks_router_running", router="front", worker=worker) == 0
        assert value(s, "kvblocks_router_inflight_prefill_tokens", router="front", worker=worker) == 0
    w0 = {"router": "front", "worker": "w0"}
    assert value(s, "kvblocks_router_overlap_blocks_count", **w0) == 2
    assert value(s, "kvblocks_router_overlap_blocks_sum", **w0) == 0 + 4
    buckets = {"0.0": 1, "1.0": 1, "2.0": 1, "4.0": 2, "8.0": 2, "128.0": 2, "+Inf": 2}  # cumulative
    for le, count in buckets.items():
        assert value(s, "kvblocks_router_overlap_blocks_bucket", **w0, le=le) == count
    w1 = {"router": "front", "worker": "w1"}
    assert value(s, "kvblocks_router_overlap_blocks_bucket", **w1, le="0.0") == 1
    assert value(s, "kvblocks_router_overlap_blocks_sum", **w1) == 0
    assert value(s, "kvblocks_router_leaked_leases_total", router="front") == 0
    assert value(s, "kvblocks_router_silent_workers", router="front") == 0


def test_a_router_without_an_observer_has_no_per_worker_decisions() -> None:
    collector = KVBlocksCollector()
    router = Router(["w0"], RouterConfig(block_size=B))
    collector.add_router("r", router)
    router.route(list(range(9))).release()
    text = exposition(collector).decode()
    assert 'kvblocks_router_decisions_total{router="r"} 1.0' in text
    assert "kvblocks_router_worker_decisions" not in text and "kvblocks_router_overlap_blocks" not in text


# ---------------------------------------------------------------- names, registration, errors


def test_every_metric_name_has_the_prefix_and_removed_sources_disappear() -> None:
    collector = KVBlocksCollector()
    collector.add_manager("plain", KVCacheManager(4, B))
    tiered = TieredKVCacheManager(
        4, B, tiers=TierConfig(num_host_blocks=2, storage=MemoryStorage(), entry_format=FORMAT)
    )
    collector.add_manager("tiered", tiered)
    decode = DecodeManager(num_blocks=6, block_size=B, reserve_blocks_per_sequence=1)
    prefill = PrefillManager(num_blocks=8, block_size=B)
    prefill.add_sequence(1, list(range(10)))
    prefill.allocate(1, 10)
    prefill.commit(1, 10)
    decode.accept_handoff(prefill.finish_prefill(1), list(range(10)))  # a cold decode cache: 3 blocks move
    collector.add_manager("decode", decode)
    router = Router(["w0"], RouterConfig(block_size=B))
    observer = RouterMetrics()
    collector.add_router("front", router, observer)
    observer.route(router, list(range(9))).release()
    try:
        families = list(text_string_to_metric_families(exposition(collector).decode()))
        names = {family.name for family in families}
        assert names and all(name.startswith("kvblocks_") for name in names)
        assert all(sample.name.startswith("kvblocks_") for family in families for sample in family.samples)
        assert {"kvblocks_swaps", "kvblocks_storage_reads", "kvblocks_router_overlap_blocks"} <= names
        samples = {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}
        assert value(samples, "kvblocks_decode_handoffs_total", cache="decode", result="accepted") == 1
        assert value(samples, "kvblocks_decode_transferred_blocks_total", cache="decode") == 3
        assert ("kvblocks_swaps_total", frozenset({"cache": "plain", "direction": "in", "result": "ok"})) not in samples

        assert collector.names == ["plain", "tiered", "decode", "front"]
        collector.remove("tiered")
        collector.remove("front")
        text = exposition(collector).decode()
        assert '"tiered"' not in text and "kvblocks_router" not in text and 'cache="plain"' in text
        collector.add_manager("tiered", tiered)  # a removed name can be used again
    finally:
        tiered.close(timeout=1)


def test_mistakes_are_refused_clearly() -> None:
    collector = KVBlocksCollector()
    manager = KVCacheManager(4, B)
    router = Router(["w0"], RouterConfig(block_size=B))
    collector.add_manager("x", manager)
    with pytest.raises(InvalidArgumentError, match="already added"):
        collector.add_manager("x", KVCacheManager(4, B))
    with pytest.raises(InvalidArgumentError, match="already added"):
        collector.add_router("x", router)  # managers and routers share the names
    with pytest.raises(InvalidArgumentError, match="KVCacheManager"):
        collector.add_manager("y", router)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="Router"):
        collector.add_router("y", manager)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="RouterMetrics"):
        collector.add_router("y", router, observer=object())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="non-empty str"):
        collector.add_manager("", KVCacheManager(4, B))
    with pytest.raises(InvalidArgumentError, match="no cache or router"):
        collector.remove("y")
    with pytest.raises(InvalidArgumentError, match="Lease"):
        RouterMetrics().observe(object())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="port"):
        start_http_server(collector, port=70000)
    with pytest.raises(InvalidArgumentError, match="KVBlocksCollector"):
        exposition(manager)  # type: ignore[arg-type]
    assert collector.names == ["x"]  # nothing above changed it


def test_a_missing_prometheus_client_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # makes `import prometheus_client` fail
    with pytest.raises(BackendUnavailableError, match=r"kvblocks\[prometheus\]"):
        KVBlocksCollector()


def test_importing_kvblocks_or_its_metrics_module_does_not_import_prometheus_client() -> None:
    code = "import sys, kvblocks, kvblocks.metrics\nprint('prometheus_client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_closed_server_stops_answering() -> None:
    server = start_http_server(KVBlocksCollector())
    with urllib.request.urlopen(server.url, timeout=5) as response:
        assert response.status == 200
    server.close()
    server.close()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url, timeout=2)


# ---------------------------------------------------------------- the docs table is what the exporter serves

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
SUFFIX = {"counter": "_total", "gauge": "", "histogram": ""}


def documented_series() -> dict[str, tuple[str, frozenset[str]]]:
    """{series name: (type, label names)} from the table of docs/metrics.md."""
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for line in DOC.read_text().splitlines():
        if not line.startswith("| `kvblocks_"):
            continue
        name, kind, labels = (cell.strip() for cell in line.strip("|").split("|")[:3])
        assert name.strip("`") not in out, f"{name} is documented twice"
        out[name.strip("`")] = (kind, frozenset(re.findall(r"`(\w+)`", labels)))
    return out


def served_series(url: str) -> dict[str, tuple[str, frozenset[str]]]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for family in text_string_to_metric_families(text):
        labels = frozenset(k for sample in family.samples for k in sample.labels if k != "le")
        out[family.name + SUFFIX[family.type]] = (family.type, labels)
    return out


def every_kind_of_source(collector: KVBlocksCollector) -> list[TieredKVCacheManager]:
    """Managers of every kind metrics knows (plain, tiered with host and storage, prefill, decode, tiered
    decode) and a router with an observer, each having done something."""
    plain = KVCacheManager(4, B)
    plain.add_sequence("a", list(range(9)))
    plain.allocate("a", 9)
    tiered = TieredKVCacheManager(
        4, B, tiers=TierConfig(num_host_blocks=2, storage=MemoryStorage(), entry_format=FORMAT)
    )
    prefill = PrefillManager(num_blocks=8, block_size=B)
    prefill.add_sequence(1, list(range(10)))
    prefill.allocate(1, 10)
    prefill.commit(1, 10)
    decode = DecodeManager(num_blocks=6, block_size=B, reserve_blocks_per_sequence=1)
    decode.accept_handoff(prefill.finish_prefill(1), list(range(10)))
    tiered_decode = TieredDecodeManager(4, B, tiers=TierConfig(num_host_blocks=4), reserve_blocks_per_sequence=0)
    router = Router(["w0", "w1"], RouterConfig(block_size=B))
    observer = RouterMetrics()
    observer.route(router, list(range(9))).release()
    for name, manager in (("plain", plain), ("tiered", tiered), ("prefill", prefill), ("decode", decode)):
        collector.add_manager(name, manager)
    collector.add_manager("tiered_decode", tiered_decode)
    collector.add_router("front", router, observer)
    return [tiered, tiered_decode]


def test_the_docs_table_lists_exactly_the_series_the_exporter_serves(served) -> None:
    collector, url = served
    closing = every_kind_of_source(collector)
    try:
        served, documented = served_series(url), documented_series()
    finally:
        for manager in closing:
            manager.close(timeout=1)
    assert sorted(set(served) - set(documented)) == []  # served, not documented
    assert sorted(set(documented) - set(served)) == []  # documented, not served
    wrong = {name: (documented[name], got) for name, got in served.items() if documented[name] != got}
    assert wrong == {}


# ---------------------------------------------------------------- block states, capacity, usage

OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "allocate", "commit", "free", "preempt"]),
        st.integers(0, 3),  # which sequence
        st.lists(st.integers(0, 2), min_size=1, max_size=12),  # a prompt over a small alphabet: shared prefixes
    ),
    max_size=25,
)


def device_blocks(collector: KVBlocksCollector, tier: str = "device") -> tuple[dict[str, float], float, float]:
    """(blocks by state, capacity, usage ratio) of the one manager in ``collector``, from collect()."""
    states: dict[str, float] = {}
    capacity = usage = -1.0
    for family in collector.collect():
        for sample in family.samples:
            if sample.labels.get("tier") != tier:
                continue
            if family.name == "kvblocks_blocks":
                states[sample.labels["state"]] = sample.value
            elif family.name == "kvblocks_blocks_capacity":
                capacity = sample.value
            elif family.name == "kvblocks_usage_ratio":
                usage = sample.value
    return states, capacity, usage


@settings(max_examples=200, deadline=None)
@given(ops=OPS)
def test_block_states_partition_the_pool_and_usage_is_the_share_in_use(ops) -> None:
    m = KVCacheManager(num_blocks=6, block_size=2)
    collector = KVBlocksCollector()
    collector.add_manager("m", m)
    for op, i, prompt in ops:
        seq = f"s{i}"
        if op == "add" and seq not in m:
            m.add_sequence(seq, prompt)
        elif seq in m and op == "allocate":
            m.allocate(seq, 1 if m.is_admitted(seq) else m.num_tokens(seq))
        elif seq in m and op == "commit" and m.is_admitted(seq):
            m.commit(seq, min(m.num_tokens(seq), len(m.block_table(seq)) * 2))
        elif seq in m and op == "free":
            m.free(seq)
        elif seq in m and op == "preempt" and m.is_admitted(seq):
            m.preempt(seq)
        states, capacity, usage = device_blocks(collector)
        pool = m.pool
        assert capacity == 6 and set(states) == {"in_use", "evictable", "fresh"}
        assert sum(states.values()) == capacity  # disjoint states covering the pool
        assert (states["in_use"], states["evictable"], states["fresh"]) == (
            pool.num_in_use,
            pool.num_idle,
            pool.num_fresh,
        )
        assert usage == states["in_use"] / capacity


def test_the_host_tier_has_the_same_states_capacity_and_usage() -> None:
    collector = KVBlocksCollector()
    m = TieredKVCacheManager(5, B, tiers=TierConfig(num_host_blocks=8))
    collector.add_manager("t", m)
    m.add_sequence("a", list(range(17)))
    m.allocate("a", 17)
    m.commit("a", 17)
    m.free("a")
    m.add_sequence("b", list(range(100, 117)))
    m.allocate("b", 17)  # 4 host blocks reserved for copies in flight
    assert device_blocks(collector, "host") == ({"in_use": 4, "evictable": 0, "fresh": 4}, 8, 0.5)
    m.complete_transfers(m.take_transfers())
    assert device_blocks(collector, "host") == ({"in_use": 0, "evictable": 4, "fresh": 4}, 8, 0.0)
    assert device_blocks(collector, "device") == ({"in_use": 5, "evictable": 0, "fresh": 0}, 5, 1.0)


# ---------------------------------------------------------------- preemptions and block lifetimes


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lifetime_and_idle_before_eviction_histograms_with_a_fake_clock(served) -> None:
    collector, url = served
    clock = FakeClock()
    m = KVCacheManager(num_blocks=4, block_size=B)
    m.pool.clock = clock
    m.block_lifetimes.sample_every = 1  # every evicted block observed (the default samples)
    collector.add_manager("gpu0", m)
    m.add_sequence("a", list(range(9)))
    m.allocate("a", 9)  # t=0: blocks 0, 1, 2 are allocated
    m.commit("a", 9)  # 0 and 1 are full: cached
    clock.now = 5.0
    m.free("a")  # 1 and 0 idle since 5; 2 (partial) goes back fresh
    clock.now = 10.0
    m.add_sequence("c", [*range(8), 99])
    m.allocate("c", 1)  # a hit on 0 and 1: in use again (their allocation stays t=0); block 3 taken
    clock.now = 20.0
    m.free("c")  # 1 and 0 idle since 20
    clock.now = 70.0
    m.add_sequence("b", list(range(100, 116)))
    m.allocate("b", 16)  # 4 blocks: 3 and 2 are fresh, 1 and 0 are evicted at t=70
    m.preempt("b")

    s = scrape(url)
    cache = {"cache": "gpu0"}
    assert value(s, "kvblocks_evicted_blocks_total", **cache, tier="device") == 2
    assert value(s, "kvblocks_preemptions_total", **cache) == 1
    lifetime = "kvblocks_block_lifetime_seconds"  # 70 s each: in (60, 300]
    assert value(s, f"{lifetime}_count", **cache) == 2 and value(s, f"{lifetime}_sum", **cache) == 140
    assert value(s, f"{lifetime}_bucket", **cache, le="60.0") == 0
    assert value(s, f"{lifetime}_bucket", **cache, le="300.0") == 2
    idle = "kvblocks_block_idle_before_eviction_seconds"  # 50 s each (since the release at 20): in (30, 60]
    assert value(s, f"{idle}_count", **cache) == 2 and value(s, f"{idle}_sum", **cache) == 100
    assert value(s, f"{idle}_bucket", **cache, le="30.0") == 0
    assert value(s, f"{idle}_bucket", **cache, le="60.0") == 2
    assert value(s, f"{idle}_bucket", **cache, le="+Inf") == 2
    from kvblocks.accounting import LIFETIME_BUCKETS

    assert m.block_lifetimes.idle.counts[LIFETIME_BUCKETS.index(60)] == 2


def test_one_evicted_block_in_sample_every_is_observed_across_batches() -> None:
    from kvblocks.accounting import DEFAULT_SAMPLE_EVERY

    clock = FakeClock()
    m = KVCacheManager(num_blocks=4, block_size=B)
    m.pool.clock = clock
    m.block_lifetimes.sample_every = 2
    for round_, base in enumerate((0, 100, 200)):
        clock.now = 10.0 * round_
        m.add_sequence(base, list(range(base, base + 13)))
        m.allocate(base, 13)  # 4 blocks; from the second round on, the 3 cached ones before are evicted
        m.commit(base, 13)
        m.free(base)
    assert m.stats.evicted_blocks == 6
    lifetime = m.block_lifetimes.lifetime
    # evicted: 3 at t=10 and 3 at t=20, each having lived 10 s: the 1st, 3rd and 5th of the six are observed
    assert lifetime.count == 3 and lifetime.sum == 10 + 10 + 10
    assert DEFAULT_SAMPLE_EVERY == KVCacheManager(1, B).block_lifetimes.sample_every == 32


def test_a_chain_evicted_in_one_batch_is_observed_from_the_lru_head_only() -> None:
    """A manager's chain (children released first) is evicted in one batch: exact times per block."""
    clock = FakeClock()
    m = KVCacheManager(num_blocks=4, block_size=B)
    m.pool.clock = clock
    m.block_lifetimes.sample_every = 1
    m.add_sequence("a", list(range(13)))
    m.allocate("a", 13)  # t=0: 4 blocks; 3 full ones cached at commit
    m.commit("a", 13)
    clock.now = 2.0
    m.free("a")  # 2, 1, 0 idle since 2 (leaf first); 3 fresh
    clock.now = 7.0
    m.add_sequence("b", list(range(100, 113)))
    m.allocate("b", 13)  # evicts the whole chain at t=7
    idle, lifetime = m.block_lifetimes.idle, m.block_lifetimes.lifetime
    assert (idle.count, idle.sum, lifetime.sum) == (3, 3 * 5, 3 * 7)


def test_the_endpoint_is_prometheus_clients_own_server_bound_to_loopback() -> None:
    with start_http_server(KVBlocksCollector()) as server:
        assert server.address == "127.0.0.1" and server.port > 0
        assert type(server._httpd).__module__.startswith("prometheus_client")
        with urllib.request.urlopen(server.url, timeout=5) as response:
            assert response.status == 200
