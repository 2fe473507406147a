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
from collections.abc import Callable, Iterable, Mapping
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

    def merged(self, other: WorkerReport) -> WorkerReport:
        """Both ranks' reports as one: a load failed if it failed on any rank."""
        failed = {step: blocks | other.failed.get(step, frozenset()) for step, blocks in self.failed.items()}
        for step, blocks in other.failed.items():
            failed.setdefault(step, blocks)
        withheld = tuple(dict.fromkeys(self.withheld + other.withheld))
        return WorkerReport(failed, withheld)


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

    def __init__(self, tier: StorageTier, *, reduce: Reduce | None = None, keep_steps: int = 256) -> None:
        self.tier = tier
        self.blocks: LayerBlocks | None = None
        self.stats = ConnectorStats()
        self.record = LoadRecord(keep_steps)
        self._reduce = reduce
        self._load_errors: set[int] = set()
        self._reported: dict[int, frozenset[int]] = {}
        self._withheld: list[tuple[str, BlockHash]] = []

    def load(self, plan: StepPlan) -> None:
        """Run ``plan``'s loads; poison and record every block that did not arrive sound."""
        failed = list(plan.failed)
        arrived = []
        for run in plan.loads:
            usable = 0
            try:
                if self.blocks is None:
                    raise ConfigError("no KV caches registered")
                usable = load_run(self.tier, self.blocks, run.hashes, run.block_ids)
            except Exception as error:  # every block of the run is recomputed
                self.stats.note_error(f"load: {error!r}")
                _log.exception("kvblocks connector: loading %d blocks failed", len(run.block_ids))
            self.stats.load_blocks += usable
            arrived.append(usable)
            failed.extend(run.block_ids[usable:])
        self.stats.load_failed_blocks += len(failed)
        if failed:
            self._poison(failed)
            self._load_errors.update(failed)
        if plan.loads or plan.failed:
            self.record.note(plan.step, arrived)
            self._reported[plan.step] = frozenset(failed)
        self.record.forget_before(plan.oldest_pending)

    def _poison(self, block_ids: list[int]) -> None:
        if self.blocks is None:
            return
        try:
            self.blocks.poison(block_ids)
        except Exception as error:  # ids out of range: a plan that went wrong; vLLM recomputes them anyway
            self.stats.note_error(f"poison: {error!r}")
            _log.exception("kvblocks connector: poisoning %d failed blocks failed", len(block_ids))

    def save(self, plan: StepPlan) -> None:
        """Copy ``plan``'s saves out of the KV tensors and queue them, withholding every block whose guard names a
        failed load (and the rest of its run: their contexts contain it too)."""
        if self.blocks is None:
            return
        guards = [roots for run in plan.saves for roots in run.guards]
        failed = self.record.failed_roots((r for roots in guards for r in roots), self._reduce) if guards else set()
        for run in plan.saves:
            keep = len(run.block_ids)
            if failed and run.guards:
                keep = next((i for i, roots in enumerate(run.guards) if not failed.isdisjoint(roots)), keep)
            if keep < len(run.block_ids):
                self.stats.save_withheld_blocks += len(run.block_ids) - keep
                self._withheld.extend((run.request_id, h) for h in run.hashes[keep:])
            if not keep:
                continue
            try:
                save_run(self.tier, self.blocks, run.hashes[:keep], run.block_ids[:keep])
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
        tier, writer = self.tier.stats, self.tier.writer.stats
        return {
            **self.stats.counters(),
            "loads_missing": tier.loads_missing,
            "loads_corrupt": tier.loads_corrupt,
            "loads_wrong_key": tier.loads_wrong_key,
            "writes_dropped": writer.dropped,
            "write_errors": writer.failed,
        }

    def report(self) -> WorkerReport | None:
        """What the scheduler side must hear since the last report (None: nothing)."""
        if not self._reported and not self._withheld:
            return None
        report = WorkerReport(self._reported, tuple(self._withheld))
        self._reported, self._withheld = {}, []
        return report
