"""Faults under the tiered manager: Redis killed mid-run, a backend that never answers, a full or
read-only disk, the writer racing the scheduler, and preemption snapshots racing block reuse.

Every test drives :class:`~kvblocks.tiers.TieredKVCacheManager` the way an engine does (through
``tests.support.tier_sim.SimEngine``, whose block "KV" is derived from the block hash), so a wrong byte
anywhere -- device, host, or an entry read back from storage -- is caught by content.
"""

from __future__ import annotations

import errno
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Hashable, Sequence

import pytest

from kvblocks import KVCacheManager
from kvblocks.hashing import BlockHash
from kvblocks.tiers import (
    FileStorage,
    LoadResult,
    MemoryStorage,
    RedisStorage,
    TierConfig,
    TieredKVCacheManager,
    TransferPlan,
)
from kvblocks.tiers import file_storage as file_storage_module
from tests.support.tier_sim import FORMAT, GARBAGE, PAYLOAD, SimEngine, content_of

BLOCK = 4


# ---------------------------------------------------------------- helpers


class RecordingEngine(SimEngine):
    """A SimEngine that keeps every LoadResult it applied (``serve`` and ``wait_ready`` drop them)."""

    def __init__(self, manager: TieredKVCacheManager) -> None:
        super().__init__(manager)
        self.results: list[LoadResult] = []

    def apply(self, results: list[LoadResult]) -> None:
        self.results.extend(results)
        super().apply(results)

    def results_of(self, seq_id: Hashable) -> list[LoadResult]:
        return [r for r in self.results if r.seq_id == seq_id]


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def finish(sim: SimEngine, seq_id: Hashable, tokens: list[int]) -> None:
    """``SimEngine.serve`` for a sequence that is already added: admit, settle the copies, compute, commit, free."""
    m = sim.m
    assert m.allocate(seq_id, len(tokens) - m.lookup(seq_id).total) is not None
    sim.wait_ready(seq_id)
    finish_admitted(sim, seq_id, tokens)


def finish_admitted(sim: SimEngine, seq_id: Hashable, tokens: list[int]) -> None:
    """Compute and commit an admitted, ready sequence whose table may have been cut back, then free it."""
    m = sim.m
    assert m.is_ready(seq_id)
    if len(tokens) > len(m.block_table(seq_id)) * m.block_size:
        assert m.allocate(seq_id, len(tokens) - m.num_computed_tokens(seq_id)) is not None
        sim.step()  # this allocation's copies run before the forward pass
    sim.check_sequence(seq_id)
    sim.compute(seq_id, len(tokens))
    m.commit(seq_id, len(tokens))
    sim.check_sequence(seq_id)
    m.free(seq_id)


def hashes_of(tokens: list[int]) -> tuple[BlockHash, ...]:
    """Block hashes of a prompt, as any manager with the default scheme and namespace computes them."""
    plain = KVCacheManager(1, BLOCK)
    plain.add_sequence("x", tokens)
    return plain.block_hashes("x")


def store_directly(m: TieredKVCacheManager, backend, hashes: Sequence[BlockHash]) -> None:
    """Put correct entries for ``hashes`` into ``backend`` behind the manager's back (another node wrote them)."""
    items = [(key, FORMAT.encode(content_of(h), key)) for h in hashes for key in m.storage.keys_of(h)]
    assert backend.put(items) == len(items)


def check_stored_entries(m: TieredKVCacheManager, backend, hashes: set[BlockHash], *, index_exact: bool = True) -> int:
    """Every entry under the key of a served hash decodes to that hash's content; returns how many there are.

    With ``index_exact`` (nothing was removed behind the manager's back), every hash the index
    knows must be there too.
    """
    found = 0
    for h in hashes:
        for key in m.storage.keys_of(h):
            raw = backend.get([key])[0]
            if raw is None:
                assert not (index_exact and m.storage.is_known(h)), "the index claims a hash the backend lacks"
                continue
            payload, why = FORMAT.decode(raw)
            assert why == "", f"entry {key} does not decode: {why}"
            assert bytes(payload) == content_of(h), f"entry {key} holds another block's KV"
            found += 1
    return found


def assert_writer_balanced(m: TieredKVCacheManager) -> None:
    w = m.tier_stats.writer
    assert w.submitted == w.written + w.skipped_existing + w.dropped + w.failed, w


