"""Prometheus metrics of managers and routers, read when Prometheus scrapes.

Optional: it needs ``prometheus_client`` (``pip install 'kvblocks[prometheus]'``). Neither
``import kvblocks`` nor importing this module imports it; the first object that needs it does.

It is a pull model: a :class:`KVBlocksCollector` keeps references to managers and routers
and reads their snapshots (``stats``, ``tier_stats``, ``decode_counters``, the routers'
worker loads) at scrape time, so the scheduler pays nothing per operation::

    scheduler thread        allocate / commit / free / route ...     (no metrics code runs)
    scrape (HTTP thread)    collector.collect() -> reads stats -> text exposition

The only per-operation hook is optional: :class:`RouterMetrics` counts routing decisions
and their overlap per worker, which a router does not keep. Call ``observe(lease)`` after
each ``route`` (or route through :meth:`RouterMetrics.route`).

>>> from kvblocks import KVCacheManager
>>> from kvblocks.metrics import KVBlocksCollector, exposition
>>> m = KVCacheManager(num_blocks=8, block_size=4)
>>> collector = KVBlocksCollector()
>>> collector.add_manager("gpu0", m)
>>> m.add_sequence("a", list(range(10))); _ = m.allocate("a", 10)
>>> [line for line in exposition(collector).decode().splitlines() if line.startswith("kvblocks_prefix_queried")]
['kvblocks_prefix_queried_tokens_total{cache="gpu0"} 10.0']

Every metric name starts with ``kvblocks_``; counters end in ``_total`` in the exposition.
Token counters count prompt tokens at admission (first admissions and re-admissions after
preemption apart, as :class:`~kvblocks.CacheStats` does); block counters count blocks.

The managers are not thread-safe and a scrape takes no lock on them: a scrape reads
counters the scheduler thread may be changing, so figures of one scrape can be a step
apart from each other. Counters never go backwards.
"""

from __future__ import annotations

import bisect
import math
import socket
import threading
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvblocks.accounting import LIFETIME_BUCKETS, Histogram
from kvblocks.core.manager import KVCacheManager
from kvblocks.disagg import DecodeManager
from kvblocks.errors import BackendUnavailableError, InvalidArgumentError, MissingExtraError
from kvblocks.routing import Lease, Router
from kvblocks.tiers.storage_tier import StorageTier

if TYPE_CHECKING:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

__all__ = [
    "LIFETIME_BUCKETS",
    "OVERLAP_BUCKETS",
    "KVBlocksCollector",
    "MetricsServer",
    "RouterMetrics",
    "exposition",
    "make_registry",
    "start_http_server",
]

OVERLAP_BUCKETS: tuple[float, ...] = (0, 1, 2, 4, 8, 16, 32, 64, 128, math.inf)
"""Upper bounds (blocks) of the ``kvblocks_router_overlap_blocks`` histogram's buckets."""

TIERS = ("device", "host", "storage")


def _require_prometheus() -> None:
    try:
        import prometheus_client  # noqa: F401
    except ImportError as error:
        raise MissingExtraError("kvblocks.metrics needs prometheus_client", "prometheus", str(error)) from None


def _check_name(name: object, what: str) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"{what} name must be a non-empty str, got {name!r}")
    return name


# ---------------------------------------------------------------------------------- router observation


