"""TieredKVCacheManager: the device cache of :class:`~kvblocks.KVCacheManager` over host and storage tiers.

``lookup`` reports three stacked runs; ``allocate`` gives every cached block a device
block at once, and the copies that fill them are pending until they complete::

    prompt      | b0 | b1 | b2 | b3 | b4 | b5 | . . new tokens . . |
    where       |  device |   host  | storage |
    lookup      CachedTokens(device=2B, host=2B, storage=2B)
    allocate    table [d0, d1, n2, n3, n4, n5, n6 ...]
                swap-ins (h2->n2, h3->n3) in the step's TransferPlan; a storage read of b4, b5
    pending     b2..b5 are neither committed nor matchable; commit() is refused
    complete    complete_transfers(plan) and poll_loads() report the copies; the sequence's
                cached prefix becomes device-resident. If b4 is missing, only the blocks up to b3
                count: n4, n5 and everything after go back to the pool, and the engine
                allocates the rest again to compute it.

The scheduler's calls do no I/O: storage hits come from an index of known-stored hashes,
reads and writes are queued to threads, and the tensors are moved by whoever executes the
plans (the engine, or :class:`~kvblocks.tiers.TransferExecutor` when the caches are ours).

Per step, an engine does: scheduling calls (allocate / free / preempt), then
``take_transfers()`` and runs the plan, then ``complete_transfers(plan)``, then applies
``poll_loads()``, then the forward pass and ``commit``.

Events: with an ``event_sink``, the host and storage tiers emit ``tier="host"`` / ``"storage"``
events into it, tagged with group 0's tag as the device tree's are (untagged here; ``(0, "full")``
in a hybrid manager). Host events are emitted by the call that changed the tier (a write-back in
``allocate``, a write-through in ``commit``, a completed swap-out in ``complete_transfers``,
``reset_prefix_cache``); storage events, which the I/O threads note, at the next ``take_transfers``,
``complete_transfers`` or ``poll_loads`` -- always on the caller's thread. :meth:`snapshot_events`
covers every tier.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import asdict
from types import TracebackType
from typing import TypeVar

import kvblocks.tiers.completion as _completion
from kvblocks.accounting import CachedTokens
from kvblocks.config import CacheConfig
from kvblocks.errors import ConfigError, SequenceStateError
from kvblocks.events import BlockStored, EventSink
from kvblocks.eviction import DEFAULT_EVICTION
from kvblocks.hashing import DEFAULT_SCHEME, BlockHash, Namespace
from kvblocks.manager import BlockTable, KVCacheManager, _count_arg, _Sequence
from kvblocks.tiers.admission_state import TierStats, _Counts
from kvblocks.tiers.admission_state import _Admission as _Admission  # re-exported: kvblocks.hybrid.tiers
from kvblocks.tiers.admission_state import _Plan as _Plan
from kvblocks.tiers.config import TierConfig
from kvblocks.tiers.host import HostTier
from kvblocks.tiers.storage_tier import LoadOutcome, StorageTier
from kvblocks.tiers.transfers import AdmittedTable, BlockSave, GroupTransfers, LoadResult, TransferPlan

_Manager = TypeVar("_Manager", bound="TieredKVCacheManager")

__all__ = ["TierStats", "TieredKVCacheManager"]


class TieredKVCacheManager(KVCacheManager):
    """A :class:`~kvblocks.KVCacheManager` whose evicted blocks live on in host memory and storage.

    >>> from kvblocks.tiers import TierConfig
    >>> m = TieredKVCacheManager(5, 4, tiers=TierConfig(num_host_blocks=8))
    >>> m.add_sequence("a", list(range(17)))
    >>> _ = m.allocate("a", 17); m.commit("a", 17); m.free("a")      # 4 full blocks cached, 1 partial
    >>> m.add_sequence("b", list(range(100, 117)))
    >>> _ = m.allocate("b", 17)                                        # evicts a's blocks ...
    >>> plan = m.take_transfers(); len(plan.swap_outs)                 # ... which are copied to host
    4
    >>> m.complete_transfers(plan); m.free("b")
    >>> m.add_sequence("c", list(range(17)))
    >>> m.lookup("c")
    CachedTokens(device=0, host=16, storage=0, num_prompt_tokens=17)
    """

    _guards_changes = True  # its _check_can_change may refuse

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        tiers: TierConfig,
        hash_scheme: str = DEFAULT_SCHEME,
        namespace: str | Namespace = "default",
        enable_prefix_caching: bool = True,
        event_sink: EventSink | None = None,
        eviction: str = DEFAULT_EVICTION,
    ) -> None:
        super().__init__(
            num_blocks,
            block_size,
            hash_scheme=hash_scheme,
            namespace=namespace,
            enable_prefix_caching=enable_prefix_caching,
            event_sink=event_sink,
            eviction=eviction,
        )
        self._setup_tiers(tiers)

    @classmethod
    def from_config(  # type: ignore[override]
        cls, config: CacheConfig, *, tiers: TierConfig, event_sink: EventSink | None = None
    ) -> TieredKVCacheManager:
        manager = cls.__new__(cls)
        manager._setup(config, event_sink)
        manager._setup_tiers(tiers)
        return manager

    def _setup_tiers(self, tiers: TierConfig) -> None:
        if not isinstance(tiers, TierConfig):
            raise ConfigError(f"tiers must be a TierConfig, got {type(tiers).__name__}")
        self.tiers = tiers
        self._quiet: tuple[GroupTransfers, ...] | None = None  # the group entries of a plan that moves nothing
        config = self.config
        sink = self._tree.events
        group, kind = self._tree_group  # the tiers' events carry the device tree's group tag
        self._tier_events = sink is not None
        self._host = (
            HostTier(
                tiers.num_host_blocks,
                events=sink,
                group=group,
                group_kind=kind,
                block_size=config.block_size,
                eviction=tiers.host_eviction,
            )
            if tiers.host_enabled
            else None
        )
        self._storage = (
            StorageTier(
                tiers,
                config.namespace,  # type: ignore[arg-type]
                config.hash_scheme,
                config.block_size,
                events=sink,
                group=group,
                group_kind=kind,
            )
            if tiers.storage is not None
            else None
        )
        host, storage = self._host is not None, self._storage is not None
        self._host_write_back = host and tiers.host_policy == "write-back"
        self._host_write_through = host and tiers.host_policy == "write-through"
        self._storage_write_back = storage and tiers.storage_policy == "write-back"
        self._storage_write_through = storage and tiers.storage_policy == "write-through"
        self._save_on_preempt = tiers.save_on_preempt
        self._open = self._new_plan(0)
        self._inflight: dict[int, _Plan] = {}
        self._admissions: dict[int, _Admission] = {}  # id(_Sequence) -> its pending admission
        self._loads: dict[int, _Admission] = {}  # storage request id -> admission
        self._probes: dict[Hashable, int] = {}  # sequence -> the storage check add_sequence queued, until answered
        self._held_results: list[tuple[int, LoadOutcome]] = []
        self._hold_for: _Sequence | None = None
        self._counts = _Counts()

    # ------------------------------------------------------------------ properties

    @property
    def host(self) -> HostTier | None:
        """The host tier's bookkeeping (read it; change it only through the manager)."""
        return self._host

    @property
    def storage(self) -> StorageTier | None:
        return self._storage

    def is_ready(self, seq_id: Hashable) -> bool:
        """Whether the sequence has no copies pending (it may run and commit)."""
        return id(self._get(seq_id)) not in self._admissions

    @property
    def num_pending_admissions(self) -> int:
        return len(self._admissions)

    @property
    def num_pending_loads(self) -> int:
        """Storage reads not yet reported by :meth:`poll_loads`."""
        return len(self._loads)

    # ------------------------------------------------------------------ registration and queries

    def _registered(self, seq_id: Hashable, s: _Sequence) -> None:
        """With a storage tier, ask (off-thread) which of the new sequence's blocks it holds."""
        storage = self._storage
        if storage is not None and self._caching and not s.skip_read:
            limit = self._cacheable_blocks(s.content.num_tokens)
            start = self._match_length(s)
            if start < limit:
                request = storage.probe(s.content.hashes[start:limit])
                if request is not None:
                    self._probes[seq_id] = request

    def is_storage_check_pending(self, seq_id: Hashable) -> bool:
        """Whether the storage check :meth:`add_sequence` queued for ``seq_id`` is still unanswered. Pure.

        A sequence registered and admitted in the same step sees no storage hits from that check
        (``lookup`` never waits on I/O). An engine that prefers storage hits to recomputing can
        leave such a sequence waiting a step or two while this is True; a dropped probe (a full
        queue) or a check already answered is False.
        """
        self._get(seq_id)
        request = self._probes.get(seq_id)
        if request is None:
            return False
        if self._storage is not None and self._storage.is_answered(request):
            del self._probes[seq_id]
            return False
        return True

    def free(self, seq_id: Hashable) -> None:
        super().free(seq_id)
        self._probes.pop(seq_id, None)

    def _tier_runs(self, s: _Sequence, device: int) -> tuple[list[int], int]:
        """Host blocks for the run after the device prefix, and the storage run after that. Pure."""
        if not self._caching or s.skip_read:
            return [], 0
        content = s.content
        limit = self._cacheable_blocks(content.num_tokens)
        hashes = content.hashes
        host_blocks = self._host.run(hashes, device, limit) if self._host is not None else []
        start = device + len(host_blocks)
        stored = self._storage.known_run(hashes, start, limit) if self._storage is not None else 0
        return host_blocks, stored

    def _cached(self, s: _Sequence) -> CachedTokens:
        """Cached leading tokens per tier. Pure: no references, no eviction, no statistics, no I/O."""
        size = self._block_size
        device = self._match_length(s)
        host_blocks, stored = self._tier_runs(s, device)
        return CachedTokens(
            device=device * size,
            host=len(host_blocks) * size,
            storage=stored * size,
            num_prompt_tokens=s.content.num_tokens,
        )

    def blocks_short(self, seq_id: Hashable, num_new_tokens: int, *, num_lookahead_tokens: int = 0) -> int:
        s = self._get(seq_id)
        n = _count_arg(num_new_tokens, "num_new_tokens")
        k = _count_arg(num_lookahead_tokens, "num_lookahead_tokens")
        if s.table is not None:
            return super().blocks_short(seq_id, n, num_lookahead_tokens=k)
        matched = self._match(s)
        host_blocks, stored = self._tier_runs(s, len(matched))
        size = self._block_size
        cached = len(matched) + len(host_blocks) + stored
        need = (cached * size + n + k + size - 1) // size - len(matched)
        return max(0, need - (self._pool.num_free - self._pool.count_idle(matched) - self._reserve))

    # ------------------------------------------------------------------ admission

    def _admit(self, seq_id: Hashable, s: _Sequence, n: int, k: int, expected: int | None) -> BlockTable | None:
        """As :meth:`KVCacheManager.allocate`'s admission; host and storage hits get device blocks too.

        Their copies are pending (see the module docstring). The table returned is then an
        :class:`AdmittedTable` naming them: its ``swap_ins`` are also in the next
        :meth:`take_transfers` plan, its ``loads`` are read on the reader thread and reported
        by :meth:`poll_loads`. ``num_new_tokens`` counts the tokens after *all* cached ones, and
        ``num_cached_tokens`` (if given) is the total hit the caller saw, over every tier.
        """
        size = self._block_size
        pool = self._pool
        matched = self._match(s)
        device = len(matched)
        host_blocks, num_loads = self._tier_runs(s, device)
        if expected is not None:  # take exactly the hit the caller saw: a prefix of device, host, storage runs
            self._check_expected(seq_id, expected, device + len(host_blocks) + num_loads)
            del matched[expected:]
            device = len(matched)
            host_blocks = host_blocks[: expected - device]
            num_loads = min(num_loads, expected - device - len(host_blocks))
        cached = device + len(host_blocks) + num_loads
        covered = cached * size + n
        need = (covered + k + size - 1) // size - device
        if need > pool.num_free - pool.count_idle(matched) - self._reserve:
            return None
        if device:
            pool._acquire_valid(matched)
        if host_blocks:
            self._host.acquire(host_blocks)  # type: ignore[union-attr]  # before eviction can write back into host
        if need:
            matched += self._take(need)
        s.table = matched
        s.view = BlockTable(matched, cached * size)
        s.num_covered = covered
        s.lookahead = k
        s.num_committed = device * size
        if not host_blocks and not num_loads:
            self._admitted(
                seq_id, CachedTokens(device=device * size, num_prompt_tokens=s.content.num_tokens), s.preempted
            )
            return s.view
        admission = _Admission(seq_id, s, device, host_blocks, num_loads)
        plan = self._open
        swap_ins: tuple[tuple[int, int], ...] = ()
        start = device + len(host_blocks)
        if host_blocks:
            admission.swap_plan = plan.id
            swap_ins = tuple(zip(host_blocks, matched[device:start], strict=True))
            plan.swap_ins.extend((h, d, admission) for h, d in swap_ins)
        loaded = s.content.hashes[start : start + num_loads]
        view = AdmittedTable(
            matched, swap_ins, tuple(zip(matched[start : start + num_loads], loaded, strict=True)), cached * size
        )
        s.view = view
        if num_loads:
            self._start_load(admission, loaded)
        self._admissions[id(s)] = admission
        return view

    def _start_load(self, admission: _Admission, hashes: Sequence[BlockHash]) -> None:
        """Queue the storage read of an admission's stored blocks (reported by :meth:`poll_loads`)."""
        storage: StorageTier = self._storage  # type: ignore[assignment]
        request = storage.load(hashes)
        admission.load_request = request
        admission.load_plan = self._open.id
        admission.deadline = time.monotonic() + storage.timeout_s
        self._loads[request] = admission

    def _take(self, count: int) -> list[int]:
        pool = self._pool
        short = count - pool.num_fresh
        if short > 0:
            if self._host is None and not self._storage_write_back:  # nothing below wants evicted content
                self._tree.evict(short)
            else:
                hashes: list[BlockHash] = []
                evicted = self._tree.evict(short, hashes)
                if evicted:
                    self._evicted_from_device(evicted, hashes)
                    if self._tier_events:
                        self._publish_tier_events()
        return pool.take_fresh(count)

    def _evicted_from_device(self, blocks: list[int], hashes: list[BlockHash]) -> None:
        """Write-back: evicted device content moves down a tier (the copies run before any reuse)."""
        host = self._host
        for block, block_hash in zip(blocks, hashes, strict=True):
            if host is not None:
                if block_hash in host:
                    host.touch(block_hash)
                    continue
                if self._host_write_back:
                    if self._copy_to_host(block, block_hash):
                        continue
                    self._counts.write_backs_without_host_room += 1
            if self._storage_write_back:
                self._plan_save("device", block, block_hash)

    def _copy_to_host(self, block: int, block_hash: BlockHash) -> bool:
        reserved = self._host.reserve(block_hash)  # type: ignore[union-attr]
        if reserved is None:
            return False
        host_block, evicted = reserved
        if evicted is not None and self._storage_write_back:
            self._plan_save("host", host_block, evicted)  # saved before the swap-out overwrites it
        self._open.swap_outs.append((block, host_block, block_hash))
        return True

    def _plan_save(self, tier: str, block: int, block_hash: BlockHash) -> bool:
        """Queue ``block`` for storage in the open plan unless it is known stored; True if the open plan saves it."""
        storage = self._storage
        plan = self._open
        if storage is None or storage.is_known(block_hash):
            return False
        if block_hash not in plan.queued:
            plan.saves.append(BlockSave(tier, block, block_hash))
            plan.queued.add(block_hash)
            self._counts.saves_planned += 1
        return True

    # ------------------------------------------------------------------ commit, free, preempt

    def _check_can_change(self, seq_id: Hashable, s: _Sequence, what: str) -> None:
        """Commits are refused while the sequence's cached prefix is still being copied."""
        if what == "commit" and id(s) in self._admissions:
            raise SequenceStateError(f"sequence {seq_id!r} has transfers pending: complete them before commit")
        super()._check_can_change(seq_id, s, what)

    def _committed(self, s: _Sequence, start: int, stop: int) -> None:
        """Write-through: newly committed blocks are copied to host and/or queued for storage."""
        if stop <= start or not self._caching or not (self._host_write_through or self._storage_write_through):
            return
        hashes = s.content.hashes
        block_of = self._tree.block_of
        host = self._host
        for position in range(start, stop):
            block_hash = hashes[position]
            node = block_of(block_hash)
            if node is None:
                continue
            if (
                self._host_write_through
                and block_hash not in host  # type: ignore[operator]
                and not self._copy_to_host(node, block_hash)
            ):
                self._counts.write_backs_without_host_room += 1
            if self._storage_write_through:
                self._plan_save("device", node, block_hash)
        if self._tier_events:
            self._publish_tier_events()

    def preempt(self, seq_id: Hashable) -> None:
        """As :meth:`KVCacheManager.preempt`. With ``save_on_preempt``, committed blocks are first queued
        for storage, and the sequence's blocks stay held until the plan that saves them completes."""
        s = self._get(seq_id)
        if self._save_on_preempt and s.table is not None and id(s) not in self._admissions and self._caching:
            pins = s.pins or {}
            table = s.table
            hashes = s.content.hashes
            saving = False
            for position in range(s.num_committed // self._block_size):
                saving |= self._plan_save("device", pins.get(position, table[position]), hashes[position])
            if saving:  # the blocks stay held until the plan that saves them completes
                self._hold_for = s
        try:
            super().preempt(seq_id)
        finally:
            self._hold_for = None

    def _release(self, s: _Sequence) -> None:
        if s.table is None:
            return
        order = list(self._release_order(s))
        defer_to = self._cancel_admission(s)
        if defer_to is None and self._hold_for is s:
            defer_to = self._open
        if defer_to is None:
            self._pool._release_valid(order)
        else:
            defer_to.deferred.append(order)
        self._clear_table(s)

    def _cancel_admission(self, s: _Sequence) -> _Plan | None:
        """Forget a pending admission; returns the in-flight plan still copying into its blocks, if any."""
        return _completion.cancel_admission(self, s)

    # ------------------------------------------------------------------ transfers

    def _new_plan(self, plan_id: int) -> _Plan:
        """A step's empty plan (a hybrid manager's carries its local groups' copies too)."""
        return _Plan(plan_id)

    def take_transfers(self) -> TransferPlan:
        """The copies this step's scheduling calls planned; run them in order, then :meth:`complete_transfers`."""
        return _completion.take_transfers(self)

    def complete_transfers(
        self,
        plan: TransferPlan,
        *,
        saved: Mapping[int, Sequence[object]] | Sequence[object] | None = None,
        failed_swap_ins: Mapping[int, Collection[int]] | Collection[int] = (),
        failed_swap_outs: Mapping[int, Collection[int]] | Collection[int] = (),
    ) -> None:
        """Report that ``plan`` ran. Each argument maps a group to its figures (``{0: ...}`` here: one group).

        ``saved[g]`` holds the payload of each of ``plan.group_transfers[g].saves`` (one bytes-like
        per block, or one per rank): they are queued for storage. Without it the saves are dropped
        and counted. ``failed_swap_ins[g]`` / ``failed_swap_outs[g]`` name the device / host blocks
        whose copy failed: a failed swap-in leaves its host block a host hit and the sequence
        computes those tokens; a failed swap-out host block becomes free. (Group 0's figures given
        bare, not in a mapping, are the previous release's form, still taken.)
        """
        _completion.complete_transfers(
            self, plan, saved=saved, failed_swap_ins=failed_swap_ins, failed_swap_outs=failed_swap_outs
        )

    def _completing(self, plan: TransferPlan, failed_in: set[int], failed_out: set[int]) -> _Plan | None:
        """The in-flight state of ``plan`` once its failure lists are checked (None: an empty plan). Changes nothing."""
        return _completion.completing(self, plan, failed_in, failed_out)

    def poll_loads(self) -> list[LoadResult]:
        """Storage reads that finished (or timed out) since the last poll. Never waits.

        A read is reported only once the plan of the step that admitted its sequence was
        taken, so a block evicted in that step is saved before a load overwrites it.
        """
        return _completion.poll_loads(self)

    def _loaded(self, admission: _Admission, outcome: LoadOutcome, *, timed_out: bool) -> LoadResult:
        return _completion.loaded(self, admission, outcome, timed_out=timed_out)

    def _loads_useless(self, admission: _Admission) -> bool:
        """Whether a copy reported already broke the hit before the admission's stored blocks."""
        return admission.swaps_ok is not None and admission.swaps_ok < len(admission.host_blocks)

    def _finish(self, admission: _Admission) -> None:
        """Both copies are settled: the usable leading run becomes committed, the rest goes back to the pool."""
        _completion.finish(self, admission)

    def _settled(self, admission: _Admission) -> bool:
        """Whether every copy of ``admission`` has been reported (it can finish)."""
        return admission.swaps_ok is not None and admission.loads_ok is not None

    def _usable_hit(self, admission: _Admission) -> int:
        """The leading blocks of a settled admission that hold their content: the run up to the first failed copy."""
        host_ok: int = admission.swaps_ok  # type: ignore[assignment]  # settled
        stored_ok: int = admission.loads_ok if host_ok == len(admission.host_blocks) else 0  # type: ignore[assignment]
        return admission.device + host_ok + stored_ok

    def _cut_back(self, s: _Sequence, valid: int) -> None:
        """A copy failed: the table keeps its first ``valid`` blocks, the rest (never committed) go back to the
        pool and the sequence allocates its remaining tokens again (draft slots included)."""
        _completion.cut_back(self, s, valid)

    # ------------------------------------------------------------------ events

    def _publish_tier_events(self) -> None:
        """Emit what the host and storage tiers noted (called, with a sink only, on the manager's thread)."""
        if self._host is not None:
            self._host.publish()
        if self._storage is not None:
            self._storage.publish()

    def snapshot_events(self) -> list[BlockStored]:
        """Every tier's contents as ``BlockStored`` events (for ``EventPublisher(snapshot=...)``). Pure.

        The device tree's chains (:meth:`~kvblocks.radix.PrefixTree.snapshot_events`), then the host
        tier's ready entries and the hashes storage is known to hold, one event each (flat: no parents).
        Storage notes not yet published stay queued; replayed after the snapshot they change nothing.
        """
        return super().snapshot_events() + self._tier_snapshot()

    def _tier_snapshot(self) -> list[BlockStored]:
        """Group 0's host and storage contents as ``BlockStored`` events. Pure."""
        events: list[BlockStored] = []
        if self._host is not None:
            events += self._host.snapshot_events()
        if self._storage is not None:
            events += self._storage.snapshot_events()
        return events

    # ------------------------------------------------------------------ maintenance

    def reset_prefix_cache(self) -> bool:
        """Also empties the host tier; refused while blocks are in use or transfers are pending."""
        if self._inflight or self._admissions or self._open.swap_outs:
            return False
        if not super().reset_prefix_cache():
            return False
        if self._host is not None:
            self._host.clear()
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued storage writes are done (shutdown, tests). True if they are."""
        return self._storage.flush(timeout) if self._storage is not None else True

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop the storage threads (queued writes get ``timeout`` seconds) and close the backend."""
        if self._storage is not None:
            self._storage.close(timeout)

    def __enter__(self: _Manager) -> _Manager:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        """Leaving the ``with`` block closes the manager (its storage threads stop), also on an exception."""
        self.close()

    @property
    def tier_stats(self) -> TierStats:
        host = self._host
        storage = self._storage
        counts = asdict(self._counts)
        return TierStats(
            host_blocks=host.pool.num_blocks if host is not None else 0,
            host_blocks_cached=len(host) if host is not None else 0,
            host_evicted=host.num_evicted if host is not None else 0,
            storage=storage.stats.snapshot() if storage is not None else None,
            writer=storage.writer.stats.snapshot() if storage is not None else None,
            **counts,
        )

    def _count_other_holders(self, expected: list[int]) -> None:
        for plan in (self._open, *self._inflight.values()):
            for order in plan.deferred:
                for block in order:
                    expected[block] += 1

    def check_integrity(self) -> None:
        """Also checks the host tier, the plans and the pending admissions."""
        super().check_integrity()
        self._check_tiers()

    def _check_tiers(self) -> None:
        """The host tier, the plans and the pending admissions agree (group 0's part of a hybrid manager)."""
        _completion.check_tiers(self)