class Workload:
    """Prompts over a few shared prefixes, each with a suffix nobody else has."""

    def __init__(self, seed: int, num_prefixes: int = 4, prefix_blocks: int = 5, max_suffix: int = 9) -> None:
        self.rng = random.Random(seed)
        self.heads = [
            list(range(10_000 * (i + 1), 10_000 * (i + 1) + prefix_blocks * BLOCK)) for i in range(num_prefixes)
        ]
        self.max_suffix = max_suffix
        self._next = 1_000_000 + seed * 100_000

    def prompt(self) -> list[int]:
        n = self.rng.randint(1, self.max_suffix)
        self._next += n
        return self.rng.choice(self.heads) + list(range(self._next - n, self._next))


# ---------------------------------------------------------------- 1. Redis killed mid-run


def test_redis_killed_mid_run_serving_continues_and_resumes_when_it_is_back(private_redis) -> None:
    prefix = f"faults-{uuid.uuid4().hex[:8]}:"
    backend = RedisStorage(private_redis.url, socket_timeout=0.3, prefix=prefix)
    tiers = TierConfig(num_host_blocks=8, storage=backend, entry_format=FORMAT, storage_timeout_s=0.5)
    m = TieredKVCacheManager(12, BLOCK, tiers=tiers)
    sim = RecordingEngine(m)
    work = Workload(seed=1, num_prefixes=6)  # 30 prefix blocks: more than device and host hold
    served: dict[str, list[int]] = {}

    scheduling = [0.0]  # seconds spent in the engine's scheduling calls, writes' settling excluded

    def serve_some(tag: str, count: int) -> None:
        for i in range(count):
            tokens = work.prompt()
            served[f"{tag}{i}"] = tokens
            start = time.monotonic()
            sim.serve(f"{tag}{i}", tokens)  # add_sequence/lookup/allocate/plans/poll_loads/commit/free
            scheduling[0] += time.monotonic() - start
            m.check_integrity()
            # writes settle between requests (the run is the same every time); against a dead server each
            # of a batch's two calls (exists, put) is bounded by the documented retry bound
            assert m.flush(2 * (3 * 2 * 0.3 + 2 * 0.5) + 1)
        sim.check_cached()

    try:
        # Healthy: evictions flow device -> host -> Redis, and come back as storage hits.
        serve_some("a", 40)
        assert m.flush(10)
        healthy = m.tier_stats
        assert healthy.writer.written > 0 and healthy.writer.failed == 0
        assert m.stats.hit_tokens_storage > 0 and healthy.storage.loads_hit > 0
        assert backend.stats.put_errors == backend.stats.get_errors == 0

        private_redis.stop()  # killed mid-run
        before = m.stats
        scheduling[0] = 0.0
        serve_some("b", 40)
        # the scheduling calls never wait on the dead server: its reads time out as misses (storage_timeout_s)
        assert scheduling[0] < 8
        assert m.flush(10)
        after = m.stats
        down = m.tier_stats
        assert after.hit_tokens_device > before.hit_tokens_device
        assert after.hit_tokens_host > before.hit_tokens_host
        # Blocks the index knew were tried against the dead server: misses, computed instead.
        assert down.storage.loads_missing > healthy.storage.loads_missing
        assert after.hit_tokens_storage == before.hit_tokens_storage
        assert down.writer.failed > healthy.writer.failed  # writes were tried, failed, and counted
        assert backend.stats.put_errors > 0 and backend.stats.get_errors > 0
        assert down.writer.written == healthy.writer.written  # nothing claims to have reached a dead server
        assert down.storage.load_errors == 0  # failures are misses, not reader crashes
        assert_writer_balanced(m)
        m.check_integrity()
        sim.check_cached()

        private_redis.start()  # back, and empty (no persistence)
        serve_some("c", 40)
        assert m.flush(10)
        up = m.tier_stats
        assert up.writer.written > down.writer.written  # writes resumed
        assert m.stats.hit_tokens_storage > after.hit_tokens_storage  # and reads
        assert_writer_balanced(m)
        m.check_integrity()
        sim.check_cached()

        # The new entries are in the restarted server, and sound.
        fresh = {h for sid, tokens in served.items() if sid.startswith("c") for h in hashes_of(tokens)}
        probe = RedisStorage(private_redis.url, socket_timeout=0.3, prefix=prefix)
        assert check_stored_entries(m, probe, fresh, index_exact=False) > 0  # the restart lost entries

        # Storage hits again: a new node over the same server loads a stored run instead of computing it.
        def stored_run(tokens: list[int]) -> int:
            limit = (len(tokens) - 1) // BLOCK
            return probe.contains([m.storage.keys_of(h)[0] for h in hashes_of(tokens)[:limit]])

        best = max((sid for sid in served if sid.startswith("c")), key=lambda sid: stored_run(served[sid]))
        run = stored_run(served[best])
        assert run > 0
        m2 = TieredKVCacheManager(
            16,
            BLOCK,
            tiers=TierConfig(
                storage=RedisStorage(private_redis.url, socket_timeout=0.3, prefix=prefix),
                entry_format=FORMAT,
                storage_timeout_s=0.5,
            ),
        )
        try:
            sim2 = RecordingEngine(m2)
            m2.add_sequence("again", served[best])  # probes the server in the background
            wait_for(lambda: m2.lookup("again").storage == run * BLOCK, what="the probe to find the stored run")
            finish(sim2, "again", served[best])
            (result,) = sim2.results_of("again")
            assert result.complete and not result.timed_out and len(result.blocks) == run
            assert m2.stats.hit_tokens_storage == run * BLOCK
            m2.check_integrity()
            sim2.check_cached()
        finally:
            m2.close(1)
        probe.close()
    finally:
        m.close(1)