class RouterMetrics:
    """Per-worker routing decisions and their overlap, for one :class:`~kvblocks.routing.Router`.

    A router keeps only its total (``routed``); this counts each decision by worker and
    records the lease's (tier-weighted) overlap in blocks in a histogram with
    :data:`OVERLAP_BUCKETS`. Use one per router, and pass it to
    :meth:`KVBlocksCollector.add_router`. It needs no ``prometheus_client``.

    >>> from kvblocks.routing import Router, RouterConfig
    >>> router = Router(["w0", "w1"], RouterConfig(block_size=4))
    >>> observer = RouterMetrics()
    >>> with observer.route(router, list(range(9))) as lease:
    ...     lease.worker
    'w0'
    >>> observer.decisions()
    {'w0': 1}

    ``observe`` takes a lock (the scrape reads from another thread) and does a bisection:
    under a microsecond per route (0.4 us measured on CPython 3.11).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bounds = OVERLAP_BUCKETS[:-1]  # the last bucket (+Inf) takes the rest
        self._decisions: dict[Hashable, int] = {}
        self._buckets: dict[Hashable, list[int]] = {}  # per worker, non-cumulative counts
        self._sums: dict[Hashable, float] = {}

    def observe(self, lease: Lease) -> None:
        """Count one routing decision: ``lease.worker`` got a request overlapping ``lease.overlap_blocks``."""
        if not isinstance(lease, Lease):
            raise InvalidArgumentError(f"expected a routing Lease, got {type(lease).__name__}")
        worker = lease.worker
        overlap = float(lease.overlap_blocks)
        slot = bisect.bisect_left(self._bounds, overlap)
        with self._lock:
            self._decisions[worker] = self._decisions.get(worker, 0) + 1
            buckets = self._buckets.get(worker)
            if buckets is None:
                buckets = self._buckets[worker] = [0] * len(OVERLAP_BUCKETS)
            buckets[slot] += 1
            self._sums[worker] = self._sums.get(worker, 0.0) + overlap

    def route(self, router: Router, *args: Any, **kwargs: Any) -> Lease:
        """``router.route(*args, **kwargs)``, observed. Returns the lease (release it as usual)."""
        lease = router.route(*args, **kwargs)
        self.observe(lease)
        return lease

    def decisions(self) -> dict[Hashable, int]:
        """Routing decisions per worker so far (a copy)."""
        with self._lock:
            return dict(self._decisions)

    def _snapshot(self) -> list[tuple[Hashable, int, list[int], float]]:
        """(worker, decisions, cumulative bucket counts, overlap sum) per worker observed."""
        with self._lock:
            rows = [(w, n, list(self._buckets[w]), self._sums[w]) for w, n in self._decisions.items()]
        out = []
        for worker, count, buckets, total in rows:
            running = 0
            cumulative = []
            for c in buckets:
                running += c
                cumulative.append(running)
            out.append((worker, count, cumulative, total))
        return out


# ---------------------------------------------------------------------------------- the collector


@dataclass(frozen=True)
class _RouterEntry:
    router: Router
    observer: RouterMetrics | None


def _bucket_label(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


_DOCS: dict[str, str] = {
    # managers (label cache)
    "kvblocks_prefix_queried_tokens": "Prompt tokens of first admissions (the denominator of the hit rate).",
    "kvblocks_prefix_hit_tokens": "Prompt tokens of first admissions found cached, by the tier that held them.",
    "kvblocks_readmission_queried_tokens": "Prompt tokens of re-admissions after preemption (apart from first ones).",
    "kvblocks_readmission_hit_tokens": "Prompt tokens of re-admissions found cached, by the tier that held them.",
    "kvblocks_admissions": "Admitted requests (kind: first admission or re-admission after preemption).",
    "kvblocks_evicted_blocks": "Cached blocks evicted, by tier (storage: entries the backend evicted for room).",
    "kvblocks_blocks": "Blocks by tier and state; the states partition the tier (they sum to its capacity): "
    "in_use: referenced (by sequences; on host, by copies in flight or swap-ins); evictable: idle, holding "
    "cached content; fresh: empty.",
    "kvblocks_blocks_capacity": "Blocks the tier has.",
    "kvblocks_usage_ratio": "Share of the tier's blocks in use (referenced), the same for every tier: "
    "blocks_in_use / capacity. Evictable blocks do not count: an allocation can take them.",
    "kvblocks_preemptions": "Sequences preempted (their blocks released; a later admission is a re-admission).",
    "kvblocks_block_lifetime_seconds": "Evicted device blocks' time from allocation to eviction.",
    "kvblocks_block_idle_before_eviction_seconds": "Evicted device blocks' time from their last release "
    "(last use) to eviction.",
    "kvblocks_swaps": "Block copies between device and host (out: device to host), by outcome.",
    "kvblocks_host_writes_dropped": "Blocks that were to be copied to host but found no host block to take.",
    "kvblocks_storage_reads": "Blocks read from storage, by outcome (corrupt: damaged, removed; "
    "wrong_key: an entry written under another key, removed; cancelled: not read, the admission went away).",
    "kvblocks_storage_reads_requested": "Blocks admissions asked storage for.",
    "kvblocks_storage_writes": "Storage entries to write, by outcome (dropped: queue full or left at close; "
    "no_payload: a plan completed without the saved bytes).",
    "kvblocks_storage_backend_errors": "Failed storage backend operations (entries), by operation.",
    "kvblocks_storage_written_bytes": "Bytes the storage backend stored.",
    "kvblocks_storage_skipped_entries": "Things found where storage entries live that are not entries (links, "
    "FIFOs, directories, sockets, foreign names in a FileStorage directory): skipped, never followed or "
    "removed; counted each time one is met.",
    "kvblocks_decode_handoffs": "Prefill handoffs offered to a decode node, by outcome.",
    "kvblocks_decode_seeded_hit_tokens": "Cached tokens prefill nodes reported with their handoffs (counted there).",
    "kvblocks_decode_hit_tokens": "Cached tokens a decode node found beyond the prefill reports.",
    "kvblocks_decode_transferred_blocks": "Blocks transferred from prefill nodes.",
    # routers (label router)
    "kvblocks_router_decisions": "Requests routed.",
    "kvblocks_router_leaked_leases": "Routing leases garbage collected unreleased (released then).",
    "kvblocks_router_silent_reports": "Times a worker was found silent (routed to, no KV event for silent_after_s).",
    "kvblocks_router_running": "Requests holding a lease on the worker.",
    "kvblocks_router_inflight_prefill_tokens": "Prefill tokens routed to the worker and not reported done.",
    "kvblocks_router_cached_blocks": "Block hashes the router's index holds for the worker (all tiers).",
    "kvblocks_router_silent_workers": "Workers whose KV event stream went silent.",
    "kvblocks_router_draining_workers": "Workers taking no new requests.",
    "kvblocks_router_worker_decisions": "Requests routed to the worker (needs a RouterMetrics observer).",
    "kvblocks_router_overlap_blocks": "Cached prefix the chosen worker held per routed request, in tier-weighted "
    "blocks (needs a RouterMetrics observer).",
}


class _Families:
    """The metric families of one scrape, created on first use; empty ones are not exposed."""

    def __init__(self) -> None:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        self._new_counter = CounterMetricFamily
        self._new_gauge = GaugeMetricFamily
        self._new_histogram = HistogramMetricFamily
        self._counters: dict[str, CounterMetricFamily] = {}
        self._gauges: dict[str, GaugeMetricFamily] = {}
        self._histograms: dict[str, HistogramMetricFamily] = {}

    def counter(self, name: str, labels: dict[str, str], value: float) -> None:
        family = self._counters.get(name)
        if family is None:
            family = self._counters[name] = self._new_counter(name, _DOCS[name], labels=list(labels))
        family.add_metric(list(labels.values()), value)

    def gauge(self, name: str, labels: dict[str, str], value: float) -> None:
        family = self._gauges.get(name)
        if family is None:
            family = self._gauges[name] = self._new_gauge(name, _DOCS[name], labels=list(labels))
        family.add_metric(list(labels.values()), value)

    def histogram(self, name: str, labels: dict[str, str], buckets: list[tuple[str, float]], total: float) -> None:
        family = self._histograms.get(name)
        if family is None:
            family = self._histograms[name] = self._new_histogram(name, _DOCS[name], labels=list(labels))
        family.add_metric(list(labels.values()), buckets, total)

    def __iter__(self) -> Iterator[Metric]:
        yield from self._counters.values()
        yield from self._gauges.values()
        yield from self._histograms.values()


class KVBlocksCollector:
    """A ``prometheus_client`` collector of managers' and routers' counters, read at scrape time.

    Register it in a ``CollectorRegistry`` (``registry.register(collector)``), or serve it
    with :func:`start_http_server`, or render it with :func:`exposition`. Names given to
    :meth:`add_manager` and :meth:`add_router` share one namespace and become the ``cache``
    and ``router`` labels. Adding and removing are thread-safe against scrapes.

    Raises :class:`~kvblocks.errors.BackendUnavailableError` when ``prometheus_client`` is
    not installed.
    """

    def __init__(self) -> None:
        _require_prometheus()
        self._lock = threading.Lock()
        self._managers: dict[str, KVCacheManager] = {}
        self._routers: dict[str, _RouterEntry] = {}

    def add_manager(self, name: str, manager: KVCacheManager) -> None:
        """Expose ``manager`` (any :class:`~kvblocks.KVCacheManager`: tiered and decode managers add
        their tier and handoff counters) under the label ``cache=name``."""
        _check_name(name, "cache")
        if not isinstance(manager, KVCacheManager):
            raise InvalidArgumentError(f"add_manager needs a KVCacheManager, got {type(manager).__name__}")
        with self._lock:
            self._check_free(name)
            self._managers[name] = manager

    def add_router(self, name: str, router: Router, observer: RouterMetrics | None = None) -> None:
        """Expose ``router`` under the label ``router=name``; with ``observer`` (the :class:`RouterMetrics`
        the engine feeds its leases to), also its per-worker decisions and overlap histogram."""
        _check_name(name, "router")
        if not isinstance(router, Router):
            raise InvalidArgumentError(f"add_router needs a Router, got {type(router).__name__}")
        if observer is not None and not isinstance(observer, RouterMetrics):
            raise InvalidArgumentError(f"observer must be a RouterMetrics or None, got {type(observer).__name__}")
        with self._lock:
            self._check_free(name)
            self._routers[name] = _RouterEntry(router, observer)

    def _check_free(self, name: str) -> None:
        if name in self._managers or name in self._routers:
            raise InvalidArgumentError(f"a cache or router named {name!r} is already added")

    def remove(self, name: str) -> None:
        """Stop exposing the manager or router added as ``name``."""
        with self._lock:
            if self._managers.pop(name, None) is None and self._routers.pop(name, None) is None:
                raise InvalidArgumentError(f"no cache or router named {name!r} was added")

    @property
    def names(self) -> list[str]:
        """The names added, managers first."""
        with self._lock:
            return [*self._managers, *self._routers]

    def describe(self) -> list[Metric]:
        """Nothing: the metrics depend on what is added, so a registry does not reserve their names."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The metric families of everything added, read now (what a registry calls per scrape)."""
        with self._lock:
            managers = list(self._managers.items())
            routers = list(self._routers.items())
        families = _Families()
        for name, manager in managers:
            _collect_manager(families, name, manager)
        for name, entry in routers:
            _collect_router(families, name, entry)
        return iter(families)


