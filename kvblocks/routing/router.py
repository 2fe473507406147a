"""Cache-aware routing: pick the worker whose cache holds most of the prompt, weighed against its load.

Per worker the router keeps an index of cached block hashes -- fed by that worker's KV
events (precise mode) or by the prompts it routed there, expiring after a TTL
(approximate mode) -- and a load: running sequences and in-flight prefill tokens. Of a hybrid
model's events only those of its full-attention group feed the index (see :meth:`Router.apply_events`).
``route`` always scores the prompt's blocks (a router that ignored the prompt is one of
the bugs this module exists to rule out) and returns a :class:`Lease` that releases every
counter it took exactly once.

The cost of sending a prompt to worker ``w``, in blocks, where ``P`` is the number of its blocks a hit
may cover (its full blocks, less the one holding its last token: the last-token rule of
``KVCacheManager.lookup``, so a fully cached, block-aligned prompt still charges that block)::

    cost(w) = prefill_weight * (max(0, P - credit * overlap(w)) + inflight_prefill_tokens(w) / block_size)
              + decode_weight * running(w) / block_size
              + eviction_weight * evicted_recently(w) * new_share(w)

``decode_weight`` is what one running sequence weighs, in prefill tokens; ``evicted_recently(w)``
counts the blocks ``w`` evicted lately (halved every ``eviction_half_life`` routes) and
``new_share(w)`` is the share of the prompt's blocks that would be new on ``w``: a prompt that would
fill a thrashing cache with new blocks goes elsewhere, a continuation stays where its prefix is.

``overlap(w)`` is the leading run of prompt blocks ``w`` holds, each weighted by the best tier
holding it (device 1.0, host 0.5, storage 0.25 by default). The lowest cost wins; ties go to
the less loaded worker, then to the earlier-added one. With ``temperature > 0`` the choice is
sampled from ``softmax(-cost / temperature)`` with the router's own seeded generator.

The overlap of every worker comes from one walk over the prompt's hashes: an inverted index
(:class:`~kvblocks.holder_index.HolderIndex`) maps a hash to a bitmask of the workers holding it, and a
worker's run ends where its bit first drops out::

    prompt blocks   h0     h1     h2     h3
    workers mask    0b111  0b101  0b101  0b001      -> overlap: w0 4, w1 1, w2 3

Worker caches are prefix-closed, so the mask only loses bits along the prompt: the walk finds where it
does by galloping and bisection, O(log n) probes per distinct run length rather than one per block (a
fully cached 2,048-block prompt costs a few dozen probes). A worker whose events broke its closure (a
block held without its parent: stored out of order, or its parent removed under it) is scanned block by
block while any such block remains (the index counts them exactly), so the overlaps stay exact. Hashes
must be chained (each fixes every hash before it), as every hash scheme makes them; the walk checks each
probed block's parent against the prompt's block before it. Parent links are kept per worker: whatever
parents one worker's events state (false ones included), they never change another worker's overlap.
Where a key lands in the index is secret per router, so no sender can aim its hashes at one cluster.
"""

from __future__ import annotations

import heapq
import logging
import math
import random
import time
import warnings
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import cast

from kvblocks.errors import ConfigError, InvalidArgumentError, KVBlocksError
from kvblocks.event_codec import is_prefix_event
from kvblocks.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvblocks.hashing import (
    DEFAULT_SCHEME,
    HASH_SCHEMES,
    BlockExtras,
    BlockHash,
    BlockHasher,
    HashedTokens,
    Namespace,
    sglang_int_hash,
    validate_block_hashes,
    vllm_int_hash,
)
from kvblocks.holder_index import HolderIndex

__all__ = ["Lease", "NoWorkerError", "Router", "RouterConfig", "WorkerLoad"]