# ---------------------------------------------------------------- 2. scheduler and writer threads together


class SlowStorage:
    """A backend whose writes take a little while (the writer thread lags the scheduler), and whose
    reads now and then take longer than the storage timeout (a load times out, its result lands late)."""

    def __init__(self, inner, write_delay: float, slow_reads: float = 0.0, read_delay: float = 0.02) -> None:
        self.inner = inner
        self.stats = inner.stats
        self.write_delay = write_delay
        self.slow_reads = slow_reads
        self.read_delay = read_delay
        self._rng = random.Random(5)  # used by the reader thread only

    def put(self, items):
        time.sleep(self.write_delay)
        return self.inner.put(items)

    def get(self, keys):
        if self._rng.random() < self.slow_reads:
            time.sleep(self.read_delay)
        return self.inner.get(keys)

    def exists(self, keys):
        return self.inner.exists(keys)

    def contains(self, keys):
        return self.inner.contains(keys)

    def delete(self, keys):
        return self.inner.delete(keys)

    def close(self) -> None:
        pass  # the test reads the inner backend after the manager is closed


@pytest.mark.parametrize(
    "kind, slow_reads", [("memory", 0.0), ("file", 0.0), ("memory", 0.2)], ids=["memory", "file", "load-timeouts"]
)
def test_scheduler_and_writer_threads_stress(kind: str, slow_reads: float, tmp_path) -> None:
    """A scheduler loop (this thread) against the writer and reader threads: random prompts over shared
    prefixes, preemptions with snapshots, frees; then integrity, and every stored entry checked by content.

    With ``slow_reads`` some reads outlive the storage timeout: their results land after the blocks
    they were meant for went back to the pool and were reused, and must be ignored.
    """
    inner = MemoryStorage() if kind == "memory" else FileStorage(tmp_path / "kv")
    tiers = TierConfig(
        num_host_blocks=8,
        storage=SlowStorage(inner, 0.0005, slow_reads),
        entry_format=FORMAT,
        save_on_preempt=True,
        max_pending_writes=6,
        storage_timeout_s=0.01 if slow_reads else 2.0,
    )
    m = TieredKVCacheManager(24, BLOCK, tiers=tiers)
    sim = RecordingEngine(m)
    rng = random.Random(7 if kind == "memory" else 8)
    work = Workload(seed=2, num_prefixes=3, prefix_blocks=5, max_suffix=3 * BLOCK)
    tokens: dict[int, list[int]] = {}
    waiting: deque[int] = deque()
    running: dict[int, bool] = {}  # admitted sequences -> computed and committed yet
    served: set[BlockHash] = set()
    next_id = iterations = finished = preempts = 0

    def preempt(victim: int) -> None:
        nonlocal preempts
        before = m.token_ids(victim)
        m.preempt(victim)
        assert m.token_ids(victim) == before
        del running[victim]
        waiting.append(victim)
        preempts += 1

    try:
        deadline = time.monotonic() + 0.8
        while time.monotonic() < deadline:
            iterations += 1
            if len(waiting) + len(running) < 6 and rng.random() < 0.5:
                tokens[next_id] = work.prompt()
                m.add_sequence(next_id, tokens[next_id])
                served.update(m.block_hashes(next_id))
                waiting.append(next_id)
                next_id += 1
            if waiting:
                sid = waiting[0]
                cached = m.lookup(sid)
                if m.allocate(sid, len(tokens[sid]) - cached.total) is not None:
                    waiting.popleft()
                    running[sid] = False
                elif running and rng.random() < 0.05:
                    preempt(rng.choice(list(running)))
            if running and rng.random() < 0.02:
                preempt(rng.choice(list(running)))
            sim.step()
            time.sleep(0)  # the forward pass: the GIL is free for the I/O threads meanwhile
            for sid in list(running):
                if not m.is_ready(sid):
                    continue
                if not running[sid]:
                    toks = tokens[sid]
                    if len(toks) > len(m.block_table(sid)) * BLOCK:
                        # a read fell short: allocate the rest now, compute after the next step has run
                        # this allocation's copies (an evicted block's save must precede its reuse)
                        m.allocate(sid, len(toks) - m.num_computed_tokens(sid))
                        continue
                    sim.check_sequence(sid)  # whatever came from device, host or storage is the right KV
                    sim.compute(sid, len(toks))
                    m.commit(sid, len(toks))
                    running[sid] = True
                elif rng.random() < 0.3:
                    m.free(sid)
                    del running[sid]
                    finished += 1
            if iterations % 25 == 0:
                m.check_integrity()
                sim.check_cached()

        for sid in [*running, *waiting]:
            m.free(sid)
        sim.step()  # completes the plan holding the last preempted blocks
        assert m.num_pending_admissions == 0 and m.pool.num_in_use == 0
        assert m.flush(10)
        m.check_integrity()
        sim.check_cached()

        stats, tier = m.stats, m.tier_stats
        assert iterations > 200 and finished > 20 and preempts > 10, (iterations, finished, preempts)
        assert stats.readmissions > 0 and tier.storage.loads_hit > 0
        assert tier.storage.loads_corrupt == 0 and tier.storage.load_errors == 0
        if slow_reads:
            assert tier.storage.load_timeouts > 0
            assert any(r.timed_out for r in sim.results)
        else:
            assert tier.storage.load_timeouts == 0
            assert stats.hit_tokens_storage + stats.readmission_hit_tokens_storage > 0, stats
        w = tier.writer
        assert w.dropped > 0 and w.written > 0 and w.failed == 0, w
        assert w.submitted == w.written + w.skipped_existing + w.dropped + w.failed, w
        assert w.submitted == tier.storage.saves_queued  # one rank: one entry per saved block

        # Everything in storage is an entry of a served hash, holding exactly that hash's KV.
        found = check_stored_entries(m, inner, served)
        assert found == len(inner) == w.written
        if kind == "file":
            files = [p for p in (tmp_path / "kv").rglob("*") if p.is_file()]
            assert len(files) == found and not [p for p in files if p.name.startswith(".tmp-")]
    finally:
        m.close(1)


