"""``KVBlocksConnector``: vLLM's ``KVConnectorBase_V1`` over kvblocks' storage tier.

vLLM builds one connector in its scheduler and one in every worker; each half has one job::

    scheduler (no I/O, TransferPlanner)                  worker (owns the KV tensors, ConnectorWorker)
    get_num_new_matched_tokens -> match                    start_load_kv -> load (straight into the blocks;
    update_state_after_alloc   -> allocated                                  what fails is poisoned, reported)
    build_connector_meta       -> plan_step: StepPlan ---> wait_for_save -> save (entries built in place,
    update_connector_output    <- confirm <--- report --   build_connector_worker_meta    written off-thread)
    request_finished           -> finished

* A hit is the leading run of whole blocks the storage index knows past vLLM's local hit; an
  unknown block is probed off-thread while vLLM asks again (``None``), never read on the scheduler.
* A load that finds an entry missing, corrupt or written under another key is a counted miss: its
  block ids (and the rest of the run) are filled with NaN and go to vLLM's load-error hook, and vLLM
  recomputes them. Nothing a store returns reaches the KV unchecked, and no exception reaches vLLM.
* Saves copy a step's newly filled blocks out of the KV tensors in ``wait_for_save`` -- before vLLM can
  reuse them, so preemption and abort need nothing more -- and hand the bytes to the background writer,
  whose bounded queue drops its oldest entry when full instead of waiting.
* A block whose context held a failed load is never saved: the forward pass of the step that loaded it
  has read it already (for every request that shares it), and vLLM's recomputation comes a step later.
  Each save carries the loads of unknown outcome it depends on; the worker withholds it if one failed
  (:mod:`~kvblocks.integrations.vllm.provenance`), and the block is saved once recomputed.
* The counters reach vLLM's stats (its "KV Transfer metrics" log line, ``vllm:kvblocks_*`` on its
  Prometheus endpoint and in ``LLM.get_metrics()``; :mod:`~kvblocks.integrations.vllm.stats`).
* Keys are vLLM's own block hashes under a key space naming the model, the hash algorithm, the block
  size and the KV format (:class:`~kvblocks.integrations.vllm.kv_format.VllmKVFormat`); each
  tensor-parallel rank stores its shard under its own key.

Load failures are recomputed only with ``kv_load_failure_policy="recompute"``: the connector sets it
(a cache miss must never fail a request) and says so in the log.

With vLLM's hybrid memory allocator (several KV cache groups, or a sliding-window one) each group stores under
keys of its own (:mod:`~kvblocks.integrations.vllm.groups`), hits follow every group's rule, and loads are
asynchronous and reported per request (:mod:`~kvblocks.integrations.vllm.hybrid_planner`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvblocks.errors import ConfigError
from kvblocks.hashing import Namespace
from kvblocks.integrations.vllm.groups import VllmGroup, describe_format, describe_groups
from kvblocks.integrations.vllm.hybrid_planner import HybridPlanner
from kvblocks.integrations.vllm.planner import Scheduled, StepPlan, TransferPlanner
from kvblocks.integrations.vllm.settings import ConnectorSettings
from kvblocks.integrations.vllm.stats import KVBlocksConnectorStats, KVBlocksPromMetrics
from kvblocks.integrations.vllm.worker import COUNTERS, ConnectorStats, ConnectorWorker, Reduce, WorkerReport
from kvblocks.tiers.config import TierConfig
from kvblocks.tiers.storage_tier import StorageTier

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "ConnectorStats",
    "KVBlocksConnector",
    "KVBlocksConnectorMetadata",
    "KVBlocksWorkerMetadata",
    "describe_format",
    "describe_groups",
]

_log = logging.getLogger("kvblocks.integrations.vllm")


class KVBlocksConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's :class:`StepPlan`, from the scheduler to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KVBlocksWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """One step's :class:`WorkerReport`, from the workers to the scheduler (vLLM merges the ranks' with
    :meth:`aggregate`)."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVBlocksWorkerMetadata):
            return KVBlocksWorkerMetadata(self.report.merged(other.report))
        return self


class KVBlocksConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Stores vLLM's full blocks in kvblocks' storage tier and loads them back as external hits.

    Configured through ``kv_transfer_config`` (see :mod:`kvblocks.integrations.vllm.settings`)::

        LLM(model, kv_transfer_config={"kv_connector": "KVBlocksConnector",
                                       "kv_connector_module_path": "kvblocks.integrations.vllm",
                                       "kv_role": "kv_both",
                                       "kv_connector_extra_config": {"path": "/mnt/kv"}})
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        log_like_vllm()
        transfer = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        self.groups: tuple[VllmGroup, ...] = describe_groups(vllm_config, kv_cache_config, self.settings.salt)
        self.hybrid = self.groups[0].hybrid
        """vLLM's hybrid allocator with several groups or a windowed one: per-group keys, asynchronous loads."""
        self.format = self.groups[0].format
        tp = int(vllm_config.parallel_config.tensor_parallel_size)
        self._is_scheduler = role == KVConnectorRole.SCHEDULER
        self._cache_hit_source = (
            CacheHitSource.DISK if self.settings.storage == "file" else (CacheHitSource.EXTERNAL_UNSPECIFIED)
        )
        reduce: Reduce | None = None
        if self._is_scheduler:
            ranks: tuple[int, ...] = tuple(range(tp)) if tp > 1 else ()
            if transfer.kv_load_failure_policy != "recompute":
                _log.info("kvblocks: kv_load_failure_policy set to 'recompute': a cache miss must not fail a request")
                transfer.kv_load_failure_policy = "recompute"
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            ranks = (int(get_tensor_model_parallel_rank()),) if tp > 1 else ()
            reduce = _tp_reduce() if tp > 1 and not self.hybrid else None
        storage = self.settings.open_storage(writes=not self._is_scheduler)  # the scheduler only looks up
        self.tiers = tuple(
            StorageTier(
                TierConfig(
                    storage=storage,
                    entry_format=group.format.entry_format,
                    ranks=ranks,
                    max_pending_writes=self.settings.max_pending_writes,
                    storage_timeout_s=self.settings.storage_timeout_s,
                ),
                Namespace(group.format.model, group.format.salt),
                group.format.scheme,
                group.format.block_size,
                tag=group.tag,
                owns_backend=group.number == 0,  # one backend, closed by group 0's tier (closed last)
                writer_on_demand=self._is_scheduler,  # the scheduler's half never saves: no writer thread
            )
            for group in self.groups
        )
        self.tier = self.tiers[0]
        fmt = self.format
        timeout = self.settings.lookup_timeout_s
        self.planner: TransferPlanner | HybridPlanner
        if self.hybrid:
            rules = [group.rule for group in self.groups]
            self.planner = HybridPlanner(rules, self.tiers, fmt.block_size, lookup_timeout_s=timeout)
        else:
            self.planner = TransferPlanner(self.tier, fmt.block_size, lookup_timeout_s=timeout)
        self.worker = ConnectorWorker(self.tiers, reduce=reduce, per_request=self.hybrid)
        self._source = "scheduler" if self._is_scheduler else f"worker{ranks[0] if ranks else 0}"

    @property
    def stats(self) -> ConnectorStats:
        """This half's counters (the worker's loads and saves; the scheduler's plan errors)."""
        return self.worker.stats

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            tokens = self.planner.match(
                request.request_id, request.block_hashes, request.num_tokens, num_computed_tokens
            )
        except Exception as error:  # never into the engine: no hit
            self._plan_error("match", error)
            return 0, False
        return tokens, self.hybrid and bool(tokens)  # a hybrid model's load is asynchronous (see hybrid_planner)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        block_ids: list[int] = []
        try:
            tables = blocks.get_block_ids()
            if isinstance(self.planner, HybridPlanner):
                self.planner.allocated(request.request_id, [list(ids) for ids in tables], num_external_tokens)
            else:
                block_ids = list(tables[0])
                self.planner.allocated(request.request_id, block_ids, num_external_tokens)
        except Exception as error:
            # vLLM counts these tokens as loaded: blocks no load will fill are reported as failed loads
            self._plan_error("allocated", error)
            if isinstance(self.planner, HybridPlanner):
                self.planner.fail(request.request_id)
            else:
                self.planner.fail(block_ids)

    def build_connector_meta(self, scheduler_output: Any) -> KVBlocksConnectorMetadata:
        try:
            return KVBlocksConnectorMetadata(self.planner.plan_step(*_step_of(scheduler_output, self.hybrid)))
        except Exception as error:  # no saves this step (future misses); the loads still run
            self._plan_error("step", error)
            return KVBlocksConnectorMetadata(self.planner.salvage())

    def update_connector_output(self, connector_output: Any) -> None:
        try:
            meta = getattr(connector_output, "kv_connector_worker_meta", None)
            if isinstance(self.planner, HybridPlanner):
                failed_requests = getattr(connector_output, "failed_recving", None) or ()
                lost = meta.report.lost if isinstance(meta, KVBlocksWorkerMetadata) else ()
                self.planner.loads_done(failed_requests, lost)
                return
            failed = getattr(connector_output, "invalid_block_ids", None)
            if failed:
                self.planner.load_failed(failed)
            if isinstance(meta, KVBlocksWorkerMetadata):
                self.planner.confirm(meta.report.failed, meta.report.withheld)
        except Exception as error:  # a stale index costs misses; an unconfirmed load, saves: never wrong KV
            self._plan_error("outcome", error)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.planner.finished(request.request_id)
        return False, None  # saves copy their blocks in the step that fills them: nothing holds the blocks

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid allocator's end of a request (every group's blocks): as :meth:`request_finished`."""
        self.planner.finished(request.request_id)
        return False, None

    def _plan_error(self, what: str, error: Exception) -> None:
        self.stats.plan_errors += 1
        self.stats.note_error(f"{what}: {error!r}")
        _log.exception("kvblocks connector (%s) failed", what)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvblocks.integrations.vllm.block_copy import LayerBlocks

        for group in self.groups:
            if self.hybrid:
                missing = [name for name in group.layer_names if name not in kv_caches]
                if missing:
                    raise ConfigError(f"vLLM registered no KV cache for group {group.number}'s layers {missing}")
                blocks = LayerBlocks({name: kv_caches[name] for name in group.layer_names})
            else:
                blocks = LayerBlocks(kv_caches)
            fmt = group.format
            if len(blocks.layer_names) != fmt.num_layers or blocks.bytes_per_layer_block != fmt.bytes_per_layer_block:
                raise ConfigError(
                    f"vLLM registered {len(blocks.layer_names)} layers of {blocks.bytes_per_layer_block} bytes per "
                    f"block for group {group.number}; the KV cache config says {fmt.num_layers} of "
                    f"{fmt.bytes_per_layer_block}"
                )
            self.worker.group_blocks[group.number] = blocks

    @property
    def blocks(self) -> Any:
        return self.worker.blocks

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is not None:
            self.worker.load(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are saved in wait_for_save

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan is not None:
            self.worker.save(plan)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()  # always empty for a hybrid model (see get_transfer_results)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """A hybrid model's loads, per request: every one that ran is finished, the unsound ones failed too."""
        if not self.hybrid:
            return super().get_transfer_results(finished_req_ids)
        finished, failed = self.worker.take_finished_loads()
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def build_connector_worker_meta(self) -> KVBlocksWorkerMetadata | None:
        report = self.worker.report()
        return None if report is None else KVBlocksWorkerMetadata(report)

    def get_kv_connector_stats(self) -> KVBlocksConnectorStats | None:
        """This half's totals so far (see :mod:`~kvblocks.integrations.vllm.stats`), once it has counted anything."""
        now = self.stats.counters() if self._is_scheduler else self.worker.counters()
        totals = {name: value for name, value in now.items() if name in COUNTERS and value}
        return KVBlocksConnectorStats(data={"sources": {self._source: totals}}) if totals else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBlocksConnectorStats:
        stats = KVBlocksConnectorStats()
        stats.reset()
        return stats.aggregate(KVBlocksConnectorStats(data=data or {}))  # type: ignore[no-any-return]

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: Any
    ) -> KVBlocksPromMetrics:
        return KVBlocksPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KVBlocksConnectorMetadata) else None

    def shutdown(self) -> None:
        for tier in reversed(self.tiers):  # group 0's tier owns the backend: it closes last
            tier.close()


