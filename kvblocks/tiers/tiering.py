"""The tiers of a manager: a :class:`~kvblocks.tiers.stack.TierStack` per attention group, the step plans,
and the admissions whose copies are pending.

``lookup`` reports three stacked runs; ``allocate`` gives every cached block a device block at once,
and the copies that fill them are pending until they complete::

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

A hybrid model's local groups (sliding window, chunked local) each have a stack too: an admission
copies in every block its window needs that is not on device, in every group or none, and a failed
copy in any group cuts the hit back to the longest one every group still serves with what landed.

The scheduler's calls do no I/O: storage hits come from an index of known-stored hashes, reads and
writes are queued to threads, and the tensors are moved by whoever executes the plans (the engine,
or :class:`~kvblocks.tiers.TransferExecutor` when the caches are ours). Per step, an engine does:
scheduling calls (allocate / free / preempt), then ``take_transfers()`` and runs the plan, then
``complete_transfers(plan)``, then applies ``poll_loads()``, then the forward pass and ``commit``.

Events: with an event sink, every group's host and storage tiers emit ``tier="host"`` / ``"storage"``
events tagged as that group's device index tags its own. Host events are emitted by the call that
changed the tier; storage events, which the I/O threads note, at the next ``take_transfers``,
``complete_transfers`` or ``poll_loads`` -- always on the caller's thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from kvblocks.config import CacheConfig
from kvblocks.core.coordinator import GroupCoordinator
from kvblocks.core.groups.hits import longest_common_hit, needed_blocks
from kvblocks.core.groups.local_group import LocalGroupManager
from kvblocks.core.groups.protocol import GroupCopies
from kvblocks.core.pool import BlockPool
from kvblocks.core.sequence import _Sequence
from kvblocks.errors import ConfigError, IntegrityError, InvalidArgumentError
from kvblocks.event_codec import BlockStored
from kvblocks.events import EventSink
from kvblocks.hashing import BlockHash
from kvblocks.tiers.config import TierConfig
from kvblocks.tiers.pending import TierStats, _Admission, _Counts, _Pending, _Plan
from kvblocks.tiers.protocol import KeyedTier, SlotTier, Tier
from kvblocks.tiers.stack import tier_stacks
from kvblocks.tiers.storage_stats import LoadOutcome
from kvblocks.tiers.storage_tier import StorageTier
from kvblocks.tiers.transfers import GroupTransfers, TransferPlan, per_group

__all__ = ["Tiering"]


class Tiering:
    """Every attention group's :class:`TierStack`, the open and in-flight plans, and the pending admissions.

    Group 0 is full attention (``block_size`` tokens a block, its tree's events tagged ``tag``); groups
    1, 2, ... are ``locals``, each given its stack (``local.tiers``). The manager asks it for hits beyond
    the device and hands it the copies of each admission; it hands back the admissions whose copies
    have all been reported, for the manager to settle.
    """

    def __init__(
        self,
        tiers: TierConfig,
        config: CacheConfig,
        pool: BlockPool,
        locals_: Sequence[LocalGroupManager],
        *,
        events: EventSink | None,
        tag: tuple[int | None, str | None],
    ) -> None:
        self.config = tiers
        self.counts = _Counts()
        self.save_on_preempt = tiers.save_on_preempt
        self.stacks = tier_stacks(tiers, config, locals_, self.counts, events=events, tag=tag)
        self.locals = list(locals_)
        self.pools = [pool, *(local.pool for local in locals_)]  # each group's device pool
        self.events = events is not None
        self.open = self._new_plan(0)
        self.inflight: dict[int, _Plan] = {}
        self.quiet: tuple[GroupTransfers, ...] | None = None  # the group entries of a plan that moves nothing
        self.admissions: dict[int, _Admission] = {}  # id(_Sequence) -> its pending admission
        self.loads: dict[tuple[int, int], _Admission] = {}  # (group, storage request) -> admission
        self.held_results: list[tuple[int, int, LoadOutcome]] = []
        self.probes: dict[Hashable, list[tuple[int, int]]] = {}  # sequence -> (group, storage check) unanswered
        self.hold_for: _Sequence | None = None  # a sequence preempted with saves: its blocks wait for the plan

    @classmethod
    def under(
        cls,
        groups: GroupCoordinator,
        tiers: TierConfig,
        config: CacheConfig,
        *,
        events: EventSink | None,
        tag: tuple[int | None, str | None],
    ) -> Tiering | None:
        """The tiers under a manager's ``groups``, each attention group given its stack; None when they hold
        nothing (no host, no storage in any group: there is nothing below the device)."""
        if groups.recurrents or groups.crosses:
            raise ConfigError("tiers serve attention groups: recurrent and cross-attention groups have none")
        for local in groups.locals:
            local.require_block_per_position("a tiered manager")
        tiering = cls(tiers, config, groups.full.pool, groups.locals, events=events, tag=tag)
        if not any(stack.tiers for stack in tiering.stacks):
            return None
        groups.full.tiers = tiering.stacks[0]
        host = tiering.stacks[0].host
        if host is not None and host.events is not None:  # its events chain written-back blocks, with tokens
            groups.full.tree.keep_token_ids()
        for local, stack in zip(groups.locals, tiering.stacks[1:], strict=True):
            local.tiers = stack
        return tiering

    def _new_plan(self, plan_id: int) -> _Plan:
        plan = _Plan(plan_id, len(self.stacks))
        for stack, part in zip(self.stacks, plan.groups, strict=True):
            stack.plan = part
        return plan

    # ------------------------------------------------------------------ queries

    @property
    def host(self) -> SlotTier | None:
        return self.stacks[0].host

    @property
    def storage(self) -> KeyedTier | None:
        return self.stacks[0].storage

    def probe(self, seq_id: Hashable, hashes: Sequence[BlockHash], start: int, limit: int) -> None:
        """Ask each group's storage (off-thread) which blocks of a new sequence it holds: group 0 those from
        ``start`` (its device hit) to ``limit``, a local group those it holds neither on device nor on host."""
        if start < limit:
            self._probe(seq_id, 0, hashes[start:limit])
        for local in self.locals:
            stack = self.stacks[local.number]
            if stack.storage is None:
                continue
            keys = local.keys(hashes)
            host = stack.host
            unknown = [
                key
                for key in (keys[p] for p in range(limit // local.ratio))
                if local.index.block_of(key) is None and (host is None or key not in host)
            ]
            self._probe(seq_id, local.number, unknown)

    def _probe(self, seq_id: Hashable, group: int, keys: Sequence[BlockHash]) -> None:
        storage = self.stacks[group].storage
        request = storage.probe(keys) if storage is not None and keys else None
        if request is not None:
            self.probes.setdefault(seq_id, []).append((group, request))

    def is_storage_check_pending(self, seq_id: Hashable) -> bool:
        """Whether a storage check queued for ``seq_id``, in any group, is still unanswered."""
        probes = self.probes.get(seq_id)
        if not probes:
            return False
        stacks = self.stacks
        left = [(g, r) for g, r in probes if not stacks[g].storage_tier().is_answered(r)]
        if left:
            self.probes[seq_id] = left
            return True
        del self.probes[seq_id]
        return False

    # ------------------------------------------------------------------ admissions

    def pend(
        self, seq_id: Hashable, s: _Sequence, hit: int, device: int, copies: Sequence[GroupCopies | None]
    ) -> _Admission:
        """Record an admission whose ``copies`` (one entry per group) are pending, and plan them."""
        admission = _Admission(seq_id, s, hit, device, copies)
        plan = self.open
        hashes = s.content.hashes
        for number, group in enumerate(copies):
            if group is None:
                continue
            if group.swaps:
                admission.swap_plan = plan.id
                plan.groups[number].swap_ins.extend((h, d, admission, p) for h, d, p in group.swaps)
            if group.loads:
                self._start_load(admission, number, hashes)
        self.admissions[id(s)] = admission
        return admission

    def _start_load(self, admission: _Admission, number: int, hashes: Sequence[BlockHash]) -> None:
        """Queue group ``number``'s storage read of an admission's blocks (reported by :meth:`poll_loads`)."""
        storage = self.stacks[number].storage_tier()
        keys = hashes if number == 0 else self.locals[number - 1].keys(hashes)
        pending = admission.part(number)
        request = storage.load([keys[p] for _, p in pending.copies.loads])
        pending.request = request
        admission.load_plan = self.open.id  # held until this step's plan was taken (its saves read first)
        admission.deadline = max(admission.deadline, time.monotonic() + storage.timeout_s)
        self.loads[number, request] = admission

    def leave(self, s: _Sequence) -> tuple[_Admission | None, list[list[list[int]] | None]]:
        """A sequence leaves: forget its pending admission (its loads are skipped or dropped). Returns that
        admission, and per group where its release order waits (None: released now): the in-flight plan whose
        copies still write into its blocks, or (group 0) the open plan that saves them before a preemption."""
        admission, copying = self._cancel(s)
        groups: list[list[list[int]] | None] = [None] * len(self.stacks)
        if copying is not None:
            groups = [part.deferred for part in copying.groups]
        elif self.hold_for is s:
            groups[0] = self.open.groups[0].deferred
        return admission, groups

    def _cancel(self, s: _Sequence) -> tuple[_Admission | None, _Plan | None]:
        """Forget the pending admission of ``s``; the in-flight plan whose copies still write into its blocks."""
        admission = self.admissions.pop(id(s), None)
        if admission is None:
            return None, None
        admission.cancelled = True
        for number, pending in enumerate(admission.groups):
            if pending is not None and self.loads.pop((number, pending.request), None) is not None:
                self.stacks[number].storage_tier().cancel(pending.request)
        if admission.swaps_reported:
            return admission, None
        if admission.swap_plan != self.open.id:
            return admission, self.inflight[admission.swap_plan]
        for number, (pending, part) in enumerate(zip(admission.groups, self.open.groups, strict=True)):
            if pending is not None and pending.copies.swaps:  # not handed out yet: drop the swap-ins
                part.swap_ins = [entry for entry in part.swap_ins if entry[2] is not admission]
                self.stacks[number].host_tier().release(h for h, _, _ in pending.copies.swaps)
        return admission, None

    def usable_hit(self, admission: _Admission, block_size: int, *, hopeful: bool = False) -> int:
        """The leading chain blocks of a pending admission every group serves with the copies that landed
        (``hopeful``: counting a read not yet reported as landed, and a swap-in not yet reported as failed)."""
        groups = admission.groups
        run = admission.hit
        first = groups[0]
        if first is not None:  # full attention serves a leading run
            landed = _landed(first, hopeful)
            run = admission.device
            while run < admission.hit and run in landed:
                run += 1
        if not self.locals:
            return run
        answers = []
        whole = run == admission.hit  # every group got every block the hit needs: the hit stands
        for local, pending in zip(self.locals, groups[1:], strict=True):
            held = set(needed_blocks(local.rule, admission.hit * block_size))  # what the group holds for the hit ...
            if pending is not None:  # ... but the blocks its copies fill only once they landed
                copies = pending.copies
                moved = {p for _, _, p in copies.swaps} | {p for _, p in copies.loads}
                landed = _landed(pending, hopeful)
                whole = whole and moved <= landed
                held = (held - moved) | landed
            answers.append(held.__contains__)
        if whole:
            return run
        return longest_common_hit([local.rule for local in self.locals], run * block_size, answers) // block_size

    # ------------------------------------------------------------------ plans

    def take_transfers(self) -> TransferPlan:
        """The copies this step's scheduling calls planned (see the module docstring)."""
        plan = self.open
        if self.events:
            self.publish()
        if not plan.busy():  # the common step: nothing to move; the open plan stays, under the next id
            plan.id += 1
            quiet = self.quiet
            if quiet is None:
                quiet = self.quiet = plan.frozen_groups()
            return TransferPlan(plan.id - 1, quiet)
        self.open = self._new_plan(plan.id + 1)
        self.inflight[plan.id] = plan
        return plan.frozen()

    def complete_transfers(
        self,
        plan: TransferPlan,
        saved: object,
        failed_swap_ins: object,
        failed_swap_outs: object,
        previous: tuple[object, object, object] = (None, None, None),
    ) -> list[_Admission]:
        """Report that ``plan`` ran (see :meth:`KVCacheManager.complete_transfers`); returns the admissions whose
        swap-ins it reported, for the caller to settle. Every argument is checked before anything changes."""
        if (
            type(plan) is TransferPlan  # the common step: a plan that moved nothing, nothing said about it
            and plan.id not in self.inflight
            and not plan
            and not (saved or failed_swap_ins or failed_swap_outs or any(previous))
        ):
            return []
        groups = len(self.stacks)
        saved_by = _by_group(saved, previous[0], "saved", groups, None)
        failed_in = _by_group(failed_swap_ins, previous[1], "failed_swap_ins", groups, ())
        failed_out = _by_group(failed_swap_outs, previous[2], "failed_swap_outs", groups, ())
        if not isinstance(plan, TransferPlan):
            raise InvalidArgumentError(f"expected a TransferPlan, got {type(plan).__name__}")
        state = self.inflight.get(plan.id)
        if state is None:
            if not plan:
                named = sorted({b for blocks in (*failed_in, *failed_out) for b in blocks})
                if named:
                    raise InvalidArgumentError(f"failed blocks {named} named for an empty plan: it moves nothing")
                return []
            raise InvalidArgumentError(f"transfer plan {plan.id} is unknown or already completed")
        failed_in_sets = [set(blocks) for blocks in failed_in]
        failed_out_sets = [set(blocks) for blocks in failed_out]
        for number, part in enumerate(state.groups):
            label = "" if number == 0 else f"[{number}]"
            failed = failed_in_sets[number]
            if failed and not failed <= {d for _, d, _, _ in part.swap_ins}:
                raise InvalidArgumentError(
                    f"failed_swap_ins{label} {sorted(failed)} are not swap-in targets of this plan"
                )
            failed = failed_out_sets[number]
            if failed and not failed <= {h for _, h, _ in part.swap_outs}:
                raise InvalidArgumentError(
                    f"failed_swap_outs{label} {sorted(failed)} are not swap-out targets of this plan"
                )
            given = saved_by[number]
            if given is not None and part.saves:
                if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
                    raise InvalidArgumentError(f"saved{label} must be a sequence of payloads, one per save")
                self.stacks[number].storage_tier().check_payloads([save.block_hash for save in part.saves], given)
        del self.inflight[plan.id]
        counts = self.counts
        for number, part in enumerate(state.groups):
            given = saved_by[number]
            if part.saves:
                if given is None:
                    counts.saves_without_payload += len(part.saves)
                else:
                    self.stacks[number].storage_tier().save([save.block_hash for save in part.saves], given)
        reported: dict[int, _Admission] = {}
        for number, part in enumerate(state.groups):
            if not (part.swap_outs or part.swap_ins):
                continue
            host = self.stacks[number].host_tier()
            failed = failed_out_sets[number]
            for _, host_block, block_hash in part.swap_outs:
                ok = host_block not in failed
                host.complete(block_hash, host_block, ok)
                counts.swap_outs += ok
                counts.swap_out_failures += not ok
            if not part.swap_ins:
                continue
            host.release([h for h, _, _, _ in part.swap_ins])
            failed = failed_in_sets[number]
            for _, device_block, admission, position in part.swap_ins:
                pending = admission.part(number)
                if pending.swapped is None:
                    pending.swapped = set()
                    reported.setdefault(id(admission), admission)
                if device_block in failed:
                    counts.swap_in_failures += 1
                else:
                    pending.swapped.add(position)
                    counts.swap_ins += 1
        for part, pool in zip(state.groups, self.pools, strict=True):
            for order in part.deferred:
                pool._release_valid(order)
        if self.events:
            self.publish()
        return [a for a in reported.values() if not a.cancelled and self.admissions.get(id(a.seq)) is a]

    def poll_loads(self) -> list[tuple[int, _Admission, LoadOutcome, bool]]:
        """Storage reads of every group that finished (or timed out) since the last poll, as (group,
        admission, outcome, timed out). Never waits. A read is reported only once the plan of the step that
        admitted its sequence was taken, so a block evicted in that step is saved before a load overwrites it."""
        results: list[tuple[int, _Admission, LoadOutcome, bool]] = []
        taken = self.open.id  # plans with a smaller id were handed out
        held, self.held_results = self.held_results, []
        finished = [
            (number, request, outcome)
            for number, stack in enumerate(self.stacks)
            if stack.storage is not None
            for request, outcome in stack.storage.take_results()
        ]
        for number, request, outcome in held + finished:
            admission = self.loads.get((number, request))
            if admission is None:
                continue  # cancelled or timed out: its blocks may belong to someone else now
            if admission.load_plan >= taken:
                self.held_results.append((number, request, outcome))
                continue
            del self.loads[number, request]
            results.append((number, admission, outcome, False))
        now = time.monotonic()
        for (number, request), admission in list(self.loads.items()):
            if admission.deadline <= now and admission.load_plan < taken:
                del self.loads[number, request]
                storage = self.stacks[number].storage_tier()
                storage.cancel(request)
                storage.note_timeout(len(admission.part(number).copies.loads))
                results.append((number, admission, LoadOutcome(()), True))
        if self.events:
            self.publish()
        return results

    # ------------------------------------------------------------------ events and maintenance

    def publish(self) -> None:
        """Emit what every group's host and storage tiers noted (with a sink only, on the manager's thread)."""
        for stack in self.stacks:
            stack.publish()

    def snapshot_events(self) -> list[BlockStored]:
        events: list[BlockStored] = []
        for stack in self.stacks:
            events += stack.snapshot_events()
        return events

    @property
    def busy(self) -> bool:
        """Whether copies are pending or in flight (a reset must wait)."""
        return bool(self.inflight or self.admissions or any(part.swap_outs for part in self.open.groups))

    def clear_hosts(self) -> None:
        for stack in self.stacks:
            if stack.host is not None:
                stack.host.clear()

    def flush(self, timeout: float | None) -> bool:
        """Wait until every tier's queued writes are done. True if they are."""
        deadline = None if timeout is None else time.monotonic() + timeout
        done = True
        for tier in self._tiers_closing_order():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done = tier.flush(left) and done
        return done

    def close(self, timeout: float | None) -> None:
        """Stop every tier's threads, group 0's last (its storage tier closes the shared backend)."""
        for tier in self._tiers_closing_order():
            tier.close(timeout)

    def _tiers_closing_order(self) -> list[Tier]:
        return [tier for stack in (*self.stacks[1:], self.stacks[0]) for tier in stack.tiers]

    def stats(self) -> TierStats:
        host = self.host
        storage = self.storage if isinstance(self.storage, StorageTier) else None  # another keyed kind: no figures
        return TierStats(
            host_blocks=host.pool.num_blocks if host is not None else 0,
            host_blocks_cached=len(host) if host is not None else 0,
            host_evicted=host.num_evicted if host is not None else 0,
            storage=storage.stats.snapshot() if storage is not None else None,
            writer=storage.writer.stats.snapshot() if storage is not None else None,
            **asdict(self.counts),
        )

    def deferred(self, number: int) -> list[list[int]]:
        """Group ``number``'s release orders the open and in-flight plans hold back (copies still use the blocks)."""
        return [order for plan in (self.open, *self.inflight.values()) for order in plan.groups[number].deferred]

    def save_before_preempt(self, s: _Sequence, block_size: int) -> None:
        """Queue group 0's committed blocks of ``s`` for storage; if any is, their release waits for the open plan
        (:attr:`hold_for`)."""
        stack = self.stacks[0]
        pins = s.pins or {}
        table = s.blocks()
        hashes = s.content.hashes
        saving = False
        for position in range(s.num_committed // block_size):
            saving |= stack.plan_save("device", pins.get(position, table[position]), hashes[position])
        if saving:
            self.hold_for = s

    def check(self, block_size: int, device_of: Callable[[int, BlockHash], int | None]) -> None:
        """The host tiers, the plans and the pending admissions agree. ``device_of(number, key)``: the block
        group ``number``'s device index holds ``key`` in (None: none)."""
        plans = (self.open, *self.inflight.values())
        for number, stack in enumerate(self.stacks):
            host = stack.host
            holders = [0] * (host.pool.num_blocks if host is not None else 0)
            for plan in plans:
                part = plan.groups[number]
                if host is None and (part.swap_ins or part.swap_outs):
                    raise IntegrityError(
                        f"a plan moves group {number}'s blocks to or from a host tier it does not have"
                    )
                for host_block, *_ in part.swap_ins:
                    holders[host_block] += 1
                for _, host_block, _ in part.swap_outs:
                    holders[host_block] += 1
            if host is None:
                continue
            host.check_integrity()
            for b, count in enumerate(holders):
                if host.pool.ref_count(b) != count:
                    raise IntegrityError(
                        f"group {number}: host block {b} has {host.pool.ref_count(b)} refs, {count} holders"
                    )
        for (number, request), admission in self.loads.items():
            pending = admission.groups[number]
            if self.admissions.get(id(admission.seq)) is not admission or pending is None or pending.request != request:
                raise IntegrityError(f"group {number}: storage read {request} belongs to no pending admission")
        for admission in self.admissions.values():
            self._check_admission(admission, block_size, device_of)

    def _check_admission(
        self, admission: _Admission, block_size: int, device_of: Callable[[int, BlockHash], int | None]
    ) -> None:
        s = admission.seq
        table = s.table
        if table is None or admission.cancelled:
            raise IntegrityError(f"pending admission of {admission.seq_id!r} lost its blocks")
        if s.num_committed != admission.device * block_size:
            raise IntegrityError(f"sequence {admission.seq_id!r} committed past its pending copies")
        hashes = s.content.hashes
        for number, pending in enumerate(admission.groups):
            if pending is None:
                continue
            if pending.request >= 0 and self.loads.get((number, pending.request)) is not admission:
                raise IntegrityError(f"group {number}: {admission.seq_id!r}'s storage read is not tracked")
            own = table if number == 0 else self.locals[number - 1].tables.get(id(s), [])
            keys = hashes if number == 0 else self.locals[number - 1].keys(hashes)
            landing = [(d, p) for _, d, p in pending.copies.swaps] if pending.swapped is None else []
            landing += pending.copies.loads if pending.loaded is None else []
            for device_block, position in landing:
                if position >= len(own) or own[position] != device_block:
                    raise IntegrityError(f"group {number}: {admission.seq_id!r} lost the block a copy fills")
                if device_of(number, keys[position]) == device_block:
                    raise IntegrityError(f"group {number}: block {device_block} is findable before its copy landed")


def _by_group(value: object, previous: object, what: str, groups: int, default: object) -> list[Any]:
    """One figure per group from a ``complete_transfers`` argument (``{group: figure}``, or group 0's bare)
    and the previous release's separate keyword for the groups after 0. Changes nothing."""
    if not value and not previous:  # the common call: nothing said for any group
        return [default] * groups
    first, others = per_group(value, what, groups, default)
    if previous:
        if others:
            raise InvalidArgumentError(f"give the groups' {what} in one mapping, not also in the previous keyword")
        if not isinstance(previous, Mapping):
            raise InvalidArgumentError(f"{what} of the groups after 0 must map a local group's index to figures")
        for group, entry in previous.items():
            if isinstance(group, bool) or not isinstance(group, int) or not 1 <= group < groups:
                raise InvalidArgumentError(f"{what}: {group!r} is not a local group's index")
            others[group] = entry
    out = [default] * groups
    out[0] = first if first is not None else default
    for group, entry in others.items():
        out[group] = entry
    return out


def _landed(pending: _Pending, hopeful: bool) -> set[int]:
    """The positions of one group's copies that landed (``hopeful``: those not reported yet count as landed)."""
    copies = pending.copies
    landed: set[int] = set()
    if pending.swapped is not None:
        landed |= pending.swapped
    elif hopeful:
        landed.update(p for _, _, p in copies.swaps)
    if pending.loaded is not None:
        landed |= pending.loaded
    elif hopeful:
        landed.update(p for _, p in copies.loads)
    return landed