# ---------------------------------------------------------------- 3. a backend that never answers


class StuckStorage:
    """Wraps a backend; while ``answer`` is clear, get() and exists() block (a server that never replies)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.stats = inner.stats
        self.answer = threading.Event()
        self.answer.set()
        self.stuck = threading.Event()  # set once a call is blocked

    def _wait(self) -> None:
        if not self.answer.is_set():
            self.stuck.set()
            self.answer.wait(10)  # bounded: a broken test fails instead of hanging

    def get(self, keys):
        self._wait()
        return self.inner.get(keys)

    def exists(self, keys):
        self._wait()
        return self.inner.exists(keys)

    def put(self, items):
        return self.inner.put(items)

    def contains(self, keys):
        return self.inner.contains(keys)

    def delete(self, keys):
        return self.inner.delete(keys)

    def close(self) -> None:
        self.answer.set()


def test_a_backend_that_never_answers_times_loads_out_and_serving_goes_on() -> None:
    backend = StuckStorage(MemoryStorage())
    timeout = 0.3
    tiers = TierConfig(num_host_blocks=4, storage=backend, entry_format=FORMAT, storage_timeout_s=timeout)
    m = TieredKVCacheManager(32, BLOCK, tiers=tiers)
    sim = RecordingEngine(m)
    try:
        warm = list(range(100, 100 + 5 * BLOCK))
        p_tokens = list(range(200, 200 + 5 * BLOCK)) + [1, 2, 3]
        s_tokens = list(range(300, 300 + 5 * BLOCK)) + [4, 5]
        p_hashes, s_hashes = hashes_of(p_tokens), hashes_of(s_tokens)
        store_directly(m, backend.inner, p_hashes + s_hashes)  # another node stored both prompts
        sim.serve("warm", warm + [9])

        m.add_sequence("p", p_tokens)
        m.add_sequence("s", s_tokens)
        assert m.block_hashes("p") == p_hashes
        wait_for(lambda: m.lookup("p").storage == m.lookup("s").storage == 5 * BLOCK, what="probes")
        assert m.storage.healthy

        backend.answer.clear()  # from now on the backend never answers
        assert m.allocate("p", len(p_tokens) - 5 * BLOCK) is not None
        admitted = time.monotonic()
        assert not m.is_ready("p")
        sim.step()
        wait_for(backend.stuck.is_set, what="the reader to block in get()")

        # Meanwhile other requests are served from the device (and host), unaffected.
        device_before = m.stats.hit_tokens_device
        sim.serve("warm2", warm + [7, 7])
        assert m.stats.hit_tokens_device >= device_before + 5 * BLOCK

        sim.wait_ready("p", timeout=5 * timeout + 2)
        waited = time.monotonic() - admitted
        assert timeout * 0.9 <= waited < timeout + 2, waited
        (result,) = sim.results_of("p")
        assert result.timed_out and result.blocks == () and result.requested == 5
        stats = m.tier_stats.storage
        assert stats.load_timeouts == 5 and stats.loads_hit == 0
        assert not m.storage.healthy
        assert m.stats.hit_tokens_storage == 0
        # p computes what storage could not give it.
        assert m.num_computed_tokens("p") == 0 and len(m.block_table("p")) == 0
        finish_admitted(sim, "p", p_tokens)
        m.check_integrity()

        # Still stuck after a timeout: even a prompt the index knows is stored reports no storage hits
        # (nothing more is queued behind the stuck read), and serving others never waits on the backend.
        assert m.lookup("s").storage == 0
        assert m.storage.is_known(s_hashes[0])
        sim.serve("warm3", warm + [8, 8, 8])
        sim.check_cached()

        backend.answer.set()  # the backend answers again
        wait_for(lambda: m.storage.healthy, what="the storage tier to recover")
        assert m.lookup("s").storage == 5 * BLOCK
        finish(sim, "s", s_tokens)
        (result,) = sim.results_of("s")
        assert result.complete and not result.timed_out
        assert m.stats.hit_tokens_storage == 5 * BLOCK
        # The abandoned read of p completed late, and the backend's counters include it.
        assert m.tier_stats.storage.loads_hit >= 5
        m.check_integrity()
        sim.check_cached()
    finally:
        backend.answer.set()
        m.close(1)


def test_entries_lost_or_damaged_behind_the_index_cost_misses_never_wrong_kv() -> None:
    """Another node's budget evicted an entry the index knows, and one got damaged: the leading run loads."""
    backend = MemoryStorage()
    m = TieredKVCacheManager(16, BLOCK, tiers=TierConfig(storage=backend, entry_format=FORMAT))
    sim = RecordingEngine(m)
    try:
        q_tokens = list(range(700, 700 + 6 * BLOCK)) + [1]
        r_tokens = list(range(800, 800 + 6 * BLOCK)) + [2]
        q_hashes, r_hashes = hashes_of(q_tokens), hashes_of(r_tokens)
        store_directly(m, backend, q_hashes + r_hashes)
        m.add_sequence("q", q_tokens)
        m.add_sequence("r", r_tokens)
        wait_for(lambda: m.lookup("q").storage == m.lookup("r").storage == 6 * BLOCK, what="probes")
        (lost,) = m.storage.keys_of(q_hashes[2])
        assert backend.delete([lost]) == 1
        (damaged,) = m.storage.keys_of(r_hashes[3])
        entry = backend.get([damaged])[0]
        backend.put([(damaged, entry[:-1] + bytes([entry[-1] ^ 1]))])

        finish(sim, "q", q_tokens)
        finish(sim, "r", r_tokens)
        ((q_result,), (r_result,)) = sim.results_of("q"), sim.results_of("r")
        assert len(q_result.blocks) == 2 and q_result.requested == 6 and not q_result.complete
        assert len(r_result.blocks) == 3 and r_result.requested == 6
        assert m.stats.hit_tokens_storage == (2 + 3) * BLOCK
        stats = m.tier_stats.storage
        assert stats.loads_hit == 5 and stats.loads_missing == 1 and stats.loads_corrupt == 1
        assert not m.storage.is_known(q_hashes[2]) and not m.storage.is_known(r_hashes[3])
        assert backend.get([damaged]) == [None]  # the corrupt entry was removed
        m.check_integrity()
        sim.check_cached()
    finally:
        m.close(1)


