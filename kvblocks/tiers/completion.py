"""The tiered manager's completion side: reported transfers and storage reads settle its pending admissions.

Each function is the body of the :class:`~kvblocks.tiers.manager.TieredKVCacheManager` method of the
same name; it calls the manager's other methods through ``m`` so a subclass's overrides apply.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from kvblocks.accounting import CachedTokens
from kvblocks.errors import IntegrityError, InvalidArgumentError
from kvblocks.manager import KVCacheManager, _Sequence
from kvblocks.tiers.admission_state import _Admission, _Plan
from kvblocks.tiers.storage_tier import LoadOutcome
from kvblocks.tiers.transfers import LoadResult, TransferPlan, per_group


def complete_transfers(
    m: Any,
    plan: TransferPlan,
    *,
    saved: Mapping[int, Sequence[object]] | Sequence[object] | None = None,
    failed_swap_ins: Mapping[int, Collection[int]] | Collection[int] = (),
    failed_swap_outs: Mapping[int, Collection[int]] | Collection[int] = (),
) -> None:
    """The body of :meth:`TieredKVCacheManager.complete_transfers`."""
    saved_0: Sequence[object] | None
    saved_0, _ = per_group(saved, "saved", 1)
    failed_swap_ins, _ = per_group(failed_swap_ins, "failed_swap_ins", 1, ())
    failed_swap_outs, _ = per_group(failed_swap_outs, "failed_swap_outs", 1, ())
    failed_in = set(failed_swap_ins)
    failed_out = set(failed_swap_outs)
    state = m._completing(plan, failed_in, failed_out)
    if state is None:
        return
    storage = m._storage
    if saved_0 is not None and state.saves:
        storage.save([save.block_hash for save in state.saves], saved_0)  # validates first
    elif state.saves:
        m._counts.saves_without_payload += len(state.saves)
    del m._inflight[plan.id]
    counts = m._counts
    host = m._host
    for _, host_block, block_hash in state.swap_outs:
        ok = host_block not in failed_out
        host.complete(block_hash, host_block, ok)
        counts.swap_outs += int(ok)
        counts.swap_out_failures += int(not ok)
    if state.swap_ins:
        host.release([h for h, _, _ in state.swap_ins])
        leading: dict[_Admission, int] = {}  # swap-ins that succeeded before the first failure
        broken: set[_Admission] = set()
        for _, device_block, admission in state.swap_ins:
            leading.setdefault(admission, 0)
            if device_block in failed_in:
                broken.add(admission)
                counts.swap_in_failures += 1
            elif admission not in broken:
                leading[admission] += 1
                counts.swap_ins += 1
        for admission, run in leading.items():
            if not admission.cancelled:
                admission.swaps_ok = run
                m._finish(admission)
    for order in state.deferred:
        m._pool._release_valid(order)
    if m._tier_events:
        m._publish_tier_events()


def completing(m: Any, plan: TransferPlan, failed_in: set[int], failed_out: set[int]) -> _Plan | None:
    """The body of :meth:`TieredKVCacheManager._completing`."""
    if not isinstance(plan, TransferPlan):
        raise InvalidArgumentError(f"expected a TransferPlan, got {type(plan).__name__}")
    state: _Plan | None = m._inflight.get(plan.id)
    if state is None:
        if not plan:
            if failed_in or failed_out:
                raise InvalidArgumentError(
                    f"failed blocks {sorted(failed_in | failed_out)} named for an empty plan: it moves nothing"
                )
            return None
        raise InvalidArgumentError(f"transfer plan {plan.id} is unknown or already completed")
    if not failed_in <= {d for _, d, _ in state.swap_ins}:
        raise InvalidArgumentError(f"failed_swap_ins {sorted(failed_in)} are not swap-in targets of this plan")
    if not failed_out <= {h for _, h, _ in state.swap_outs}:
        raise InvalidArgumentError(f"failed_swap_outs {sorted(failed_out)} are not swap-out targets of this plan")
    return state


def poll_loads(m: Any) -> list[LoadResult]:
    """The body of :meth:`TieredKVCacheManager.poll_loads`."""
    storage = m._storage
    if storage is None:
        return []
    results: list[LoadResult] = []
    held, m._held_results = m._held_results, []
    taken = m._open.id  # plans with a smaller id were handed out
    for request, outcome in held + storage.take_results():
        admission = m._loads.get(request)
        if admission is None:
            continue  # cancelled or timed out: its blocks may belong to someone else now
        if admission.load_plan >= taken:
            m._held_results.append((request, outcome))
            continue
        del m._loads[request]
        results.append(m._loaded(admission, outcome, timed_out=False))
    now = time.monotonic()
    for request, admission in list(m._loads.items()):
        if admission.deadline <= now and admission.load_plan < taken:
            del m._loads[request]
            storage.cancel(request)
            storage.note_timeout(admission.num_loads)
            results.append(m._loaded(admission, LoadOutcome(()), timed_out=True))
    if m._tier_events:
        m._publish_tier_events()
    return results


def loaded(m: Any, admission: _Admission, outcome: LoadOutcome, *, timed_out: bool) -> LoadResult:
    """The body of :meth:`TieredKVCacheManager._loaded`."""
    ok = len(outcome.payloads)
    admission.loads_ok = ok
    payloads = outcome.payloads
    if m._loads_useless(admission):
        payloads = ()  # the run broke before the stored blocks: they are of no use
    start = admission.device + len(admission.host_blocks)
    table = admission.seq.table
    blocks = tuple(table[start : start + len(payloads)])  # type: ignore[index]
    result = LoadResult(admission.seq_id, blocks, payloads, admission.num_loads, timed_out)
    m._finish(admission)
    return result


def finish(m: Any, admission: _Admission) -> None:
    """The body of :meth:`TieredKVCacheManager._finish`."""
    if admission.swaps_ok is None or admission.loads_ok is None:
        return
    if not m._settled(admission):
        return
    s = admission.seq
    del m._admissions[id(s)]
    size = m._block_size
    valid = m._usable_hit(admission)
    device = min(admission.device, valid)
    host_ok = min(len(admission.host_blocks), valid - device)
    m._admitted(
        admission.seq_id,
        CachedTokens(
            device=device * size,
            host=host_ok * size,
            storage=(valid - device - host_ok) * size,
            num_prompt_tokens=s.content.num_tokens,
        ),
        admission.readmission,
    )
    table = s.table
    if table is None:
        raise IntegrityError(f"pending admission of {admission.seq_id!r} lost its table")
    if valid < admission.device + len(admission.host_blocks) + admission.num_loads:
        m._cut_back(s, valid)
    if valid > admission.device:
        KVCacheManager.commit(m, admission.seq_id, valid * size)
        if m._host_write_through or m._storage_write_through:
            m._committed(s, admission.device, valid)


def cut_back(m: Any, s: _Sequence, valid: int) -> None:
    """The body of :meth:`TieredKVCacheManager._cut_back`."""
    table: list[int] = s.table  # type: ignore[assignment]
    dropped = table[valid:]
    del table[valid:]
    m._pool._release_valid(reversed(dropped))  # never committed: back to the fresh queue
    s.num_covered = valid * m._block_size
    s.num_committed = min(s.num_committed, s.num_covered)
    s.lookahead = 0


def check_tiers(m: Any) -> None:
    """The body of :meth:`TieredKVCacheManager._check_tiers`."""
    plans = (m._open, *m._inflight.values())
    host = m._host
    if host is not None:
        host.check_integrity()
        holders = [0] * host.pool.num_blocks
        for plan in plans:
            for host_block, _, _ in plan.swap_ins:
                holders[host_block] += 1
            for _, host_block, _ in plan.swap_outs:
                holders[host_block] += 1
        for b, count in enumerate(holders):
            if host.pool.ref_count(b) != count:
                raise IntegrityError(f"host block {b} has ref count {host.pool.ref_count(b)} but {count} holders")
    elif any(plan.swap_ins or plan.swap_outs for plan in plans):
        raise IntegrityError("a plan moves blocks to or from a host tier that does not exist")
    for admission in m._admissions.values():
        s = admission.seq
        table = s.table
        stop = admission.device + len(admission.host_blocks) + admission.num_loads
        if table is None or len(table) < stop or admission.cancelled:
            raise IntegrityError(f"pending admission of {admission.seq_id!r} lost its blocks")
        if s.num_committed != admission.device * m._block_size:
            raise IntegrityError(f"sequence {admission.seq_id!r} committed past its pending copies")
        hashes = s.content.hashes
        for position in range(admission.device, stop):
            if m._tree.block_of(hashes[position]) == table[position]:
                raise IntegrityError(f"block {table[position]} is matchable before its copy completed")


def cancel_admission(m: Any, s: _Sequence) -> _Plan | None:
    """The body of :meth:`TieredKVCacheManager._cancel_admission`."""
    admission = m._admissions.pop(id(s), None)
    if admission is None:
        return None
    admission.cancelled = True
    if m._loads.pop(admission.load_request, None) is not None:
        m._storage.cancel(admission.load_request)
    size = m._block_size
    m._admitted(
        admission.seq_id,
        CachedTokens(device=admission.device * size, num_prompt_tokens=s.content.num_tokens),
        admission.readmission,
    )
    if admission.swaps_ok is not None:
        return None
    if admission.swap_plan == m._open.id:  # not handed out yet: drop its swap-ins
        plan = m._open
        plan.swap_ins = [entry for entry in plan.swap_ins if entry[2] is not admission]
        m._host.release(admission.host_blocks)
        return None
    in_flight: _Plan = m._inflight[admission.swap_plan]
    return in_flight


def take_transfers(m: Any) -> TransferPlan:
    """The body of :meth:`TieredKVCacheManager.take_transfers`."""
    plan: _Plan = m._open
    m._open = m._new_plan(plan.id + 1)
    busy = plan.busy()
    if busy:
        m._inflight[plan.id] = plan
    if m._tier_events:
        m._publish_tier_events()
    if not busy:  # the common step: nothing to move; every group's (empty) entry, built once
        quiet = m._quiet
        if quiet is None:
            quiet = m._quiet = plan.frozen_groups()
        return TransferPlan(plan.id, quiet)
    return plan.frozen()