_log = logging.getLogger("kvblocks.routing")
TIERS = ("device", "host", "storage")
HASH_FORMS: dict[str, Callable[[BlockHash], BlockHash] | None] = {
    "native": None,
    "vllm-int64": vllm_int_hash,
    "sglang-int64": sglang_int_hash,
}
"""How the workers' events write a block hash: as the scheme makes it (``"native"``), as vLLM's 64-bit
integer form (``"vllm-int64"``, vLLM's default: :func:`kvblocks.hashing.vllm_int_hash`), or as SGLang's
(``"sglang-int64"``: :func:`kvblocks.hashing.sglang_int_hash`)."""


class NoWorkerError(KVBlocksError, RuntimeError):
    """No healthy worker can take a request (none added, or all draining)."""


@dataclass(frozen=True)
class RouterConfig:
    """How a :class:`Router` scores workers, validated once.

    >>> RouterConfig(block_size=16, mode="approximate").approx_ttl_s
    120.0
    >>> RouterConfig(block_size=16, temperature=-1)
    Traceback (most recent call last):
    ...
    kvblocks.errors.ConfigError: temperature must be a number >= 0, got -1
    """

    block_size: int
    hash_scheme: str = DEFAULT_SCHEME
    namespace: Namespace | str = "default"
    hash_form: str = "native"
    """How the workers' events write hashes (:data:`HASH_FORMS`): ``"vllm-int64"`` with a vLLM scheme
    (``hash_scheme="vllm-sha256"``) indexes a vLLM fleet by recomputing its hashes from the prompt's tokens."""
    mode: str = "precise"
    """precise: indexes follow workers' KV events; approximate: the router's own routing decisions, with a TTL."""
    approx_ttl_s: float = 120.0
    prefill_weight: float = 1.0
    decode_weight: float = 128.0
    """Prefill tokens one running sequence weighs (decode work keeps a worker busy too)."""
    overlap_credit: float = 1.0
    tier_weights: tuple[tuple[str, float], ...] = (("device", 1.0), ("host", 0.5), ("storage", 0.25))
    temperature: float = 0.0
    seed: int | None = 0
    silent_after_s: float = 30.0
    """Precise mode: a worker routed to with no event for this long is reported silent."""
    eviction_weight: float = 0.2
    """Precise mode: cost (in blocks) per block a worker evicted recently, scaled by the share of the
    prompt that would be new there: prompts that bring many new blocks avoid workers whose caches are
    thrashing, while continuations stay with the worker that holds them."""
    eviction_half_life: int = 64
    """Routes after which recent evictions count half."""

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ConfigError(f"block_size must be a positive int, got {self.block_size!r}")
        if self.mode not in ("precise", "approximate"):
            raise ConfigError(f"mode must be 'precise' or 'approximate', got {self.mode!r}")
        for name in ("approx_ttl_s", "silent_after_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a number > 0, got {value!r}")
        half_life = self.eviction_half_life
        if isinstance(half_life, bool) or not isinstance(half_life, int) or half_life < 1:
            raise ConfigError(f"eviction_half_life must be an int >= 1, got {half_life!r}")
        for name in ("prefill_weight", "decode_weight", "overlap_credit", "temperature", "eviction_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}")
        if self.hash_scheme not in HASH_SCHEMES:
            known = ", ".join(sorted(HASH_SCHEMES))
            raise ConfigError(f"unknown hash scheme {self.hash_scheme!r}; known: {known}")
        if not isinstance(self.hash_form, str) or self.hash_form not in HASH_FORMS:
            raise ConfigError(f"hash_form must be one of {', '.join(HASH_FORMS)}, got {self.hash_form!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an int or None, got {self.seed!r}")
        message = f"tier_weights must be (tier, weight) pairs, tiers among {TIERS}, weights numbers >= 0"
        try:
            weights = dict(self.tier_weights)
        except (TypeError, ValueError):
            raise ConfigError(f"{message}; got {self.tier_weights!r}") from None
        if set(weights) - set(TIERS) or any(
            isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0 or math.isinf(w)
            for w in weights.values()
        ):
            raise ConfigError(f"{message}; got {self.tier_weights!r}")
        object.__setattr__(self, "tier_weights", tuple(weights.items()))
        object.__setattr__(self, "namespace", Namespace.of(self.namespace))