# ---------------------------------------------------------------- 4. disk full / permission denied


@pytest.mark.parametrize(
    "make_error",
    [
        lambda: OSError(errno.ENOSPC, "No space left on device"),
        lambda: PermissionError(errno.EACCES, "Permission denied"),
    ],
    ids=["ENOSPC", "EACCES"],
)
def test_file_storage_write_failures_are_dropped_and_counted(make_error, tmp_path, monkeypatch) -> None:
    root = tmp_path / "kv"
    backend = FileStorage(root)
    broken = threading.Event()
    broken.set()
    real_open = open

    def failing_open(file, mode="r", *args, **kwargs):
        if broken.is_set() and set(mode) & set("wxa"):  # any open for writing
            raise make_error()
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(file_storage_module, "open", failing_open, raising=False)
    tiers = TierConfig(num_host_blocks=4, storage=backend, entry_format=FORMAT)
    m = TieredKVCacheManager(10, BLOCK, tiers=tiers)
    sim = RecordingEngine(m)
    work = Workload(seed=3)
    served: dict[str, list[int]] = {}
    try:
        for i in range(30):
            served[f"a{i}"] = work.prompt()
            sim.serve(f"a{i}", served[f"a{i}"])
        assert m.flush(10)
        w = m.tier_stats.writer
        assert w.failed > 0 and w.written == 0, w
        assert backend.stats.put_errors == w.failed and backend.stats.puts == 0
        assert_writer_balanced(m)
        assert not [p for p in root.rglob("*") if p.is_file()]  # nothing, not even a temporary
        hashes = {h for tokens in served.values() for h in hashes_of(tokens)}
        assert not any(m.storage.is_known(h) for h in hashes)  # a failed write is never a storage hit
        assert m.stats.hit_tokens_device > 0 and m.stats.hit_tokens_storage == 0
        m.check_integrity()
        sim.check_cached()

        broken.clear()  # space freed / permissions fixed: writes resume
        for i in range(30):
            served[f"b{i}"] = work.prompt()
            sim.serve(f"b{i}", served[f"b{i}"])
        assert m.flush(10)
        w2 = m.tier_stats.writer
        assert w2.written > 0 and w2.failed == w.failed
        assert_writer_balanced(m)
        hashes = {h for tokens in served.values() for h in hashes_of(tokens)}
        assert check_stored_entries(m, backend, hashes) == w2.written
        m.check_integrity()
        sim.check_cached()
    finally:
        m.close(1)