def log_like_vllm() -> None:
    """Give kvblocks' log lines vLLM's handlers, where the application configured none for kvblocks.

    kvblocks only adds a ``NullHandler`` (a library's manners), and vLLM configures its own ``vllm`` logger with
    propagation off and leaves the root logger bare: inside vLLM, kvblocks' warnings (corrupt entries removed,
    failed writes) would print nowhere. A connector is vLLM's guest, so its lines go where vLLM's go.
    """
    ours, theirs = logging.getLogger("kvblocks"), logging.getLogger("vllm")
    if any(not isinstance(h, logging.NullHandler) for h in ours.handlers) or logging.getLogger().handlers:
        return  # the application decided where kvblocks' lines go
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)


def _step_of(out: Any, per_group: bool = False) -> tuple[list[Scheduled], tuple[str, ...]]:
    """vLLM's scheduler output as the planner's plain records: running requests, then new ones (their order).

    Block ids are group 0's list, or with ``per_group`` (hybrid models) a list per group."""

    def ids(groups: Any) -> Any:
        if per_group:
            return [list(g) for g in groups] if groups else ()
        return list(groups[0]) if groups else []

    scheduled = out.num_scheduled_tokens
    drafts = out.scheduled_spec_decode_tokens or {}
    cached = out.scheduled_cached_reqs
    resumed: set[str] = getattr(cached, "resumed_req_ids", None) or set()
    records: list[Scheduled] = []
    for i, request_id in enumerate(cached.req_ids):
        fresh = ids(cached.new_block_ids[i])
        # a resumed request's new block ids are its whole table; a running one's extend it
        records.append(
            Scheduled(
                request_id,
                cached.num_computed_tokens[i],
                int(scheduled.get(request_id, 0)),
                len(drafts.get(request_id, ())),
                block_ids=fresh if request_id in resumed else None,
                new_block_ids=() if request_id in resumed else fresh,
            )
        )
    for new in out.scheduled_new_reqs:
        records.append(
            Scheduled(
                new.req_id,
                new.num_computed_tokens,
                int(scheduled.get(new.req_id, 0)),
                len(drafts.get(new.req_id, ())),
                block_ids=ids(new.block_ids),
            )
        )
    return records, tuple(out.preempted_req_ids or ())


def _tp_reduce() -> Reduce:
    """The element-wise maximum of 0/1 flags across this worker's tensor-parallel group (its CPU group)."""
    import torch
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group().cpu_group

    def reduce(flags: list[int]) -> list[int]:
        tensor = torch.tensor(flags, dtype=torch.int32)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return [int(v) for v in tensor.tolist()]

    return reduce