@dataclass
class WorkerLoad:
    """A worker's counters (a copy: reading it never changes the router)."""

    worker: Hashable
    running: int
    inflight_prefill_tokens: int
    cached_blocks: int
    draining: bool
    silent: bool
    evicted_recently: float = 0.0


@dataclass
class _Worker:
    id: Hashable
    bit: int
    order: int
    running: int = 0
    inflight: int = 0
    draining: bool = False
    removed: bool = False
    held: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))  # blocks per tier
    last_event: float | None = None
    routed_since_event: float | None = None  # when the first route after the last event was sent
    silent: bool = False
    version: int = 0  # bumped on every load change: older heap entries are stale
    evicted_recently: float = 0.0  # blocks evicted, halved every eviction_half_life routes


class Lease:
    """The counters one routed request holds on its worker; released exactly once.

    Use it as a context manager (also ``async with``): leaving the block -- normally, by an
    exception, or by cancellation -- releases it. :meth:`prefill_done` gives the prefill
    tokens back early (the prefill finished; the sequence keeps running). A lease that is
    garbage collected unreleased is released then, with a warning.
    """

    __slots__ = ("_prefill_open", "_router", "_worker", "closed", "overlap_blocks", "prefill_tokens", "worker")

    def __init__(self, router: Router, worker: _Worker, prefill_tokens: int, overlap_blocks: float) -> None:
        self._router = router
        self._worker = worker
        self.worker = worker.id
        self.prefill_tokens = prefill_tokens
        self.overlap_blocks = overlap_blocks
        self._prefill_open = True
        self.closed = False

    def prefill_done(self) -> None:
        """The prefill finished: its tokens leave the worker's in-flight count (once)."""
        if self._prefill_open:
            self._prefill_open = False
            self._router._change_load(self._worker, 0, -self.prefill_tokens)

    def release(self) -> None:
        """The request ended (finished, failed or cancelled). Idempotent."""
        if self.closed:
            return
        self.closed = True
        pending = self.prefill_tokens if self._prefill_open else 0
        self._prefill_open = False
        self._router._change_load(self._worker, -1, -pending)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            warnings.warn(
                f"a routing lease on worker {self.worker!r} was garbage collected unreleased; releasing it now",
                ResourceWarning,
                stacklevel=2,
            )
            self._router.leaked_leases += 1
            self.release()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("decoding" if not self._prefill_open else "prefilling")
        return f"Lease(worker={self.worker!r}, prefill_tokens={self.prefill_tokens}, {state})"


