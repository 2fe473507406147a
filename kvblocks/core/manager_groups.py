"""The manager's calls about its layer groups: per-group tables and pools, state slots and plans.

:class:`GroupCalls` is a part of :class:`~kvblocks.core.manager.KVCacheManager` kept in a module of its
own: each call checks its arguments and asks the manager's :class:`~kvblocks.core.coordinator.GroupCoordinator`.
Every manager answers them; a model of full attention only has one group (0).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

from kvblocks.core.coordinator import GroupCoordinator
from kvblocks.core.groups.recurrent_group import StateCopy
from kvblocks.core.pool import BlockPool
from kvblocks.core.sequence import BlockTable, _count_arg, _Sequence
from kvblocks.errors import InvalidArgumentError, SequenceStateError

__all__ = ["GroupCalls"]


class _Manager(Protocol):
    _groups: GroupCoordinator

    def _get(self, seq_id: Hashable) -> _Sequence: ...


class GroupCalls:
    """Per-group queries of a manager; group 0 is full attention, then the groups beside it in group order."""

    def block_table(self: _Manager, seq_id: Hashable) -> BlockTable:
        """The sequence's block table in group 0, a live view (empty when it is not admitted)."""
        view = self._get(seq_id).view
        return view if view is not None else BlockTable([])

    def block_tables(self: _Manager, seq_id: Hashable) -> tuple[list[int], ...]:
        """One entry per layer group, group 0 first (copies; empty lists when not admitted): an attention group's
        table (a local group's holds PLACEHOLDER where released), a recurrent group's running state slot as a
        one-entry list."""
        return self._groups.tables(self._get(seq_id))

    def group_block_table(self: _Manager, seq_id: Hashable, group: int) -> list[int]:
        """Group ``group``'s table of ``seq_id`` (a copy; 0: the full-attention table); PLACEHOLDER where a local
        group released a position. A recurrent group has no table (:meth:`state_slot` is its per-sequence state)."""
        s = self._get(seq_id)
        return self._groups.table(group, s)

    def group_pool(self: _Manager, group: int) -> BlockPool:
        """The block pool of group ``group``: group 0's is :attr:`pool`; a recurrent group's holds its checkpoints."""
        return self._groups.pool(group)

    @property
    def num_groups(self: _Manager) -> int:
        """Groups of layers: full attention (0), then the local, recurrent and cross-attention groups."""
        return len(self._groups.kinds)

    @property
    def group_kinds(self: _Manager) -> tuple[str, ...]:
        """Each group's kind, by group index."""
        return self._groups.kinds

    @property
    def hit_step(self: _Manager) -> int:
        """Every hit is a multiple of this many tokens: each group's block size and checkpoint spacing divide it."""
        return self._groups.hit_step

    def set_encoder_tokens(self: _Manager, seq_id: Hashable, num_encoder_tokens: int) -> None:
        """How many encoder outputs ``seq_id``'s cross-attention layers attend to (0 by default).

        Give it before the admission: the cross-attention groups take their blocks then.
        """
        s = self._get(seq_id)
        count = _count_arg(num_encoder_tokens, "num_encoder_tokens")
        if s.table is not None:
            raise SequenceStateError(f"sequence {seq_id!r} is admitted: its encoder tokens are fixed until it leaves")
        groups = self._groups
        if not groups.crosses and count:
            raise InvalidArgumentError("this manager has no cross-attention group")
        if count:
            groups.encoder_tokens[id(s)] = count
        else:
            groups.encoder_tokens.pop(id(s), None)

    def state_slot(self: _Manager, seq_id: Hashable, group: int) -> int:
        """The running state id of admitted ``seq_id`` in recurrent group ``group`` (what its forward pass updates)."""
        s = self._get(seq_id)
        slot = self._groups.recurrent(group).slots.get(id(s))
        if slot is None:
            raise InvalidArgumentError(f"sequence {seq_id!r} is not admitted: it has no state slot")
        return slot

    def num_state_slots(self: _Manager, group: int) -> int:
        """Running slots of recurrent group ``group``; its state ids ``num_state_slots(g) + c`` are checkpoints."""
        return self._groups.recurrent(group).num_slots

    def next_checkpoint(self: _Manager, seq_id: Hashable) -> int | None:
        """The first token count after ``seq_id``'s committed line at which every recurrent group checkpoints.

        A scheduler that ends a prefill chunk there gets the prompt's state cached (a commit elsewhere
        takes no checkpoint). None without recurrent groups.
        """
        s = self._get(seq_id)
        step = self._groups.checkpoint_step
        return (s.num_committed // step + 1) * step if step else None

    def take_state_plan(self: _Manager) -> list[StateCopy]:
        """The state operations planned since the last call, to run in order before the next forward pass.

        Call it once per step, after the scheduling calls and before the forward pass, and run what it
        returns first: calling it again is what tells the manager the previous plan has run, so the
        checkpoints that plan saved become findable then (never earlier).
        See :mod:`kvblocks.core.groups.recurrent_group`.
        """
        return self._groups.take_state_plan()

    def state_plan_done(self: _Manager) -> None:
        """Say that the plan :meth:`take_state_plan` handed out last has run, so that its checkpoints are
        findable at once (the next :meth:`take_state_plan` says it too; calling both is harmless).

        Without this call a checkpoint saved by the plan of step ``t`` is first findable by the admissions
        after the next ``take_state_plan``: a step later than it could be.
        """
        self._groups.state_plan_done()

    @property
    def checkpoints_skipped(self: _Manager) -> int:
        """Checkpoints not taken because every checkpoint of the group was being written or restored from."""
        return sum(r.skipped for r in self._groups.recurrents)
