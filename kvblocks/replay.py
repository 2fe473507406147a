"""Replaying a request trace through a manager (or a router over several), and sweeping capacities.

Each request is admitted the way an engine admits it -- ``lookup``, ``allocate``, ``commit`` of the
prompt -- stays running while ``concurrency - 1`` later requests arrive, then is freed. When a request
does not fit, the oldest running ones are freed first (as a scheduler would wait for them).

Hit rates follow the manager's rules: full blocks only, never the prompt's last token. A
Mooncake trace's published figure counts differently -- every hash id, the partial last block too,
with an unlimited cache -- and ``reference=True`` replays it that way: each id becomes one full block
and nothing is held back, so the manager itself reproduces the figure.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvblocks.core.eviction import DEFAULT_EVICTION, check_eviction
from kvblocks.core.manager import KVCacheManager
from kvblocks.errors import ConfigError
from kvblocks.events import EventRecord, EventSink
from kvblocks.traces import Trace, TraceRequest

__all__ = [
    "LIMITS",
    "MAX_BLOCKS",
    "ReplayResult",
    "check_setting",
    "min_blocks",
    "replay",
    "sweep",
    "unlimited_blocks",
    "working_set_blocks",
]

MAX_BLOCKS = 1 << 24
"""The most device (or host) blocks a replay allocates in all: every block costs about 80 bytes of
bookkeeping and 0.5 microseconds to set up, so the bound is about 1.3 GB and 9 s before the first
request. Far beyond a real GPU's pool (an 80 GB GPU holds about 40,000 blocks of llama-3-8b)."""

LIMITS: dict[str, tuple[int, int]] = {
    "blocks": (1, MAX_BLOCKS),
    "block_size": (1, 1 << 16),
    "concurrency": (1, 1 << 20),
    "workers": (1, 1024),
    "host_blocks": (0, MAX_BLOCKS),
    "storage_blocks": (0, 1 << 40),
}
"""Inclusive bounds of ``replay``'s integer settings (checked before anything is allocated)."""


@dataclass
class ReplayResult:
    """What a replay measured (plain numbers; ``as_dict`` for JSON)."""

    trace: str
    requests: int
    block_size: int
    capacity_blocks: int
    workers: int
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hit_tokens_device: int = 0
    hit_tokens_host: int = 0
    hit_tokens_storage: int = 0
    host_blocks: int = 0
    storage_blocks: int = 0
    prompt_blocks: int = 0
    hit_blocks: int = 0
    evicted_blocks: int = 0
    host_evicted_blocks: int = 0
    peak_blocks_in_use: int = 0
    seconds: float = 0.0
    """The replay itself, first request to last free."""
    setup_seconds: float = 0.0
    """Creating the managers before the first request (about 0.5 microseconds a block)."""
    check_seconds: float | None = None
    """The final ``check_integrity`` of every manager (None: not asked for)."""
    worker_prefill_tokens: list[int] = field(default_factory=list)
    eviction: str = DEFAULT_EVICTION
    """The eviction policy every tier's blocks were replayed with."""

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def load_balance(self) -> float | None:
        """max/min of the prefill tokens each worker computed (None with one worker)."""
        tokens = self.worker_prefill_tokens
        if len(tokens) < 2:
            return None
        return max(tokens) / max(1, min(tokens))

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            token_hit_rate=self.token_hit_rate,
            block_hit_rate=self.block_hit_rate,
            requests_per_second=self.requests_per_second,
            load_balance=self.load_balance,
        )
        return out


def _shape(trace: Trace, request: TraceRequest, block_size: int, reference: bool) -> tuple[dict[str, Any], int]:
    """add_sequence keyword arguments and the number of prompt blocks counted for a request."""
    if request.hash_ids is not None:
        ids = request.hash_ids
        if reference:  # every id is a full block; one extra token so none is held back as the last
            return {"block_hashes": ids, "num_tokens": len(ids) * block_size + 1}, len(ids)
        full = request.num_tokens // block_size
        return {"block_hashes": ids[:full], "num_tokens": request.num_tokens}, full
    return {"token_ids": request.token_ids}, request.num_tokens // block_size


