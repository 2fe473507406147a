"""Recurrent layer groups (Mamba, linear attention): a running state slot per sequence, and cached checkpoints.

A recurrent layer keeps one fixed-size state per sequence instead of blocks. A prefix hit at token ``h``
needs the state *after* tokens ``[0, h)``: a checkpoint taken exactly there. One group's states live in
one :class:`~kvblocks.backends.group_caches.StatePool` of ``num_slots + num_checkpoints`` states::

    state ids     0 .. num_slots-1           running slots: one per admitted sequence, updated in place
                  num_slots .. +checkpoints  checkpoints: a slot's state copied out at a block boundary,
                                             cached under the hash of the block that ends there

The manager never touches tensors. It plans :class:`StateCopy` operations -- zero a new slot, save a
slot into a checkpoint, restore a checkpoint into a slot -- and the engine runs them, in order, before
its next forward pass (:meth:`~kvblocks.core.manager.KVCacheManager.take_state_plan`)::

    step t    commits (forward t-1 done)  -> saves planned      admissions -> zero / restore planned
              take_state_plan() -> plan t; the engine runs it;  forward pass t
    step t+1  take_state_plan(): plan t has run, so its checkpoints become findable now

That is the commit rule for states: a checkpoint is findable only once the plan that writes it has run,
so no hit can ever restore a state not yet written -- not even one planned in the same step. Until then
the checkpoint, and the source of every planned restore, is held (no eviction can reuse it).

A checkpoint is planned when a commit lands exactly on a checkpoint boundary (a multiple of
``checkpoint_every`` blocks): the running state is at that token then, and only then. An engine that
wants its prompts' states cached ends a prefill chunk on such a boundary
(:meth:`~kvblocks.core.manager.KVCacheManager.next_checkpoint` says where).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvblocks.core.groups.block_index import FlatBlockIndex
from kvblocks.core.groups.hits import GroupHitRule
from kvblocks.core.groups.protocol import Ask, GroupCopies
from kvblocks.core.pool import BlockPool
from kvblocks.errors import ConfigError, IntegrityError
from kvblocks.events import EventSink
from kvblocks.hashing import BlockHash

__all__ = ["RecurrentGroup", "StateCopy"]


@dataclass(frozen=True)
class RecurrentGroup:
    """One recurrent layer group: running slots (the most sequences it can run), checkpoints, their spacing.

    ``checkpoint_every`` is in blocks of the manager's block size: a checkpoint is taken at token
    multiples of ``checkpoint_every * block_size``, and only there can a hit end.
    """

    num_slots: int
    num_checkpoints: int
    checkpoint_every: int = 1

    def __post_init__(self) -> None:
        for what in ("num_slots", "num_checkpoints", "checkpoint_every"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"a recurrent group's {what} must be a positive int, got {value!r}")

    @property
    def num_states(self) -> int:
        """States the group's :class:`~kvblocks.backends.group_caches.StatePool` needs: slots, then checkpoints."""
        return self.num_slots + self.num_checkpoints


@dataclass(frozen=True, slots=True)
class StateCopy:
    """One state operation of a plan: copy state ``src`` into ``dst`` of ``group``, or zero ``dst`` (src None).

    Ids index the group's state pool (slots first, then checkpoints). Run a plan's operations in order.
    """

    group: int
    src: int | None
    dst: int