def _collect_manager(f: _Families, name: str, manager: KVCacheManager) -> None:
    cache = {"cache": name}
    stats = manager.stats
    f.counter("kvblocks_prefix_queried_tokens", cache, stats.queried_tokens)
    first = (stats.hit_tokens_device, stats.hit_tokens_host, stats.hit_tokens_storage)
    for tier, hits in zip(TIERS, first, strict=True):
        f.counter("kvblocks_prefix_hit_tokens", {**cache, "tier": tier}, hits)
    f.counter("kvblocks_readmission_queried_tokens", cache, stats.readmission_queried_tokens)
    again = (
        stats.readmission_hit_tokens_device,
        stats.readmission_hit_tokens_host,
        stats.readmission_hit_tokens_storage,
    )
    for tier, hits in zip(TIERS, again, strict=True):
        f.counter("kvblocks_readmission_hit_tokens", {**cache, "tier": tier}, hits)
    f.counter("kvblocks_admissions", {**cache, "kind": "first"}, stats.admissions)
    f.counter("kvblocks_admissions", {**cache, "kind": "readmission"}, stats.readmissions)
    f.counter("kvblocks_evicted_blocks", {**cache, "tier": "device"}, stats.evicted_blocks)
    f.counter("kvblocks_preemptions", cache, stats.preemptions)
    _blocks(f, {**cache, "tier": "device"}, stats.num_blocks, stats.blocks_in_use, stats.blocks_fresh)
    lifetimes = manager.block_lifetimes
    f.histogram("kvblocks_block_lifetime_seconds", cache, *_histogram(lifetimes.lifetime))
    f.histogram("kvblocks_block_idle_before_eviction_seconds", cache, *_histogram(lifetimes.idle))
    if manager.tiers is not None:
        _collect_tiers(f, cache, manager)
    if isinstance(manager, DecodeManager):
        counters = manager.decode_counters
        f.counter("kvblocks_decode_handoffs", {**cache, "result": "accepted"}, counters.handoffs_accepted)
        f.counter("kvblocks_decode_handoffs", {**cache, "result": "refused"}, counters.handoffs_refused)
        f.counter("kvblocks_decode_seeded_hit_tokens", cache, counters.seeded_hit_tokens)
        f.counter("kvblocks_decode_hit_tokens", cache, counters.decode_hit_tokens)
        f.counter("kvblocks_decode_transferred_blocks", cache, counters.transferred_blocks)


