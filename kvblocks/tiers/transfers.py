"""What the engine must move between tiers: one plan per scheduling step, and storage loads.

A :class:`TransferPlan` is executed in field order, before the step's forward pass::

    1. saves      gather device/host blocks -> storage entries   (a snapshot before any reuse)
    2. swap_outs  device block -> host block                      (write-back / write-through)
    3. swap_ins   host block   -> device block                    (host hits of admitted sequences)

The order matters: a device block evicted in this step may be both the source of a
swap-out (1-2) and the target of a swap-in (3); a host block evicted to make room may be
both saved (1) and overwritten by a swap-out (2).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from kvblocks.core.sequence import BlockTable
from kvblocks.errors import InvalidArgumentError
from kvblocks.hashing import BlockHash

__all__ = ["AdmittedTable", "BlockSave", "GroupTransfers", "LoadResult", "TransferPlan", "per_group"]


class AdmittedTable(BlockTable):
    """The block table of an admission with host or storage hits, and the copies that fill it.

    ``swap_ins`` are (host block, device block) pairs -- the same ones the step's
    :class:`TransferPlan` carries -- and ``loads`` the (device block, block hash) pairs being
    read from storage, reported later by ``poll_loads``. Like any :class:`BlockTable` it
    follows the sequence's table; ``swap_ins`` and ``loads`` stay what the admission planned.
    """

    __slots__ = ("loads", "swap_ins")

    def __init__(
        self,
        ids: list[int],
        swap_ins: tuple[tuple[int, int], ...],
        loads: tuple[tuple[int, BlockHash], ...],
        num_cached_tokens: int = 0,
    ) -> None:
        super().__init__(ids, num_cached_tokens)
        self.swap_ins = swap_ins
        self.loads = loads

    def __repr__(self) -> str:
        return f"AdmittedTable({self._ids!r}, swap_ins={self.swap_ins!r}, loads={len(self.loads)})"


@dataclass(frozen=True, slots=True)
class BlockSave:
    """Write block ``block`` of tier ``tier`` ("device" or "host") to storage under ``block_hash``."""

    tier: str
    block: int
    block_hash: BlockHash


@dataclass(frozen=True, slots=True)
class GroupTransfers:
    """The copies of one layer group (its own device and host blocks, its own storage keys).

    Block ids index that group's device cache and that group's host cache; run them in the plan's
    order: saves, then swap-outs, then swap-ins. Hand the saves' payloads back with
    ``complete_transfers(plan, saved={group: [...]})``.
    """

    group: int
    swap_outs: tuple[tuple[int, int], ...] = ()
    """(device block, host block) pairs of group ``group``."""
    swap_ins: tuple[tuple[int, int], ...] = ()
    """(host block, device block) pairs of group ``group``."""
    saves: tuple[BlockSave, ...] = ()
    """Blocks of group ``group`` (device or host) to write to that group's storage keys."""

    def __bool__(self) -> bool:
        return bool(self.saves or self.swap_outs or self.swap_ins)


@dataclass(frozen=True)
class TransferPlan:
    """The copies of one step, one :class:`GroupTransfers` per layer group; hand it back with
    ``complete_transfers`` once they ran.

    ``group_transfers[g]`` is group ``g``'s, group 0 first (every layer of a plain manager; the
    full-attention layers of a hybrid one, then its local groups in group order)::

        for g in plan.group_transfers:
            run(caches[g.group], g.saves, g.swap_outs, g.swap_ins)   # saves first, then out, then in

    ``saves``, ``swap_outs``, ``swap_ins`` (group 0's) and ``groups`` (the groups after 0) are the
    previous release's names, kept as read-only aliases for one release.
    """

    id: int
    group_transfers: tuple[GroupTransfers, ...] = ()

    def _group0(self) -> GroupTransfers:
        groups = self.group_transfers
        return groups[0] if groups else _NO_TRANSFERS

    @property
    def saves(self) -> tuple[BlockSave, ...]:
        """Group 0's saves (alias of ``group_transfers[0].saves``, for one release)."""
        return self._group0().saves

    @property
    def swap_outs(self) -> tuple[tuple[int, int], ...]:
        """Group 0's (device block, host block) pairs (alias of ``group_transfers[0].swap_outs``)."""
        return self._group0().swap_outs

    @property
    def swap_ins(self) -> tuple[tuple[int, int], ...]:
        """Group 0's (host block, device block) pairs (alias of ``group_transfers[0].swap_ins``)."""
        return self._group0().swap_ins

    @property
    def groups(self) -> tuple[GroupTransfers, ...]:
        """The groups after group 0 (alias of ``group_transfers[1:]``, for one release)."""
        return self.group_transfers[1:]

    def __bool__(self) -> bool:
        return any(self.group_transfers)


_NO_TRANSFERS = GroupTransfers(0)


def per_group(value: object, what: str, num_groups: int, default: object = None) -> tuple[Any, dict[int, Any]]:
    """Split a ``complete_transfers`` argument into group 0's value and the other groups' values.

    A mapping is the per-group form (``{group: value}``, group 0 included); anything else is the
    previous release's form, group 0's value alone (``default`` when a mapping leaves group 0 out).
    Raises :class:`InvalidArgumentError` for a group the manager does not have. Changes nothing.
    """
    kind = type(value)
    if kind is tuple or kind is list or kind is set or value is None or not isinstance(value, Mapping):
        return value, {}  # the common forms first: an isinstance of an ABC costs more than the rest of the call
    others: dict[int, Any] = {}
    first = default
    for group, entry in value.items():
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < num_groups:
            raise InvalidArgumentError(f"{what}: {group!r} is not a group of this manager (0..{num_groups - 1})")
        if group == 0:
            first = entry
        else:
            others[group] = entry
    return first, others


@dataclass(frozen=True)
class LoadResult:
    """A finished storage read for one admitted sequence.

    ``payloads[i]`` (one bytes view per tensor-parallel rank) goes into device block
    ``blocks[i]`` of group ``group``'s cache (0: the full-attention layers of a hybrid manager,
    every layer of a plain one); write them before the sequence's next forward pass. Blocks the read
    could not provide are not listed: when ``len(blocks) < requested`` the sequence's
    table was cut back and its remaining tokens must be computed (allocate them again).
    """

    seq_id: Hashable
    blocks: tuple[int, ...]
    payloads: tuple[tuple[memoryview, ...], ...]
    requested: int
    timed_out: bool = False
    group: int = 0

    @property
    def complete(self) -> bool:
        return len(self.blocks) == self.requested
