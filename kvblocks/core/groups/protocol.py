"""What every layer group beside full attention answers: the manager's one loop over its groups.

An admission is two-phase, written once in the manager: every group says what it lacks
(:meth:`GroupManager.admission`: blocks short, or None when it no longer holds what the hit needs),
and only when no group lacks anything does every group take (:meth:`GroupManager.take_admission`).
So one group's eviction can never take another group's hit, and a refusal changes no group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvblocks.hashing import BlockHash

__all__ = ["GroupManager"]


class GroupManager(Protocol):
    """One layer group's state: its pool (or slots), its index and each admitted sequence's part,
    keyed by ``id(sequence)``."""

    number: int
    """The group's index in the manager (0 is full attention)."""

    def admission(
        self,
        hashes: Sequence[BlockHash],
        hits: int,
        total: int,
        hit_tokens: int,
        encoder: int,
        *,
        prompt: int | None = None,
        covered: int | None = None,
    ) -> tuple[int, Any] | None:
        """For an admission of ``hits`` cached chain blocks (``hit_tokens`` tokens) growing to ``total`` chain
        blocks, of a sequence with ``encoder`` encoder tokens that knows ``prompt`` tokens and whose slots cover
        ``covered`` tokens before lookahead (None: not known): (blocks the group lacks, what
        :meth:`take_admission` needs), or None when the group no longer serves the hit. Pure."""
        ...

    def take_admission(self, key: int, hits: int, total: int, hit_tokens: int, prepared: Any) -> None:
        """Take what :meth:`admission` found room for (``prepared``: what it returned beside the count)."""
        ...

    def release(self, key: int) -> None:
        """The sequence leaves (freed or preempted): everything it holds in the group goes back."""
        ...