def _blocks(f: _Families, labels: dict[str, str], capacity: int, in_use: int, fresh: int) -> None:
    """A tier's capacity, its blocks by state and its usage. ``evictable`` is what remains, so the states sum
    to the capacity exactly even when a scrape reads the counts while the scheduler changes them."""
    f.gauge("kvblocks_blocks_capacity", labels, capacity)
    states = {"in_use": in_use, "evictable": capacity - in_use - fresh, "fresh": fresh}
    for state, count in states.items():
        f.gauge("kvblocks_blocks", {**labels, "state": state}, count)
    f.gauge("kvblocks_usage_ratio", labels, in_use / capacity if capacity else 0.0)


def _histogram(histogram: Histogram) -> tuple[list[tuple[str, float]], float]:
    """A histogram's cumulative buckets and sum, as ``HistogramMetricFamily.add_metric`` takes them."""
    total = histogram.sum
    cumulative = histogram.cumulative()
    return [(_bucket_label(b), c) for b, c in zip(histogram.bounds, cumulative, strict=True)], total


def _collect_tiers(f: _Families, cache: dict[str, str], manager: KVCacheManager) -> None:
    tiers = manager.tier_stats
    host = manager.host
    if host is not None:
        f.counter("kvblocks_evicted_blocks", {**cache, "tier": "host"}, tiers.host_evicted)
        pool = host.pool
        _blocks(f, {**cache, "tier": "host"}, pool.num_blocks, pool.num_in_use, pool.num_fresh)
        swaps = (
            ("out", "ok", tiers.swap_outs),
            ("out", "failed", tiers.swap_out_failures),
            ("in", "ok", tiers.swap_ins),
            ("in", "failed", tiers.swap_in_failures),
        )
        for direction, result, count in swaps:
            f.counter("kvblocks_swaps", {**cache, "direction": direction, "result": result}, count)
        f.counter("kvblocks_host_writes_dropped", cache, tiers.write_backs_without_host_room)
    reads, writer, tier = tiers.storage, tiers.writer, manager.storage
    if reads is None or writer is None or not isinstance(tier, StorageTier):  # another keyed kind: no figures
        return
    read_results = (
        ("hit", reads.loads_hit),
        ("missing", reads.loads_missing),
        ("corrupt", reads.loads_corrupt),
        ("wrong_key", reads.loads_wrong_key),
        ("timeout", reads.load_timeouts),
        ("error", reads.load_errors),
        ("cancelled", reads.loads_cancelled),
    )
    for result, count in read_results:
        f.counter("kvblocks_storage_reads", {**cache, "result": result}, count)
    f.counter("kvblocks_storage_reads_requested", cache, reads.loads_requested)
    write_results = (
        ("written", writer.written),
        ("skipped_existing", writer.skipped_existing),
        ("dropped", writer.dropped),
        ("failed", writer.failed),
        ("no_payload", tiers.saves_without_payload),
    )
    for result, count in write_results:
        f.counter("kvblocks_storage_writes", {**cache, "result": result}, count)
    backend = tier.backend.stats  # the backend's own counters (shared by every manager using it)
    f.counter("kvblocks_storage_backend_errors", {**cache, "op": "put"}, backend.put_errors)
    f.counter("kvblocks_storage_backend_errors", {**cache, "op": "get"}, backend.get_errors)
    f.counter("kvblocks_storage_written_bytes", cache, backend.put_bytes)
    f.counter("kvblocks_storage_skipped_entries", cache, backend.skipped_entries)
    f.counter("kvblocks_evicted_blocks", {**cache, "tier": "storage"}, backend.evictions)