# ---------------------------------------------------------------- 5. save_on_preempt snapshots


class Arena:
    """Device memory as one bytearray, so a save's payload can be a view that later writes overwrite."""

    def __init__(self, num_blocks: int) -> None:
        self.buf = bytearray(GARBAGE * num_blocks)

    def _span(self, block: int) -> slice:
        return slice(block * PAYLOAD, (block + 1) * PAYLOAD)

    def __setitem__(self, block: int, value: bytes) -> None:
        self.buf[self._span(block)] = value

    def get(self, block: int, default: bytes | None = None) -> bytes:
        return bytes(self.buf[self._span(block)])

    def view(self, block: int) -> memoryview:
        return memoryview(self.buf)[self._span(block)]


class ArenaEngine(RecordingEngine):
    """Hands ``complete_transfers`` views of live device memory, as an engine with pinned staging might."""

    def __init__(self, manager: TieredKVCacheManager) -> None:
        super().__init__(manager)
        self.device = Arena(manager.num_blocks)  # type: ignore[assignment]

    def run_plan(self) -> TransferPlan:
        plan = self.m.take_transfers()
        self.plans.append(plan)
        saved = [self.device.view(s.block) if s.tier == "device" else self.host[s.block] for s in plan.saves]
        for device_block, host_block in plan.swap_outs:
            self.host[host_block] = self.read_device(device_block)
        for host_block, device_block in plan.swap_ins:
            self.device[device_block] = self.host[host_block]
        self.m.complete_transfers(plan, saved=saved if plan.saves else None)
        return plan