class _Recurrent:
    """A recurrent group's state: free slots, each admitted sequence's slot, the checkpoints and the plan.

    The checkpoints are blocks of their own :class:`BlockPool` (ids ``0..num_checkpoints-1``; state id
    ``num_slots + id``), cached in a :class:`FlatBlockIndex` (any idle checkpoint is evictable). A
    checkpoint being saved and a restore's source are held by the plan until the plan is known to have run.
    """

    __slots__ = (
        "block_size",
        "free_slots",
        "held",
        "held_inflight",
        "index",
        "inflight",
        "num_slots",
        "number",
        "ops",
        "pending",
        "pool",
        "rule",
        "skipped",
        "slots",
        "step",
    )

    def __init__(self, group: RecurrentGroup, number: int, block_size: int, events: EventSink | None) -> None:
        self.number = number  # the group's index in the manager
        self.rule = GroupHitRule("recurrent")
        self.block_size = block_size
        self.step = group.checkpoint_every * block_size  # tokens between checkpoints
        self.num_slots = group.num_slots
        self.free_slots = list(range(group.num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.slots: dict[int, int] = {}  # id(_Sequence) -> its running slot
        self.pool = BlockPool(group.num_checkpoints)
        self.index = FlatBlockIndex(self.pool, events=events, group=number, group_kind="recurrent")
        self.ops: list[StateCopy] = []  # the plan being built
        self.pending: dict[BlockHash, tuple[int, BlockHash | None]] = {}  # saves in `ops`: hash -> checkpoint, parent
        self.held: list[int] = []  # restore sources in `ops`
        self.inflight: dict[BlockHash, tuple[int, BlockHash | None]] = {}  # saves of the plan handed out last
        self.held_inflight: list[int] = []  # restore sources of the plan handed out last
        self.skipped = 0  # checkpoints not taken because every checkpoint was held

    def state_id(self, checkpoint: int) -> int:
        return self.num_slots + checkpoint

    # ------------------------------------------------------------------ hits

    def checkpoint_at(self, hashes: Sequence[BlockHash], hit: int) -> int | None:
        """The findable checkpoint holding the state after ``hit`` tokens (> 0), or None. Pure."""
        if hit <= 0 or hit % self.step:
            return None
        position = hit // self.block_size - 1
        return self.index._block_of.get(hashes[position]) if position < len(hashes) else None

    # ------------------------------------------------------------------ sequences

    def can_admit(self, hashes: Sequence[BlockHash], hit: int) -> bool | None:
        """None when a hit of ``hit`` tokens has no checkpoint; else whether a slot is free. Pure."""
        if hit and self.checkpoint_at(hashes, hit) is None:
            return None
        return bool(self.free_slots)

    def admit(self, key: int, hashes: Sequence[BlockHash], hit: int) -> None:
        """Give a sequence a slot holding the state at ``hit``: restored from its checkpoint, or zeroed."""
        slot = self.receive(key)
        if hit:
            checkpoint: int = self.checkpoint_at(hashes, hit)  # type: ignore[assignment]
            self.pool._acquire_valid((checkpoint,))
            self.held.append(checkpoint)
            self.ops.append(StateCopy(self.number, self.state_id(checkpoint), slot))
        else:
            self.ops.append(StateCopy(self.number, None, slot))  # stale bytes of another state look like NaN

    def admission(self, ask: Ask, remote: Sequence[int] | None) -> tuple[int, Any] | None:
        """The group's part of an admission (see :class:`~kvblocks.core.groups.protocol.GroupManager`): None
        when the hit has no checkpoint; else one "block" short when no slot is free (preempting one sequence
        helps). A handoff (``remote``: the prefill node's state id) needs a free slot only."""
        if remote is not None:
            return (0 if self.free_slots else 1), remote
        ready = self.can_admit(ask.hashes, ask.hit_tokens)
        if ready is None:
            return None
        return (0 if ready else 1), None

    def take_admission(self, key: int, ask: Ask, prepared: Any) -> GroupCopies | None:
        """A slot holding the state at the hit (restored or zeroed by the plan), or, for a handoff, the state
        copied from the prefill node's."""
        if prepared is not None:
            slot = self.receive(key)
            return GroupCopies(moves=[(prepared[0], slot)])
        self.admit(key, ask.hashes, ask.hit_tokens)
        return None

    def receive(self, key: int) -> int:
        """Give a sequence a slot whose state arrives from elsewhere (a prefill node's handoff): no operation."""
        slot = self.free_slots.pop()
        self.slots[key] = slot
        return slot

    def committed(self, key: int, hashes: Sequence[BlockHash], before: int, n: int, cache: bool) -> None:
        """The sequence's running state is at token ``n``: plan a checkpoint if ``n`` is a checkpoint boundary
        (and the commit caches: ``cache``)."""
        if not cache or n <= 0 or n % self.step:
            return
        position = n // self.block_size - 1
        h = hashes[position]
        if h in self.index._block_of or h in self.pending or h in self.inflight:
            return
        pool = self.pool
        if not pool.num_fresh and not self.index.evict(1):
            self.skipped += 1  # every checkpoint is being written or restored from: skip this one
            return
        checkpoint = pool.take_fresh(1)[0]
        self.pending[h] = (checkpoint, hashes[position - 1] if position else None)
        self.ops.append(StateCopy(self.number, self.slots[key], self.state_id(checkpoint)))

    def release(self, key: int) -> None:
        """The sequence leaves: its slot is free (a save already planned from it runs first, in plan order)."""
        self.free_slots.append(self.slots.pop(key))

    # ------------------------------------------------------------------ the plan

    def plan_ran(self) -> None:
        """The plan handed out last has run: its saves become findable, its holds are released."""
        pool = self.pool
        for h, (checkpoint, parent) in self.inflight.items():
            self.index.insert(h, checkpoint, parent_hash=parent)
        pool._release_valid(checkpoint for checkpoint, _ in self.inflight.values())
        pool._release_valid(self.held_inflight)
        self.inflight = {}
        self.held_inflight = []

    def take_plan(self) -> list[StateCopy]:
        """Hand out the plan built since the last call; the plan handed out then has run (see :meth:`plan_ran`)."""
        self.plan_ran()
        self.inflight, self.pending = self.pending, {}
        self.held_inflight, self.held = self.held, []
        ops, self.ops = self.ops, []
        return ops

    @property
    def busy(self) -> bool:
        """Whether a plan still has saves or restores not known to have run (their checkpoints are held)."""
        return bool(self.ops or self.inflight or self.held_inflight)

    def check_integrity(self, live: set[int]) -> None:
        number = self.number
        if set(self.slots) != live:
            raise IntegrityError(f"group {number} has slots for other sequences than the admitted ones")
        used = list(self.slots.values())
        if sorted(used + self.free_slots) != list(range(self.num_slots)):
            raise IntegrityError(f"group {number}: slots in use {used} and free {self.free_slots} do not partition")
        pool = self.pool
        pool.check_integrity()
        self.index.check_integrity()
        expected = [0] * pool.num_blocks
        saving = [checkpoint for checkpoint, _ in (*self.pending.values(), *self.inflight.values())]
        for checkpoint in [*saving, *self.held, *self.held_inflight]:
            expected[checkpoint] += 1
        for checkpoint in range(pool.num_blocks):
            if pool.ref_count(checkpoint) != expected[checkpoint]:
                held = pool.ref_count(checkpoint)
                raise IntegrityError(f"group {number}: checkpoint {checkpoint} has {held} holders")
        for h in (*self.pending, *self.inflight):
            if h in self.index:
                raise IntegrityError(f"group {number}: a checkpoint being saved is already findable")