def _collect_router(f: _Families, name: str, entry: _RouterEntry) -> None:
    label = {"router": name}
    router = entry.router
    f.counter("kvblocks_router_decisions", label, router.routed)
    f.counter("kvblocks_router_leaked_leases", label, router.leaked_leases)
    silent = draining = 0
    for worker in router.workers:
        try:
            load = router.load(worker)
        except InvalidArgumentError:
            continue  # removed since the list was taken
        silent += load.silent
        draining += load.draining
        labels = {**label, "worker": str(worker)}
        f.gauge("kvblocks_router_running", labels, load.running)
        f.gauge("kvblocks_router_inflight_prefill_tokens", labels, load.inflight_prefill_tokens)
        f.gauge("kvblocks_router_cached_blocks", labels, load.cached_blocks)
    f.counter("kvblocks_router_silent_reports", label, router.silent_reports)  # after load(): it may report
    f.gauge("kvblocks_router_silent_workers", label, silent)
    f.gauge("kvblocks_router_draining_workers", label, draining)
    if entry.observer is None:
        return
    bounds = [_bucket_label(b) for b in OVERLAP_BUCKETS]
    for worker, count, cumulative, total in entry.observer._snapshot():
        labels = {**label, "worker": str(worker)}
        f.counter("kvblocks_router_worker_decisions", labels, count)
        f.histogram("kvblocks_router_overlap_blocks", labels, list(zip(bounds, cumulative, strict=True)), total)