class Router:
    """Routes prompts to workers by cache overlap and load (see the module docstring)."""

    def __init__(
        self,
        workers: Iterable[Hashable] = (),
        config: RouterConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if config is None:
            raise ConfigError("a Router needs a RouterConfig (at least the block size)")
        if not isinstance(config, RouterConfig):
            raise ConfigError(f"config must be a RouterConfig, got {type(config).__name__}")
        self.config = config
        self._clock = clock
        self._hasher = BlockHasher(config.block_size, config.hash_scheme, config.namespace)
        self._hash_form = HASH_FORMS[config.hash_form]
        self._weights = {t: float(w) for t, w in config.tier_weights}
        self._workers: dict[Hashable, _Worker] = {}
        self._by_bit: dict[int, _Worker] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._order = 0
        self._healthy = 0  # bitmask of workers that may take requests
        self._index = HolderIndex()  # hash -> workers holding it in any tier: what the walk reads
        self._tiers: dict[str, dict[int, int]] | None = None  # per-tier masks by folded key, once a
        # worker reports a tier other than the device (until then the index is the device tier)
        self._expiry: dict[tuple[int, BlockHash], float] = {}
        self._expiry_queue: deque[tuple[float, int, BlockHash]] = deque()
        self._rng = random.Random(config.seed)
        self._heap: list[tuple[float, int, int, int, _Worker]] = []
        self._routes_since_decay = 0
        self.routed = 0
        self.leaked_leases = 0
        self.silent_reports = 0
        for worker in workers:
            self.add_worker(worker)

    # ------------------------------------------------------------------ workers

    def add_worker(self, worker: Hashable) -> None:
        try:
            known = worker in self._workers
        except TypeError:
            raise InvalidArgumentError(f"worker id must be hashable, got {type(worker).__name__}") from None
        if known:
            raise InvalidArgumentError(f"worker {worker!r} is already added")
        bit = self._free_bits.pop() if self._free_bits else self._next_bit
        if bit == self._next_bit:
            self._next_bit += 1
        w = _Worker(worker, bit, self._order)
        self._order += 1
        self._workers[worker] = w
        self._by_bit[bit] = w
        self._healthy |= 1 << bit
        self._push(w)

    def drain_worker(self, worker: Hashable) -> None:
        """No new requests go to ``worker``; its leases run to completion."""
        w = self._worker(worker)
        w.draining = True
        self._healthy &= ~(1 << w.bit)

    def undrain_worker(self, worker: Hashable) -> None:
        w = self._worker(worker)
        w.draining = False
        self._healthy |= 1 << w.bit
        self._push(w)

    def remove_worker(self, worker: Hashable) -> None:
        """Forget ``worker`` and its index. Its open leases can still be released (into its old counters)."""
        w = self._worker(worker)
        self._clear(w, TIERS)
        del self._workers[worker]
        del self._by_bit[w.bit]
        self._healthy &= ~(1 << w.bit)
        self._free_bits.append(w.bit)
        w.removed = True

    @property
    def workers(self) -> list[Hashable]:
        return list(self._workers)

    def load(self, worker: Hashable) -> WorkerLoad:
        w = self._worker(worker)
        return WorkerLoad(
            w.id,
            w.running,
            w.inflight,
            sum(w.held.values()),
            w.draining,
            self._is_silent(w),
            w.evicted_recently,
        )

    def _worker(self, worker: Hashable) -> _Worker:
        try:
            return self._workers[worker]
        except (KeyError, TypeError):
            raise InvalidArgumentError(f"unknown worker {worker!r}") from None

    def _change_load(self, w: _Worker, running: int, inflight: int) -> None:
        # leases release exactly once, so these never go negative (check_integrity verifies it)
        w.running += running
        w.inflight += inflight
        if not w.removed:
            self._push(w)

    # ------------------------------------------------------------------ index

    def apply_events(self, worker: Hashable, events: Iterable[KVEvent]) -> None:
        """Precise mode: update ``worker``'s index from its KV events (``EventConsumer``'s ``on_events``).

        The index is the worker's full-attention prefix: only untagged events (a single-group cache) and
        events of a ``"full"`` group count -- and, from a producer that names no kind (vLLM's
        ``BlockRemoved`` carries only a group index), group 0, where single-group engines put their cache.
        A hybrid model's other groups hold other copies of the same hashes (a sliding window keeps and
        drops them on its own schedule), so their events are skipped
        -- a window group's ``BlockRemoved`` must not take a hash out while the full group still holds it.
        The overlap is then an upper bound of what a hybrid worker serves (its windows may be gone).
        """
        w = self._worker(worker)
        for event in events:
            if not isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared):
                raise InvalidArgumentError(f"not a KV event: {type(event).__name__}")
            if not is_prefix_event(event):
                continue  # another group's copy of the chain: not the prefix this index scores
            if isinstance(event, BlockStored):
                self._add(w, event.tier, event.block_hashes, event.parent_hash)
            elif isinstance(event, BlockRemoved):
                self._remove(w, event.tier, event.block_hashes)
                if event.tier == "device" and self.config.eviction_weight:
                    w.evicted_recently += len(event.block_hashes)
                    self._push(w)
            else:
                self._clear(w, (event.tier,))
        w.last_event = self._clock()
        w.routed_since_event = None
        w.silent = False

    def replace_index(self, worker: Hashable, events: Iterable[KVEvent]) -> None:
        """A snapshot of ``worker``'s cache replaces what the router knew (``EventConsumer``'s ``on_snapshot``)."""
        self._clear(self._worker(worker), TIERS)
        self.apply_events(worker, events)

    def _add(self, w: _Worker, tier: str, hashes: Sequence[BlockHash], parent: BlockHash | None) -> None:
        if tier not in w.held:
            return  # a tier the router does not score
        if self._tiers is None:
            if tier == "device":
                w.held["device"] += self._index.add(w.bit, hashes, parent)
                return
            self._split_tiers()
        tiers = cast(dict[str, dict[int, int]], self._tiers)
        bit = 1 << w.bit
        masks = tiers[tier]
        keys = self._index.fold_all(hashes)
        for key in keys:
            m = masks.get(key, 0)
            if not m & bit:
                masks[key] = m | bit
                w.held[tier] += 1
        self._index.add_keys(w.bit, keys, None if parent is None else self._index.fold(parent))

    @property
    def _device_only(self) -> bool:
        """Only device blocks are held (every overlap is its run at the device weight)."""
        tiers = self._tiers
        return tiers is None or (not tiers["host"] and not tiers["storage"])

    def _split_tiers(self) -> None:
        """A tier other than the device appears: from now on each tier keeps its own masks (the index
        keeps their union, for the walk)."""
        self._tiers = {t: {} for t in TIERS}
        self._tiers["device"] = dict(self._index.items())

    def _remove(self, w: _Worker, tier: str, hashes: Iterable[BlockHash]) -> None:
        if tier not in w.held:
            return
        if self._tiers is None:
            if tier == "device":
                w.held["device"] -= self._index.remove(w.bit, hashes)
            return
        bit = 1 << w.bit
        masks = self._tiers[tier]
        keys = dict.fromkeys(self._index.fold_all(hashes))
        self._remove_keys(w, tier, [k for k in keys if masks.get(k, 0) & bit])

    def _clear(self, w: _Worker, tiers: Iterable[str]) -> None:
        tiers = [t for t in tiers if t in w.held]
        if self._tiers is None:
            if "device" in tiers:
                self._index.clear(w.bit)
                w.held["device"] = 0
            return
        bit = 1 << w.bit
        for tier in tiers:
            keys = [key for key, m in self._tiers[tier].items() if m & bit]
            self._remove_keys(w, tier, keys)

    def _remove_keys(self, w: _Worker, tier: str, keys: list[int]) -> None:
        """Tiered: ``w`` drops ``keys`` (which it holds in ``tier``); the index, those it holds nowhere now."""
        bit = 1 << w.bit
        tiers = cast(dict[str, dict[int, int]], self._tiers)
        masks = tiers[tier]
        for key in keys:
            m = masks[key] & ~bit
            if m:
                masks[key] = m
            else:
                del masks[key]
        w.held[tier] -= len(keys)
        self._index.remove_keys(w.bit, [k for k in keys if not any(t.get(k, 0) & bit for t in tiers.values())])

    def _expire(self, now: float) -> None:
        queue = self._expiry_queue
        expired: dict[int, list[BlockHash]] = {}
        while queue and queue[0][0] <= now:
            at, bit, h = queue.popleft()
            if self._expiry.get((bit, h)) == at:
                del self._expiry[(bit, h)]
                expired.setdefault(bit, []).append(h)
        for bit, hashes in expired.items():  # a worker's expired blocks in one batch, so that a prompt
            w = self._by_bit.get(bit)  # expiring whole is no hole in its cache
            if w is not None:
                self._remove(w, "device", hashes)

    # ------------------------------------------------------------------ routing

    def prompt_hashes(self, token_ids: Iterable[int], extras: BlockExtras | None = None) -> list[BlockHash]:
        """The hashes :meth:`route` scores a prompt's full blocks by: the configured scheme's, written in
        the workers' ``hash_form`` (what their events carry)."""
        return self._hash_prompt(token_ids, extras)[0]

    def _hash_prompt(self, token_ids: Iterable[int], extras: BlockExtras | None) -> tuple[list[BlockHash], int]:
        content = HashedTokens(self._hasher, token_ids, extras)
        hashes = content.hashes
        if self._hash_form is not None:
            hashes = list(map(self._hash_form, hashes))
        return hashes, content.num_tokens

    def overlaps(self, hashes: Sequence[BlockHash]) -> dict[Hashable, float]:
        """Weighted leading overlap of ``hashes`` with each healthy worker holding part of it (workers
        with none are left out, so the cost does not grow with idle workers). Pure."""
        return {self._by_bit[bit].id: v for bit, v in self._overlaps(hashes, self._healthy).items()}

    def _weighted(self, hashes: Sequence[BlockHash], bit: int, run: int) -> float:
        """A run's overlap with each block weighted by the best tier of ``bit``'s worker holding it."""
        weights = self._weights
        device = weights.get("device", 0.0)
        if self._device_only:
            return run * device
        tiers = cast(dict[str, dict[int, int]], self._tiers)
        device_masks, host_masks = tiers["device"], tiers["host"]
        host_w, storage_w = weights.get("host", 0.0), weights.get("storage", 0.0)
        fold = self._index.fold
        b = 1 << bit
        total = 0.0
        for h in hashes[:run]:
            key = fold(h)
            if device_masks.get(key, 0) & b:
                total += device
            elif host_masks.get(key, 0) & b:
                total += host_w
            else:
                total += storage_w
        return total

    def _overlaps(self, hashes: Sequence[BlockHash], alive: int) -> dict[int, float]:
        """Weighted overlap by worker bit, for the workers of ``alive`` with a nonzero run."""
        out: dict[int, float] = {}
        for run, mask in self._index.runs(hashes, alive):
            if not run:
                continue
            while mask:
                low = mask & -mask
                bit = low.bit_length() - 1
                out[bit] = self._weighted(hashes, bit, run)
                mask ^= low
        return out

    # The least-loaded healthy worker without any overlap is read off a heap of (load cost, load, order)
    # entries with lazy invalidation, so a route costs O(workers holding part of the prompt + log n),
    # not O(all workers).

    def _base(self, w: _Worker) -> float:
        """The part of a worker's cost that does not depend on the prompt."""
        config = self.config
        return (
            config.prefill_weight * w.inflight / config.block_size
            + config.decode_weight * w.running / config.block_size
            + config.eviction_weight * w.evicted_recently
        )

    def _decay_evictions(self) -> None:
        """Every ``eviction_half_life`` routes recent evictions count half (and the heap is rebuilt)."""
        self._routes_since_decay += 1
        if self._routes_since_decay < self.config.eviction_half_life:
            return
        self._routes_since_decay = 0
        for w in self._workers.values():
            w.evicted_recently /= 2
        self._rebuild_heap()

    def _heap_entry(self, w: _Worker) -> tuple[float, int, int, int, _Worker]:
        w.version += 1  # older entries of w are stale from now on
        return (self._base(w), w.running + w.inflight, w.order, w.version, w)

    def _push(self, w: _Worker) -> None:
        heapq.heappush(self._heap, self._heap_entry(w))
        if len(self._heap) > 4 * len(self._workers) + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """One current entry per healthy worker (drops the stale ones)."""
        self._heap = [self._heap_entry(w) for w in self._workers.values() if not w.draining]
        heapq.heapify(self._heap)

    def _least_loaded(self) -> tuple[float, int, int, int, _Worker] | None:
        heap = self._heap
        while heap:
            top = heap[0]
            w = top[4]
            if top[3] == w.version and not w.draining and not w.removed:
                return top
            heapq.heappop(heap)
        return None

    def route(
        self,
        token_ids: Iterable[int] | None = None,
        *,
        block_hashes: Sequence[BlockHash] | None = None,
        num_tokens: int | None = None,
        extras: BlockExtras | None = None,
    ) -> Lease:
        """Choose a worker for a prompt (its tokens, or its full blocks' hashes and length); returns its lease."""
        config = self.config
        size = config.block_size
        if block_hashes is not None:
            if token_ids is not None:
                raise InvalidArgumentError("give token_ids or block_hashes, not both")
            if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
                raise InvalidArgumentError("block_hashes need num_tokens, the prompt length")
            hashes: Sequence[BlockHash] = validate_block_hashes(block_hashes, distinct=False)  # repeats pass
            if len(hashes) > num_tokens // size:
                raise InvalidArgumentError(f"{len(hashes)} block hashes for a {num_tokens}-token prompt")
            prompt_tokens = num_tokens
        elif token_ids is not None:
            hashes, prompt_tokens = self._hash_prompt(token_ids, extras)
        else:
            raise InvalidArgumentError("route needs the prompt: token_ids, or block_hashes and num_tokens")
        now = self._clock()
        if config.mode == "approximate":
            self._expire(now)
        elif config.eviction_weight:
            self._decay_evictions()
        alive = self._healthy
        if not alive:
            raise NoWorkerError("no healthy worker to route to")
        # the last-token rule of lookup: the block holding the prompt's last token is computed anyway,
        # so a block-aligned prompt is scored (and charged) on its first P - 1 blocks
        cacheable = (prompt_tokens - 1) // size if prompt_tokens else 0
        scored = hashes if len(hashes) <= cacheable else hashes[:cacheable]
        blocks = len(scored)
        pw, credit = config.prefill_weight, config.overlap_credit
        if config.temperature:
            overlaps = self._overlaps(scored, alive)
            costs = [
                (pw * max(0.0, blocks - credit * overlaps.get(w.bit, 0.0)) + self._base(w), w)
                for w in self._workers.values()
                if (alive >> w.bit) & 1
            ]
            best = self._sample(costs)
            overlap = overlaps.get(best.bit, 0.0)
        else:
            best, overlap = self._cheapest(scored, alive, blocks)
        # the prefill work this request adds: its tokens beyond the (tier-weighted) overlap
        new_tokens = prompt_tokens - min(prompt_tokens, int(min(overlap, blocks)) * size)
        lease = Lease(self, best, new_tokens, overlap)
        self._change_load(best, 1, new_tokens)
        self.routed += 1
        if config.mode == "approximate":
            self._remember(best, hashes, now + config.approx_ttl_s)
        elif best.routed_since_event is None:
            best.routed_since_event = now
        return lease

    def _cheapest(self, hashes: Sequence[BlockHash], alive: int, blocks: int) -> tuple[_Worker, float]:
        """The lowest (cost, load, order) among healthy workers, and its overlap."""
        config = self.config
        pw, credit = config.prefill_weight, config.overlap_credit
        dw = config.decode_weight / config.block_size
        ew = config.eviction_weight
        per_token = pw / config.block_size
        by_bit = self._by_bit
        best: _Worker | None = None
        best_cost = math.inf
        best_tie = (0, 0)
        best_overlap = 0.0
        idle = self._least_loaded()  # as if it held nothing: a worker's true cost is never higher
        if idle is not None:
            best, best_cost, best_tie = idle[4], pw * blocks + idle[0], (idle[1], idle[2])
        device_only = self._device_only
        device = self._weights.get("device", 0.0)
        top_weight = max(self._weights.values(), default=0.0)
        # no worker's load cost is below the heap's top (with eviction pressure scaled per prompt: below 0)
        floor = idle[0] if idle is not None and not ew else 0.0
        # Two passes, longest runs first so that the rest is mostly pruned. First the workers with the
        # longest run (a bisection: O(log n) probes); then, given the best cost so far, only the runs
        # long enough to beat it: the walk starts at the shortest such run instead of the first block.
        whole = 0
        for second in (False, True):
            if not blocks:
                break
            if not second:
                top = self._index.longest_run(hashes, alive)
                if top is None:  # a suspect worker, or a prompt that is not one chain: its whole holders
                    groups = self._index.runs(hashes, alive, min_run=blocks)
                else:
                    groups = [top] if top[0] else []
                whole = groups[0][1] if groups else 0
            else:
                shortest = self._shortest_useful_run(blocks, best_cost - floor, credit * top_weight)
                if shortest >= blocks:
                    break
                groups = self._index.runs(hashes, alive & ~whole, min_run=shortest)
            for run, mask in reversed(groups):
                if pw * max(0.0, blocks - credit * run * top_weight) + floor > best_cost:
                    break  # even its least-loaded member at its best tier cannot win, nor can any shorter run
                overlap = run * device
                part = pw * max(0.0, blocks - credit * overlap)
                while mask:
                    low = mask & -mask
                    mask ^= low
                    w = by_bit[low.bit_length() - 1]
                    if not device_only:
                        overlap = self._weighted(hashes, w.bit, run)
                        part = pw * max(0.0, blocks - credit * overlap)
                    cost = part + per_token * w.inflight + dw * w.running
                    if ew:  # eviction pressure weighs the blocks this prompt would add to the worker
                        cost += ew * w.evicted_recently * max(0.0, blocks - overlap) / blocks
                    if cost < best_cost or (cost == best_cost and (w.running + w.inflight, w.order) < best_tie):
                        best, best_cost, best_tie, best_overlap = w, cost, (w.running + w.inflight, w.order), overlap
        if best is None:
            raise NoWorkerError("no healthy worker to route to")
        return best, best_overlap

    def _shortest_useful_run(self, blocks: int, slack: float, per_block: float) -> int:
        """The shortest run that could still cost no more than the best so far: a run ``r`` saves at most
        ``prefill_weight * per_block * r`` of the ``blocks`` a prompt costs, and ``slack`` is how far
        the best cost sits above the cheapest load. One short of the bound, so rounding never prunes a
        run that could tie."""
        pw = self.config.prefill_weight
        if not pw or not per_block or math.isinf(slack):
            return 1
        return max(1, math.ceil((blocks - slack / pw) / per_block) - 1)

    def _sample(self, costs: list[tuple[float, _Worker]]) -> _Worker:
        low = min(c for c, _ in costs)
        t = self.config.temperature
        weights = [math.exp(-(c - low) / t) for c, _ in costs]
        return self._rng.choices([w for _, w in costs], weights)[0]

    def _remember(self, w: _Worker, hashes: Sequence[BlockHash], expires: float) -> None:
        self._add(w, "device", hashes, None)
        for h in hashes:
            self._expiry[(w.bit, h)] = expires
            self._expiry_queue.append((expires, w.bit, h))

    # ------------------------------------------------------------------ health

    def _is_silent(self, w: _Worker) -> bool:
        if self.config.mode != "precise" or w.routed_since_event is None:
            return False
        quiet_since = w.routed_since_event if w.last_event is None else max(w.last_event, w.routed_since_event)
        silent = self._clock() - quiet_since >= self.config.silent_after_s
        if silent and not w.silent:
            w.silent = True
            self.silent_reports += 1
            _log.warning(
                "worker %r: requests routed to it but no KV event for %.0f s; its cache index is stale",
                w.id,
                self.config.silent_after_s,
            )
        return silent

    def silent_workers(self) -> list[Hashable]:
        """Precise mode: workers routed to that sent no KV event for ``silent_after_s`` (logged once each)."""
        return [w.id for w in self._workers.values() if self._is_silent(w)]

    def check_integrity(self) -> None:
        """The inverted index equals the workers' own sets; counters are never negative."""
        from kvblocks.errors import IntegrityError

        self._index.check()
        union: dict[int, int] = {}
        if self._tiers is not None:
            for tier, masks in self._tiers.items():
                for key, m in masks.items():
                    union[key] = union.get(key, 0) | m
                for w in self._workers.values():
                    if w.held[tier] != sum(1 for m in masks.values() if m >> w.bit & 1):
                        raise IntegrityError(f"worker {w.id!r}: its {tier} count is stale")
            if union != dict(self._index.items()):
                raise IntegrityError("router index is not the union of its tiers")
        for w in self._workers.values():
            if self._tiers is None and w.held["device"] != self._index.held(w.bit):
                raise IntegrityError(f"worker {w.id!r}: its device count is stale")
        for w in self._workers.values():
            if w.running < 0 or w.inflight < 0:
                raise IntegrityError(f"worker {w.id!r} has negative load")
