"""What every layer group beside full attention answers: the manager's one loop over its groups.

An admission is two-phase, written once in the manager: every group says what it lacks
(:meth:`GroupManager.admission`: blocks short, or None when it no longer holds what the hit needs),
and only when no group lacks anything does every group take (:meth:`GroupManager.take_admission`).
So one group's eviction can never take another group's hit, and a refusal changes no group.

The same two phases admit a prompt prefilled elsewhere (a decode node's handoff): the group then
keeps what it holds of the window at the prompt's end and copies the rest from the prefill node's
blocks (``remote``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvblocks.core.pool import BlockPool
from kvblocks.hashing import BlockHash

__all__ = ["Ask", "GroupCopies", "GroupManager"]


@dataclass(frozen=True, slots=True)
class Ask:
    """One admission, as every group sees it.

    ``hits`` chain blocks are cached (``hit_tokens`` tokens); the full-attention table grows to
    ``total`` chain blocks. ``window_token`` is where a local group places its window (the hit; a
    handoff's prompt end), ``encoder`` the sequence's encoder tokens, ``reserve`` the blocks each
    group must leave free besides (a decode node's growth reserve). ``prompt`` is the tokens the
    sequence knows when admitted, ``covered`` the tokens the admission's slots cover before lookahead
    (None: not known): a kind's positions may depend on them (a retained-prefix window's prompt, the
    end of a capped window's one pass).
    """

    hashes: Sequence[BlockHash]
    hits: int
    total: int
    hit_tokens: int
    window_token: int
    encoder: int = 0
    reserve: int = 0
    prompt: int | None = None
    covered: int | None = None


@dataclass(slots=True)
class GroupCopies:
    """The copies that fill one group's part of an admission (block ids are the group's own).

    ``swaps``: (host block, device block, position) swap-ins; ``loads``: (device block, position)
    storage reads; ``moves``: (prefill node's block, device block) copies of a handoff.
    """

    swaps: list[tuple[int, int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)
    moves: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.swaps or self.loads or self.moves)


class GroupManager(Protocol):
    """One layer group's state: its pool (or slots), its index and each admitted sequence's part,
    keyed by ``id(sequence)``."""

    number: int
    """The group's index in the manager (0 is full attention)."""
    pool: BlockPool
    """The group's blocks (a recurrent group's: its checkpoints)."""

    def admission(self, ask: Ask, remote: Sequence[int] | None) -> tuple[int, Any] | None:
        """(blocks the group lacks, what :meth:`take_admission` needs), or None when the group no longer
        serves the hit. ``remote``: a handoff's table of this group on the prefill node. Pure."""
        ...

    def take_admission(self, key: int, ask: Ask, prepared: Any) -> GroupCopies | None:
        """Take what :meth:`admission` found room for; returns the copies that fill it (None: none)."""
        ...

    def release(self, key: int) -> None:
        """The sequence leaves (freed or preempted): everything it holds in the group goes back."""
        ...