# ---------------------------------------------------------------------------------- exposition and serving


def make_registry(collector: KVBlocksCollector) -> CollectorRegistry:
    """A fresh ``CollectorRegistry`` holding only ``collector`` (never the global default registry)."""
    if not isinstance(collector, KVBlocksCollector):
        raise InvalidArgumentError(f"expected a KVBlocksCollector, got {type(collector).__name__}")
    _require_prometheus()
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def exposition(collector: KVBlocksCollector) -> bytes:
    """The Prometheus text exposition of ``collector`` now (tests, or an engine's own endpoint)."""
    registry = make_registry(collector)
    from prometheus_client import generate_latest

    return generate_latest(registry)


class MetricsServer:
    """A running metrics endpoint (see :func:`start_http_server`); :meth:`close` stops it."""

    def __init__(self, httpd: Any, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        self._closed = False
        self.address: str = str(httpd.server_address[0])
        self.port: int = int(httpd.server_address[1])
        """The port bound (the one chosen by the system when 0 was asked for)."""

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port (takes up to 0.5 s: the server's poll interval). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    shutdown = close

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetricsServer({self.url!r}{', closed' if self._closed else ''})"


def start_http_server(collector: KVBlocksCollector, port: int = 0, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve ``collector`` (in a fresh registry) over HTTP from a daemon thread, with
    ``prometheus_client.start_http_server`` (it needs prometheus_client >= 0.20, which returns the server).

    ``port=0`` lets the system choose a free port: read it from the returned server's
    ``port``. Binds ``127.0.0.1`` by default; pass ``addr="0.0.0.0"`` to be scraped from other hosts.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgumentError(f"port must be an int in 0..65535, got {port!r}")
    if not isinstance(addr, str) or not addr:
        raise InvalidArgumentError(f"addr must be a host address, got {addr!r}")
    registry = make_registry(collector)
    import prometheus_client

    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise InvalidArgumentError(f"cannot bind to {addr!r}: {error}") from None
    started = prometheus_client.start_http_server(port, addr=addr, registry=registry)
    if started is None:  # before 0.20 the server was not returned: its port and its shutdown were out of reach
        raise BackendUnavailableError("kvblocks.metrics.start_http_server needs prometheus_client >= 0.20")
    httpd, thread = started
    return MetricsServer(httpd, thread)
