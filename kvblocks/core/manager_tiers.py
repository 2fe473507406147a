"""The manager's calls about its tiers: the step's copies, storage reads, and the admissions they settle.

:class:`TierCalls` is a part of :class:`~kvblocks.core.manager.KVCacheManager` kept in a module of its own:
each call checks its arguments and asks the manager's :class:`~kvblocks.tiers.tiering.Tiering` (see there
for the whole flow). Every manager answers them: without tiers, plans are empty and every sequence is ready.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from types import TracebackType
from typing import Protocol, TypeVar

from kvblocks.accounting import CachedTokens
from kvblocks.core.coordinator import GroupCoordinator
from kvblocks.core.sequence import _Sequence
from kvblocks.errors import IntegrityError, InvalidArgumentError
from kvblocks.tiers.pending import TierStats, _Admission
from kvblocks.tiers.protocol import KeyedTier, SlotTier
from kvblocks.tiers.tiering import Tiering
from kvblocks.tiers.transfers import LoadResult, TransferPlan

__all__ = ["TierCalls"]

_T = TypeVar("_T")
_NO_TRANSFERS = TransferPlan(0, ())
_NO_TIER_STATS = TierStats(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, None, None)


class _Manager(Protocol):
    _tiers: Tiering | None
    _groups: GroupCoordinator
    _block_size: int
    _caching: bool

    def _get(self, seq_id: Hashable) -> _Sequence: ...

    def _admitted(self, seq_id: Hashable, cached: CachedTokens, readmission: bool) -> None: ...

    def _commit(self, s: _Sequence, n: int) -> None: ...


class TierCalls:
    """The tier calls of a manager (see the module docstring)."""

    @property
    def host(self: _Manager) -> SlotTier | None:
        """Group 0's host tier (read it; change it only through the manager); None without one."""
        return self._tiers.host if self._tiers is not None else None

    @property
    def storage(self: _Manager) -> KeyedTier | None:
        """Group 0's storage tier; None without one."""
        return self._tiers.storage if self._tiers is not None else None

    def group_host(self: _Manager, group: int) -> SlotTier | None:
        """Group ``group``'s host tier (0: :attr:`host`); read it, change it only through the manager."""
        number = self._groups.number(group)
        return self._tiers.stacks[number].host if self._tiers is not None else None

    def group_storage(self: _Manager, group: int) -> KeyedTier | None:
        """Group ``group``'s storage tier (0: :attr:`storage`); a local group's has keys and a format of its own."""
        number = self._groups.number(group)
        return self._tiers.stacks[number].storage if self._tiers is not None else None

    def is_ready(self: _Manager, seq_id: Hashable) -> bool:
        """Whether the sequence has no copies pending (it may run and commit)."""
        s = self._get(seq_id)
        return self._tiers is None or id(s) not in self._tiers.admissions

    @property
    def num_pending_admissions(self: _Manager) -> int:
        return len(self._tiers.admissions) if self._tiers is not None else 0

    @property
    def num_pending_loads(self: _Manager) -> int:
        """Storage reads of every group not yet reported by :meth:`poll_loads`."""
        return len(self._tiers.loads) if self._tiers is not None else 0

    def is_storage_check_pending(self: _Manager, seq_id: Hashable) -> bool:
        """Whether a storage check :meth:`add_sequence` queued for ``seq_id``, in any group, is unanswered. Pure.

        A sequence registered and admitted in the same step sees no storage hits from that check
        (``lookup`` never waits on I/O). An engine that prefers storage hits to recomputing can leave such a
        sequence waiting a step or two while this is True; a dropped probe (a full queue) or a check already
        answered is False.
        """
        self._get(seq_id)
        return self._tiers is not None and self._tiers.is_storage_check_pending(seq_id)

    def take_transfers(self: _Manager) -> TransferPlan:
        """The copies this step's scheduling calls planned, one :class:`GroupTransfers` per group; run them in
        order, then :meth:`complete_transfers`. Empty without tiers."""
        return self._tiers.take_transfers() if self._tiers is not None else _NO_TRANSFERS

    def complete_transfers(
        self: _Manager,
        plan: TransferPlan,
        *,
        saved: Mapping[int, Sequence[object]] | Sequence[object] | None = None,
        failed_swap_ins: Mapping[int, Collection[int]] | Collection[int] = (),
        failed_swap_outs: Mapping[int, Collection[int]] | Collection[int] = (),
        saved_groups: Mapping[int, Sequence[object]] | None = None,
        failed_group_swap_ins: Mapping[int, Collection[int]] | None = None,
        failed_group_swap_outs: Mapping[int, Collection[int]] | None = None,
    ) -> None:
        """Report that ``plan`` ran. Each argument maps a group to its figures (``{0: ...}`` for one group).

        ``saved[g]`` holds the payload of each of ``plan.group_transfers[g].saves`` (one bytes-like per block,
        or one per rank): they are queued for storage; without it the saves are dropped and counted.
        ``failed_swap_ins[g]`` / ``failed_swap_outs[g]`` name group ``g``'s device / host blocks whose copy
        failed: a failed swap-in leaves its host block a host hit, and the admission's hit is cut back to the
        longest one every group still serves with what landed (the engine computes the rest); a failed
        swap-out host block becomes free. Every argument is checked before anything changes.

        The previous release's forms are still taken: group 0's figures bare (not in a mapping), and the
        other groups' in ``saved_groups``, ``failed_group_swap_ins``, ``failed_group_swap_outs``.
        """
        tiers = self._tiers
        previous = (saved_groups, failed_group_swap_ins, failed_group_swap_outs)
        if tiers is None:
            if not isinstance(plan, TransferPlan):
                raise InvalidArgumentError(f"expected a TransferPlan, got {type(plan).__name__}")
            if plan or any(previous) or saved or failed_swap_ins or failed_swap_outs:
                raise InvalidArgumentError("this manager has no tiers: its plans move nothing")
            return
        for admission in tiers.complete_transfers(plan, saved, failed_swap_ins, failed_swap_outs, previous):
            if admission.settled:
                _settle(self, tiers, admission)

    def poll_loads(self: _Manager) -> list[LoadResult]:
        """Storage reads of every group that finished (or timed out) since the last poll. Never waits.

        Group 0's results first, then each local group's (``group`` set; its ``blocks`` are that group's
        device blocks). A read is reported only once the plan of the step that admitted its sequence was
        taken, so a block evicted in that step is saved before a load overwrites it. An admission settles
        once every group's reads and copies are reported.
        """
        tiers = self._tiers
        if tiers is None:
            return []
        results = []
        for number, admission, outcome, timed_out in tiers.poll_loads():
            pending = admission.groups[number]
            if pending is None:  # pragma: no cover - a read belongs to a group with loads
                raise IntegrityError(f"group {number}: a storage read of {admission.seq_id!r} it did not plan")
            loads = pending.copies.loads
            payloads = outcome.payloads[: len(loads)]
            pending.loaded = {p for _, p in loads[: len(payloads)]}
            pending.request = -1
            if number == 0 and tiers.usable_hit(admission, self._block_size, hopeful=True) <= loads[0][1]:
                payloads = ()  # the hit broke before the stored blocks: they are of no use
            blocks = tuple(d for d, _ in loads[: len(payloads)])
            results.append(LoadResult(admission.seq_id, blocks, payloads, len(loads), timed_out, group=number))
            if admission.settled:
                _settle(self, tiers, admission)
        return results

    def flush(self: _Manager, timeout: float | None = None) -> bool:
        """Wait until every group's queued storage writes are done (shutdown, tests). True if they are."""
        return self._tiers.flush(timeout) if self._tiers is not None else True

    def close(self: _Manager, timeout: float | None = 5.0) -> None:
        """Stop every group's storage threads (queued writes get ``timeout`` seconds each) and close the backend."""
        if self._tiers is not None:
            self._tiers.close(timeout)

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(
        self: _Manager, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Leaving the ``with`` block closes the manager (its storage threads stop), also on an exception."""
        if self._tiers is not None:
            self._tiers.close(5.0)

    @property
    def tier_stats(self: _Manager) -> TierStats:
        """The tiers' counters (all zero without tiers)."""
        return self._tiers.stats() if self._tiers is not None else _NO_TIER_STATS


def _settle(m: _Manager, tiers: Tiering, admission: _Admission) -> None:
    """Every copy of ``admission`` was reported: its hits count, the usable leading run becomes committed and
    findable, the rest of every table (never committed) goes back, and the engine computes those tokens."""
    s = admission.seq
    del tiers.admissions[id(s)]
    size = m._block_size
    valid = tiers.usable_hit(admission, size)
    device = min(admission.device, valid)
    first = admission.groups[0]
    host_ok = min(len(first.copies.swaps) if first is not None else 0, valid - device)
    stored = valid - device - host_ok
    cached = CachedTokens(device * size, host_ok * size, stored * size, num_prompt_tokens=s.content.num_tokens)
    m._admitted(admission.seq_id, cached, admission.readmission)
    if s.table is None:
        raise IntegrityError(f"pending admission of {admission.seq_id!r} lost its table")
    groups = m._groups
    if valid < admission.hit:  # every table keeps what the shorter hit needs; the sequence allocates the rest
        groups.full.cut_back(s, valid)
        s.num_covered = valid * size
        s.num_committed = min(s.num_committed, s.num_covered)
        s.lookahead = 0
        for local in groups.locals:
            local.cut_back(id(s), valid, size)
    if valid > admission.device:
        m._commit(s, valid * size)
    if m._caching:
        for local in groups.locals:
            local.index_landed(id(s), s.content.hashes, s.num_committed)
