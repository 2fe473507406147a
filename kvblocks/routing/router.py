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
(:class:`~kvblocks.routing.holder_index.HolderIndex`) maps a hash to a bitmask of the workers holding it, and a
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
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence

from kvblocks.errors import ConfigError, InvalidArgumentError, InvalidBlockHashError, KVBlocksError
from kvblocks.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvblocks.events.codec import is_prefix_event
from kvblocks.hashing import BlockExtras, BlockHash, BlockHasher, HashedTokens, validate_block_hashes
from kvblocks.routing.config import HASH_FORMS, TIERS, RouterConfig
from kvblocks.routing.holders import TieredHolders
from kvblocks.routing.workers import Lease, WorkerLoad, WorkerState

__all__ = ["Lease", "NoWorkerError", "Router", "RouterConfig", "WorkerLoad"]

_log = logging.getLogger("kvblocks.routing")


class NoWorkerError(KVBlocksError, RuntimeError):
    """No healthy worker can take a request (none added, or all draining)."""


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
        self._workers: dict[Hashable, WorkerState] = {}
        self._by_bit: dict[int, WorkerState] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._order = 0
        self._healthy = 0  # bitmask of workers that may take requests
        self._holders = TieredHolders(self._weights)  # which workers hold which blocks, per tier
        self._index = self._holders.index  # the same: hash -> workers holding it in any tier (what the walk reads)
        self._expiry: dict[tuple[int, BlockHash], float] = {}
        self._expiry_queue: deque[tuple[float, int, BlockHash]] = deque()
        self._rng = random.Random(config.seed)
        self._heap: list[tuple[float, int, int, int, WorkerState]] = []
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
        w = WorkerState(worker, bit, self._order)
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
        self._holders.clear(w, TIERS)
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

    def _worker(self, worker: Hashable) -> WorkerState:
        try:
            return self._workers[worker]
        except (KeyError, TypeError):
            raise InvalidArgumentError(f"unknown worker {worker!r}") from None

    def _change_load(self, w: WorkerState, running: int, inflight: int) -> None:
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
                self._holders.add(w, event.tier, event.block_hashes, event.parent_hash)
            elif isinstance(event, BlockRemoved):
                self._holders.remove(w, event.tier, event.block_hashes)
                if event.tier == "device" and self.config.eviction_weight:
                    w.evicted_recently += len(event.block_hashes)
                    self._push(w)
            else:
                self._holders.clear(w, (event.tier,))
        w.last_event = self._clock()
        w.routed_since_event = None
        w.silent = False

    def replace_index(self, worker: Hashable, events: Iterable[KVEvent]) -> None:
        """A snapshot of ``worker``'s cache replaces what the router knew (``EventConsumer``'s ``on_snapshot``)."""
        self._holders.clear(self._worker(worker), TIERS)
        self.apply_events(worker, events)

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
                self._holders.remove(w, "device", hashes)

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
        return {self._by_bit[bit].id: v for bit, v in self._holders.overlaps(hashes, self._healthy).items()}

    # The least-loaded healthy worker without any overlap is read off a heap of (load cost, load, order)
    # entries with lazy invalidation, so a route costs O(workers holding part of the prompt + log n),
    # not O(all workers).

    def _base(self, w: WorkerState) -> float:
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

    def _heap_entry(self, w: WorkerState) -> tuple[float, int, int, int, WorkerState]:
        w.version += 1  # older entries of w are stale from now on
        return (self._base(w), w.running + w.inflight, w.order, w.version, w)

    def _push(self, w: WorkerState) -> None:
        heapq.heappush(self._heap, self._heap_entry(w))
        if len(self._heap) > 4 * len(self._workers) + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """One current entry per healthy worker (drops the stale ones)."""
        self._heap = [self._heap_entry(w) for w in self._workers.values() if not w.draining]
        heapq.heapify(self._heap)

    def _least_loaded(self) -> tuple[float, int, int, int, WorkerState] | None:
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
            # Checked where read: the walk refuses a bad hash it reads (naming its position) and never reads
            # past the run it matched, so a route costs its matched prefix, not the prompt's length.
            # Approximate mode remembers every hash for the worker it picks: it checks them all.
            if config.mode == "approximate":
                hashes: Sequence[BlockHash] = validate_block_hashes(block_hashes, distinct=False)  # repeats pass
            elif isinstance(block_hashes, (list, tuple)):
                hashes = block_hashes
            elif not isinstance(block_hashes, Iterable):
                raise InvalidBlockHashError(f"block_hashes must be a sequence, got {type(block_hashes).__name__}")
            else:
                hashes = list(block_hashes)
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
            overlaps = self._holders.overlaps(scored, alive)
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

    def _cheapest(self, hashes: Sequence[BlockHash], alive: int, blocks: int) -> tuple[WorkerState, float]:
        """The lowest (cost, load, order) among healthy workers, and its overlap."""
        config = self.config
        pw, credit = config.prefill_weight, config.overlap_credit
        dw = config.decode_weight / config.block_size
        ew = config.eviction_weight
        per_token = pw / config.block_size
        by_bit = self._by_bit
        best: WorkerState | None = None
        best_cost = math.inf
        best_tie = (0, 0)
        best_overlap = 0.0
        idle = self._least_loaded()  # as if it held nothing: a worker's true cost is never higher
        if idle is not None:
            best, best_cost, best_tie = idle[4], pw * blocks + idle[0], (idle[1], idle[2])
        device_only = self._holders.device_only
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
                        overlap = self._holders.weighted(hashes, w.bit, run)
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

    def _sample(self, costs: list[tuple[float, WorkerState]]) -> WorkerState:
        low = min(c for c, _ in costs)
        t = self.config.temperature
        weights = [math.exp(-(c - low) / t) for c, _ in costs]
        return self._rng.choices([w for _, w in costs], weights)[0]

    def _remember(self, w: WorkerState, hashes: Sequence[BlockHash], expires: float) -> None:
        self._holders.add(w, "device", hashes, None)
        for h in hashes:
            self._expiry[(w.bit, h)] = expires
            self._expiry_queue.append((expires, w.bit, h))

    # ------------------------------------------------------------------ health

    def _is_silent(self, w: WorkerState) -> bool:
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

        self._holders.check(self._workers.values())
        for w in self._workers.values():
            if w.running < 0 or w.inflight < 0:
                raise IntegrityError(f"worker {w.id!r} has negative load")