def check_setting(name: str, value: object) -> None:
    """Refuse a setting outside ``LIMITS`` (before it sizes any allocation)."""
    low, high = LIMITS[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ConfigError(f"{name} must be >= {low}, got {value}")
    if value > high:
        raise ConfigError(f"{name} must be <= {high:,}, got {value:,}")


def _largest(shapes: Sequence[tuple[dict[str, Any], int]], block_size: int) -> int:
    return max(-(-_tokens(kw) // block_size) for kw, _ in shapes)


def min_blocks(trace: Trace, *, block_size: int = 16, workers: int = 1, reference: bool = False) -> int:
    """The fewest total blocks ``replay`` accepts: every worker must hold the largest request."""
    if trace.kind == "hash_ids":
        block_size = trace.block_tokens or block_size
    shapes = [_shape(trace, r, block_size, reference) for r in trace.requests]
    return _largest(shapes, block_size) * workers


def working_set_blocks(trace: Trace, block_size: int | None = None) -> int:
    """Distinct full blocks over the whole trace (what an unlimited cache would end up holding)."""
    if trace.kind == "hash_ids":
        return len({h for r in trace.requests for h in (r.hash_ids or ())})
    size = block_size or 16
    from kvblocks.hashing import block_hashes

    seen: set[object] = set()
    for r in trace.requests:
        seen.update(block_hashes(r.token_ids or (), size))
    return len(seen)


def unlimited_blocks(trace: Trace, *, block_size: int = 16, concurrency: int = 1, workers: int = 1) -> int:
    """The capacity at which a replay evicts nothing: what ``replay`` uses without ``blocks``, and a sweep's 100%.

    Every worker gets room for the whole working set -- the router may send any block to any worker --
    plus one block for each request that may be running on it: a running request holds at most one
    block outside the working set (its partial last block -- with ``reference``, the one extra token --
    or its last full block, recomputed because the last prompt token is never a hit).
    """
    if trace.kind == "hash_ids":
        block_size = trace.block_tokens or block_size
    running = min(concurrency * workers, len(trace))
    return (working_set_blocks(trace, block_size) + running + 1) * workers


def replay(
    trace: Trace,
    *,
    blocks: int | None = None,
    block_size: int = 16,
    concurrency: int = 1,
    workers: int = 1,
    reference: bool = False,
    host_blocks: int = 0,
    storage_blocks: int = 0,
    progress: Callable[[int], None] | None = None,
    check: bool = False,
    eviction: str = DEFAULT_EVICTION,
) -> ReplayResult:
    """Replay ``trace``; ``blocks`` is the total device capacity (None: :func:`unlimited_blocks`).

    ``eviction`` names the eviction policy of every tier's blocks (device and host): ``"lru"``
    (default) or ``"s3fifo"`` (:mod:`kvblocks.core.eviction`).

    ``host_blocks`` (split over the workers) adds a host tier with write-back; ``storage_blocks``
    adds one storage tier shared by all workers (in memory, an LRU byte budget of that many
    entries). Hits are then reported per tier. ``check`` runs every manager's ``check_integrity``
    at the end (O(blocks): on 16M blocks it takes longer than the replay) and times it.
    """
    if trace.kind == "hash_ids":
        block_size = trace.block_tokens or block_size
    elif reference:
        raise ConfigError("reference counting applies to hash-id traces (the published Mooncake figures)")
    settings = {"concurrency": concurrency, "workers": workers, "block_size": block_size}
    settings.update(host_blocks=host_blocks, storage_blocks=storage_blocks)
    for name, value in settings.items():
        check_setting(name, value)
    check_eviction(eviction)
    shapes = [_shape(trace, r, block_size, reference) for r in trace.requests]
    largest = _largest(shapes, block_size)
    if blocks is None:  # room for everything; more concurrency than requests changes nothing
        blocks = unlimited_blocks(trace, block_size=block_size, concurrency=concurrency, workers=workers)
        if blocks > MAX_BLOCKS:
            raise ConfigError(
                f"an unlimited cache for this trace over {workers} worker(s) needs {blocks:,} blocks, "
                f"over {MAX_BLOCKS:,}: give a capacity"
            )
    check_setting("blocks", blocks)
    per_worker = blocks // workers
    if per_worker < largest:
        raise ConfigError(
            f"{blocks} blocks over {workers} worker(s) cannot hold the trace's largest request ({largest} blocks)"
        )
    started = time.perf_counter()
    sinks = [EventSink(capacity=0) for _ in range(workers)]
    managers = _managers(workers, per_worker, block_size, sinks, host_blocks // workers, storage_blocks, eviction)
    tiered = host_blocks > 0 or storage_blocks > 0
    router = _router(workers, block_size, sinks)
    result = ReplayResult(trace.name, len(trace), block_size, per_worker * workers, workers, eviction=eviction)
    result.host_blocks, result.storage_blocks = host_blocks, storage_blocks
    result.worker_prefill_tokens = [0] * workers
    running: deque[tuple[Hashable, int, Any]] = deque()
    result.setup_seconds = time.perf_counter() - started
    started = time.perf_counter()
    try:
        for i, (kwargs, prompt_blocks) in enumerate(shapes):
            lease = None
            if router is not None:
                lease = router.route(block_hashes=_hashes_for_routing(managers[0], kwargs), num_tokens=_tokens(kwargs))
                w = lease.worker
            else:
                w = 0
            m = managers[w]
            m.add_sequence(i, **kwargs)
            num_tokens = m.num_tokens(i)
            while m.allocate(i, num_tokens - m.lookup(i).total) is None:
                _finish_oldest(running, managers, w)
            if tiered:
                _settle(m, i, num_tokens, running, managers, w)
            cached = m.num_computed_tokens(i)
            m.commit(i, num_tokens)
            if lease is not None:
                lease.prefill_done()
            result.prompt_tokens += trace.requests[i].num_tokens if not reference else num_tokens - 1
            result.prompt_blocks += prompt_blocks
            result.hit_blocks += cached // block_size
            result.worker_prefill_tokens[w] += num_tokens - cached
            result.peak_blocks_in_use = max(result.peak_blocks_in_use, sum(x.pool.num_in_use for x in managers))
            running.append((i, w, lease))
            if len(running) >= concurrency * workers:
                _finish(running.popleft(), managers)
            if progress is not None:
                progress(1)
        while running:
            _finish(running.popleft(), managers)
        result.seconds = time.perf_counter() - started
        for m in managers:
            stats = m.stats
            result.hit_tokens_device += stats.hit_tokens_device
            result.hit_tokens_host += stats.hit_tokens_host
            result.hit_tokens_storage += stats.hit_tokens_storage
            result.evicted_blocks += stats.evicted_blocks
            if tiered:
                result.host_evicted_blocks += m.tier_stats.host_evicted
        if check:
            started = time.perf_counter()
            for m in managers:
                m.check_integrity()
            result.check_seconds = time.perf_counter() - started
        result.hit_tokens = result.hit_tokens_device + result.hit_tokens_host + result.hit_tokens_storage
    finally:
        for m in managers:
            close = getattr(m, "close", None)
            if close is not None:
                close(timeout=5)
    return result


def _managers(
    workers: int,
    per_worker: int,
    block_size: int,
    sinks: list[EventSink],
    host: int,
    storage: int,
    eviction: str = DEFAULT_EVICTION,
) -> list[Any]:
    """Plain managers, or tiered ones over a host tier each and one shared in-memory storage tier."""
    events = [sinks[i] if workers > 1 else None for i in range(workers)]
    if not host and not storage:
        return [KVCacheManager(per_worker, block_size, event_sink=events[i], eviction=eviction) for i in range(workers)]
    from kvblocks.hashing import DEFAULT_SCHEME
    from kvblocks.tiers import EntryFormat, MemoryStorage, TierConfig
    from kvblocks.tiers.entry import HEADER

    entry = EntryFormat(DEFAULT_SCHEME, "uint8", (1,), 0, 1)  # bookkeeping only: a one-byte payload
    shared = MemoryStorage(byte_budget=storage * (HEADER.size + 1)) if storage else None
    config = TierConfig(
        num_host_blocks=host,
        storage=shared,
        entry_format=entry if shared is not None else None,
        host_eviction=eviction,
    )
    return [
        KVCacheManager(per_worker, block_size, tiers=config, event_sink=events[i], eviction=eviction)
        for i in range(workers)
    ]


def _settle(m: Any, seq: int, num_tokens: int, running: Any, managers: list[Any], w: int) -> None:
    """Run the admission's copies (bookkeeping only) until the sequence is ready; allocate what a short
    read left to compute."""
    deadline = time.monotonic() + 30
    while True:
        _run_plan(m)
        m.poll_loads()
        if m.is_ready(seq):
            break
        if time.monotonic() > deadline:
            raise ConfigError("a storage read never finished")
        if m.storage is not None:
            m.storage.wait_idle(0.05)
    if len(m.block_table(seq)) * m.block_size >= num_tokens:
        return
    while m.allocate(seq, num_tokens - m.num_computed_tokens(seq)) is None:  # a read fell short
        _finish_oldest(running, managers, w)
    _run_plan(m)


def _run_plan(m: Any) -> None:
    """Take the step's copies and report them done; the replay moves no data, so saves carry one byte."""
    plan = m.take_transfers()
    m.complete_transfers(plan, saved={g.group: [b"\0"] * len(g.saves) for g in plan.group_transfers if g.saves})


def _tokens(kwargs: dict[str, Any]) -> int:
    return int(kwargs["num_tokens"]) if "num_tokens" in kwargs else len(kwargs["token_ids"])


def _hashes_for_routing(m: KVCacheManager, kwargs: dict[str, Any]) -> Sequence[object]:
    if "block_hashes" in kwargs:
        return list(kwargs["block_hashes"])
    from kvblocks.hashing import block_hashes

    return block_hashes(kwargs["token_ids"], m.block_size)


def _router(workers: int, block_size: int, sinks: list[EventSink]) -> Any:
    if workers == 1:
        return None
    from kvblocks.routing import Router, RouterConfig

    router = Router(range(workers), RouterConfig(block_size=block_size))

    def follow(worker: int) -> Callable[[EventRecord], None]:
        return lambda record: router.apply_events(worker, (record.event,))

    for w, sink in enumerate(sinks):
        sink.subscribe(follow(w))
    return router


def _finish(entry: tuple[Hashable, int, Any], managers: list[Any]) -> None:
    seq, w, lease = entry
    managers[w].free(seq)
    if lease is not None:
        lease.release()


def _finish_oldest(running: deque[tuple[Hashable, int, Any]], managers: list[Any], worker: int) -> None:
    """Free the oldest running request on ``worker`` (the pool is full: wait for it to finish)."""
    for k, entry in enumerate(running):
        if entry[1] == worker:
            del running[k]
            _finish(entry, managers)
            return
    raise ConfigError("a request does not fit an empty worker: give the replay more blocks")


def sweep(trace: Trace, capacities: Sequence[int], **options: Any) -> list[ReplayResult]:
    """``replay`` at each capacity (in blocks)."""
    return [replay(trace, blocks=c, **options) for c in capacities]
