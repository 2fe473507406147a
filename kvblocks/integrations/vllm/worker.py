"""The connector's worker side, without vLLM: a step's loads before the forward pass, its saves after it.

vLLM calls a worker's connector in this order every step::

    start_load_kv   -> ConnectorWorker.load    read entries into the planned blocks; a block that did not
                                               arrive sound is *poisoned* (every byte 0xFF: NaN in every
                                               float format) and reported failed -- never readable as KV
    (forward pass)
    wait_for_save   -> ConnectorWorker.save    copy the filled blocks out and queue them, except a block
                                               whose guard names a load that failed (its context was wrong)
    get_block_ids_with_load_errors -> take_load_errors       vLLM recomputes these
    build_connector_worker_meta    -> report                 the scheduler side's confirmation

The worker knows a step's load outcomes before it saves, the scheduler only a step later (or two, with
async scheduling): so the scheduler plans every save that depends on a load of unknown outcome with that
load in its guard (:mod:`~kvblocks.integrations.vllm.provenance`), and the worker resolves it. With tensor
parallelism each rank loads its own shard, and a shard that failed on one rank makes every rank's KV
computed over it wrong (the ranks' partial results are summed): ``reduce`` combines the ranks' verdicts so
that all of them drop the same saves.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvblocks.errors import ConfigError
from kvblocks.hashing import BlockHash
from kvblocks.integrations.vllm.block_copy import LayerBlocks
from kvblocks.integrations.vllm.planner import StepPlan
from kvblocks.integrations.vllm.provenance import Root
from kvblocks.integrations.vllm.transfer import load_run, save_run
from kvblocks.tiers.storage_tier import StorageTier

__all__ = ["COUNTERS", "ConnectorStats", "ConnectorWorker", "LoadRecord", "WorkerReport"]

_log = logging.getLogger("kvblocks.integrations.vllm")

COUNTERS: dict[str, str] = {
    "load_blocks": "Blocks loaded from the store into vLLM's KV cache, sound.",
    "load_failed_blocks": "Blocks vLLM expected loaded that did not arrive sound (reported to vLLM, recomputed).",
    "save_blocks": "Blocks copied out of vLLM's KV cache and queued for the store.",
    "save_failed_blocks": "Blocks whose save failed before reaching the writer.",
    "save_withheld_blocks": "Blocks not saved because their context held a load that failed (computed over wrong KV).",
    "plan_errors": "Connector calls on the scheduler that failed and were answered safely (no hit, no save).",
    "loads_missing": "Stored entries found absent when read.",
    "loads_corrupt": "Stored entries found damaged when read (removed from the store).",
    "loads_wrong_key": "Sound entries found under another block's key (removed from the store).",
    "writes_dropped": "Saves the background writer dropped because its queue was full.",
    "write_errors": "Entries the store failed to write.",
}
"""Every counter the connector reports, with its meaning (the Prometheus help text)."""

Reduce = Callable[[list[int]], list[int]]
"""Element-wise maximum of a list of 0/1 flags across the tensor-parallel ranks (every rank calls it with a list
of the same length in the same step)."""


@dataclass
class ConnectorStats:
    """What one connector half did (counts of blocks)."""

    load_blocks: int = 0
    load_failed_blocks: int = 0
    save_blocks: int = 0
    save_failed_blocks: int = 0
    save_withheld_blocks: int = 0
    """Saves dropped because a load their context depended on failed (their KV was computed over it)."""
    plan_errors: int = 0
    errors: list[str] = field(default_factory=list)

    def note_error(self, what: str) -> None:
        if len(self.errors) < 32:
            self.errors.append(what)

    def counters(self) -> dict[str, int]:
        """The counters alone (what vLLM's stats carry)."""
        return {name: value for name, value in vars(self).items() if isinstance(value, int)}


@dataclass(frozen=True)
class WorkerReport:
    """What a worker tells its scheduler side after a step (vLLM's ``kv_connector_worker_meta``)."""

    failed: Mapping[int, frozenset[int]]
    """Per step whose loads ran: the block ids whose load failed there (empty: every load succeeded)."""
    withheld: tuple[tuple[str, BlockHash], ...] = ()
    """Saves dropped over a failed load: (request id, hash), to be saved once vLLM recomputes them."""
    lost: tuple[tuple[int, BlockHash], ...] = ()
    """Per-request loads (hybrid models): (group, hash) of each block that did not arrive sound."""

    def merged(self, other: WorkerReport) -> WorkerReport:
        """Both ranks' reports as one: a load failed if it failed on any rank."""
        failed = {step: blocks | other.failed.get(step, frozenset()) for step, blocks in self.failed.items()}
        for step, blocks in other.failed.items():
            failed.setdefault(step, blocks)
        withheld = tuple(dict.fromkeys(self.withheld + other.withheld))
        return WorkerReport(failed, withheld, tuple(dict.fromkeys(self.lost + other.lost)))


class LoadRecord:
    """The outcome of the recent steps' loads on this worker, for resolving save guards: per step, how many
    leading blocks of each load run arrived sound.

    A root of a step never noted (or forgotten) counts as failed: a save is only ever kept for loads known to
    have succeeded.
    """

    def __init__(self, keep_steps: int = 256) -> None:
        if isinstance(keep_steps, bool) or not isinstance(keep_steps, int) or keep_steps < 1:
            raise ConfigError(f"keep_steps must be an int >= 1, got {keep_steps!r}")
        self._arrived: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._keep = keep_steps

    def note(self, step: int, arrived: Iterable[int]) -> None:
        """Step ``step``'s loads ran; ``arrived[r]`` leading blocks of its load run ``r`` arrived sound."""
        self._arrived[step] = tuple(arrived)
        while len(self._arrived) > self._keep:
            self._arrived.popitem(last=False)

    def forget_before(self, step: int) -> None:
        """No guard names a step before ``step`` any more (the scheduler has their outcomes)."""
        while self._arrived and next(iter(self._arrived)) < step:
            self._arrived.popitem(last=False)

    def failed_roots(self, roots: Iterable[Root], reduce: Reduce | None = None) -> set[Root]:
        """Of ``roots``, those whose loads failed (here, or with ``reduce``, on any rank)."""
        ordered = sorted(set(roots))
        flags = []
        for step, run, count in ordered:
            known = self._arrived.get(step)
            flags.append(int(known is None or run >= len(known) or known[run] < count))
        if reduce is not None and ordered:
            flags = reduce(flags)
        return {root for root, flag in zip(ordered, flags, strict=True) if flag}


class ConnectorWorker:
    """A worker's loads and saves for each step's :class:`~kvblocks.integrations.vllm.planner.StepPlan` (see the
    module docstring). ``blocks`` is set once vLLM registers its KV tensors."""

    def __init__(
        self,
        tier: StorageTier | Sequence[StorageTier],
        *,
        reduce: Reduce | None = None,
        keep_steps: int = 256,
        per_request: bool = False,
    ) -> None:
        """``tier``: the storage tier, or one per KV cache group (vLLM's hybrid allocator), indexed like the
        plans' :attr:`~kvblocks.integrations.vllm.planner.BlockRun.group`. ``per_request``: loads are vLLM's
        asynchronous ones (hybrid models), whose outcomes it hears per request (:meth:`take_finished_loads`),
        never as block ids (those are unique only within a group)."""
        self.per_request = per_request
        self.tiers: tuple[StorageTier, ...] = (tier,) if isinstance(tier, StorageTier) else tuple(tier)
        if not self.tiers:
            raise ConfigError("a connector worker needs at least one storage tier")
        self.group_blocks: list[LayerBlocks | None] = [None] * len(self.tiers)
        self.stats = ConnectorStats()
        self.record = LoadRecord(keep_steps)
        self._reduce = reduce
        self._load_errors: set[int] = set()
        self._reported: dict[int, frozenset[int]] = {}
        self._withheld: list[tuple[str, BlockHash]] = []
        self._loads_finished: set[str] = set()
        self._loads_failed: set[str] = set()
        self._lost: list[tuple[int, BlockHash]] = []

    @property
    def tier(self) -> StorageTier:
        """Group 0's storage tier (the only one of a single-group deployment)."""
        return self.tiers[0]

    @property
    def blocks(self) -> LayerBlocks | None:
        """Group 0's blocks (the only ones of a single-group deployment), once registered."""
        return self.group_blocks[0]

    @blocks.setter
    def blocks(self, blocks: LayerBlocks | None) -> None:
        self.group_blocks[0] = blocks

    def load(self, plan: StepPlan) -> None:
        """Run ``plan``'s loads; poison and record every block that did not arrive sound."""
        failed = list(plan.failed)
        arrived = []
        hybrid = self.per_request
        for run in plan.loads:
            usable = 0
            blocks = self.group_blocks[run.group] if 0 <= run.group < len(self.tiers) else None
            try:
                if blocks is None:
                    raise ConfigError(f"no KV caches registered for group {run.group}")
                usable = load_run(self.tiers[run.group], blocks, run.hashes, run.block_ids)
            except Exception as error:  # every block of the run is recomputed
                self.stats.note_error(f"load: {error!r}")
                _log.exception("kvblocks connector: loading %d blocks failed", len(run.block_ids))
            self.stats.load_blocks += usable
            arrived.append(usable)
            lost = run.block_ids[usable:]
            if hybrid:  # vLLM hears per request (its block ids are unique only within a group)
                self._loads_finished.add(run.request_id)
                if lost:
                    self._loads_failed.add(run.request_id)
                    self._lost.extend((run.group, h) for h in run.hashes[usable:])
            else:
                failed.extend(lost)
            if lost:
                self.stats.load_failed_blocks += len(lost)
                if hybrid:  # vLLM frees them unread, and may hand them to a request that fills them in part
                    self._clear(blocks, list(lost))
                else:
                    self._poison(blocks, list(lost))
        self._loads_finished.update(plan.failed_requests)
        self._loads_failed.update(plan.failed_requests)
        if plan.failed:
            self.stats.load_failed_blocks += len(plan.failed)
            self._poison(self.blocks, list(plan.failed))
        if failed:
            self._load_errors.update(failed)
        if (plan.loads or plan.failed) and not hybrid:
            self.record.note(plan.step, arrived)
            self._reported[plan.step] = frozenset(failed)
        self.record.forget_before(plan.oldest_pending)

    def _clear(self, blocks: LayerBlocks | None, block_ids: list[int]) -> None:
        if blocks is None:
            return
        try:
            blocks.zero(block_ids)
        except Exception as error:  # ids out of range: a plan that went wrong
            self.stats.note_error(f"zero: {error!r}")
            _log.exception("kvblocks connector: clearing %d failed blocks failed", len(block_ids))

    def _poison(self, blocks: LayerBlocks | None, block_ids: list[int]) -> None:
        if blocks is None:
            return
        try:
            blocks.poison(block_ids)
        except Exception as error:  # ids out of range: a plan that went wrong; vLLM recomputes them anyway
            self.stats.note_error(f"poison: {error!r}")
            _log.exception("kvblocks connector: poisoning %d failed blocks failed", len(block_ids))

    def save(self, plan: StepPlan) -> None:
        """Copy ``plan``'s saves out of the KV tensors and queue them, withholding every block whose guard names a
        failed load (and the rest of its run: their contexts contain it too)."""
        guards = [roots for run in plan.saves for roots in run.guards]
        failed = self.record.failed_roots((r for roots in guards for r in roots), self._reduce) if guards else set()
        for run in plan.saves:
            keep = len(run.block_ids)
            if failed and run.guards:
                keep = next((i for i, roots in enumerate(run.guards) if not failed.isdisjoint(roots)), keep)
            if keep < len(run.block_ids):
                self.stats.save_withheld_blocks += len(run.block_ids) - keep
                self._withheld.extend((run.request_id, h) for h in run.hashes[keep:])
            blocks = self.group_blocks[run.group] if 0 <= run.group < len(self.tiers) else None
            if not keep or blocks is None:
                continue
            try:
                save_run(self.tiers[run.group], blocks, run.hashes[:keep], run.block_ids[:keep])
                self.stats.save_blocks += keep
            except Exception as error:  # a save that fails is a future miss
                self.stats.save_failed_blocks += keep
                self.stats.note_error(f"save: {error!r}")
                _log.exception("kvblocks connector: saving %d blocks failed", keep)

    def take_load_errors(self) -> set[int]:
        """The blocks vLLM must recompute (each reported once)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def counters(self) -> dict[str, int]:
        """Every counter the connector publishes (:data:`COUNTERS`), cumulative."""
        tiers = self.tiers
        return {
            **self.stats.counters(),
            "loads_missing": sum(t.stats.loads_missing for t in tiers),
            "loads_corrupt": sum(t.stats.loads_corrupt for t in tiers),
            "loads_wrong_key": sum(t.stats.loads_wrong_key for t in tiers),
            "writes_dropped": sum(t.writer.stats.dropped for t in tiers),
            "write_errors": sum(t.writer.stats.failed for t in tiers),
        }

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """The requests whose loads ran since the last call, and of those the ones whose load failed (hybrid
        models: vLLM hears of loads per request, as ``finished_recving`` / ``failed_recving``)."""
        finished, failed = self._loads_finished, self._loads_failed
        self._loads_finished, self._loads_failed = set(), set()
        return finished, failed

    def report(self) -> WorkerReport | None:
        """What the scheduler side must hear since the last report (None: nothing)."""
        if not self._reported and not self._withheld and not self._lost:
            return None
        report = WorkerReport(self._reported, tuple(self._withheld), tuple(self._lost))
        self._reported, self._withheld, self._lost = {}, [], []
        return report