class GatedStorage(MemoryStorage):
    """MemoryStorage whose put() waits for ``release``: the writer thread is frozen in its first batch."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def put(self, items):
        self.entered.set()
        self.release.wait(10)
        return super().put(items)


def test_save_on_preempt_snapshots_before_the_blocks_are_reused() -> None:
    backend = GatedStorage()
    tiers = TierConfig(storage=backend, entry_format=FORMAT, storage_policy="off", save_on_preempt=True)
    m = TieredKVCacheManager(8, BLOCK, tiers=tiers)
    sim = ArenaEngine(m)
    try:
        a_tokens = list(range(500, 500 + 6 * BLOCK + 1))
        m.add_sequence("a", a_tokens)
        assert m.allocate("a", len(a_tokens)) is not None
        sim.step()
        sim.compute("a", len(a_tokens))
        m.commit("a", len(a_tokens))
        a_table = list(m.block_table("a"))
        a_hashes = m.block_hashes("a")
        assert len(a_table) == 7 and len(a_hashes) == 6

        m.preempt("a")
        assert m.token_ids("a") == tuple(a_tokens)
        assert all(m.pool.ref_count(b) > 0 for b in a_table[:6])  # held for the planned saves
        # Pool pressure: b needs every block, but a's are held until the saves have run.
        b_tokens = list(range(900, 900 + 8 * BLOCK))  # every block of the pool, all full
        m.add_sequence("b", b_tokens)
        assert m.allocate("b", len(b_tokens)) is None
        m.check_integrity()

        plan = m.take_transfers()
        assert [s.block_hash for s in plan.saves] == list(a_hashes)
        assert [s.block for s in plan.saves] == a_table[:6]
        assert all(m.pool.ref_count(b) > 0 for b in a_table[:6])  # taken, not completed: still held
        assert m.allocate("b", len(b_tokens)) is None
        saved = [sim.device.view(s.block) for s in plan.saves]
        m.complete_transfers(plan, saved=saved)
        assert all(m.pool.ref_count(b) == 0 for b in a_table)
        wait_for(backend.entered.is_set, what="the writer to start its first batch")

        # The writer is frozen inside put(); b reuses a's blocks and overwrites their memory.
        assert m.allocate("b", len(b_tokens)) is not None
        reused = set(m.block_table("b")) & set(a_table[:6])
        assert reused == set(a_table[:6])
        sim.step()
        sim.compute("b", len(b_tokens))
        m.commit("b", len(b_tokens))
        sim.check_sequence("b")
        assert all(sim.read_device(b) != content_of(h) for b, h in zip(a_table, a_hashes, strict=False))
        del saved

        backend.release.set()
        assert m.flush(10)
        w = m.tier_stats.writer
        assert w.written == 6 and w.dropped == w.failed == 0
        assert check_stored_entries(m, backend, set(a_hashes)) == 6  # the snapshot, not b's KV
        assert m.token_ids("a") == tuple(a_tokens)
        m.free("b")

        # a comes back from storage with its own KV.
        assert m.lookup("a").storage == 6 * BLOCK
        finish(sim, "a", a_tokens)
        (result,) = sim.results_of("a")
        assert result.complete and len(result.blocks) == 6
        assert m.stats.readmission_hit_tokens_storage == 6 * BLOCK
        m.check_integrity()
        sim.check_cached()
    finally:
        backend.release.set()
        m.close(1)
