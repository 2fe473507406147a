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

from kvblocks.errors import ConfigError
from kvblocks.events import EventRecord, EventSink
from kvblocks.manager import KVCacheManager
from kvblocks.traces import Trace, TraceRequest

__all__ = ["ReplayResult", "replay", "sweep", "working_set_blocks"]


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
    prompt_blocks: int = 0
    hit_blocks: int = 0
    evicted_blocks: int = 0
    peak_blocks_in_use: int = 0
    seconds: float = 0.0
    worker_prefill_tokens: list[int] = field(default_factory=list)

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


def replay(
    trace: Trace,
    *,
    blocks: int | None = None,
    block_size: int = 16,
    concurrency: int = 1,
    workers: int = 1,
    reference: bool = False,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Replay ``trace``; ``blocks`` is the total capacity (None: room for everything)."""
    if trace.kind == "hash_ids":
        block_size = trace.block_tokens or block_size
    elif reference:
        raise ConfigError("reference counting applies to hash-id traces (the published Mooncake figures)")
    for name, value in (("concurrency", concurrency), ("workers", workers), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    shapes = [_shape(trace, r, block_size, reference) for r in trace.requests]
    largest = max(-(-(kw.get("num_tokens") or len(kw["token_ids"])) // block_size) for kw, _ in shapes)
    if blocks is None:
        blocks = working_set_blocks(trace, block_size) + largest * concurrency * workers + workers
    per_worker = blocks // workers
    if isinstance(blocks, bool) or not isinstance(blocks, int) or per_worker < largest:
        raise ConfigError(
            f"{blocks} blocks over {workers} worker(s) cannot hold the trace's largest request ({largest} blocks)"
        )
    sinks = [EventSink(capacity=0) for _ in range(workers)]
    managers = [
        KVCacheManager(per_worker, block_size, event_sink=sinks[i] if workers > 1 else None) for i in range(workers)
    ]
    router = _router(workers, block_size, sinks)
    result = ReplayResult(trace.name, len(trace), block_size, per_worker * workers, workers)
    result.worker_prefill_tokens = [0] * workers
    running: deque[tuple[Hashable, int, Any]] = deque()
    started = time.perf_counter()
    for i, (kwargs, prompt_blocks) in enumerate(shapes):
        lease = None
        if router is not None:
            lease = router.route(block_hashes=_hashes_for_routing(managers[0], kwargs), num_tokens=_tokens(kwargs))
            w = lease.worker
        else:
            w = 0
        m = managers[w]
        m.add_sequence(i, **kwargs)
        cached = m.lookup(i).device
        num_tokens = m.num_tokens(i)
        while m.allocate(i, num_tokens - cached) is None:
            _finish_oldest(running, managers, w)
        m.commit(i, num_tokens)
        if lease is not None:
            lease.prefill_done()
        result.prompt_tokens += trace.requests[i].num_tokens if not reference else num_tokens - 1
        result.hit_tokens += cached
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
    result.evicted_blocks = sum(m.stats.evicted_blocks for m in managers)
    for m in managers:
        m.check_integrity()
    return result


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


def _finish(entry: tuple[Hashable, int, Any], managers: list[KVCacheManager]) -> None:
    seq, w, lease = entry
    managers[w].free(seq)
    if lease is not None:
        lease.release()


def _finish_oldest(running: deque[tuple[Hashable, int, Any]], managers: list[KVCacheManager], worker: int) -> None:
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
