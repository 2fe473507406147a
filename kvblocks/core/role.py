"""What a node's role (prefill, decode) tells the manager that owns it: the manager's one seam for roles.

A role is a component (:mod:`kvblocks.disagg`): it owns the request states that span nodes (a
prefill node's handoffs in flight, a decode node's prompts being received) and adds its own calls
(``finish_prefill``, ``accept_handoff``, ...). The manager asks it only these questions, at the
points where a sequence may change or leave.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol

from kvblocks.accounting import CachedTokens
from kvblocks.config import DisaggConfig
from kvblocks.core.sequence import _Sequence

__all__ = ["Role", "RoleFactory"]


class Role(Protocol):
    """A node's role, as the manager that owns it sees it."""

    name: str
    """``"prefill"`` or ``"decode"`` (a manager without a role is ``"mixed"``)."""

    def guard(self, seq_id: Hashable, what: str) -> None:
        """Raise :class:`~kvblocks.errors.SequenceStateError` if ``seq_id`` may not ``what`` (``"grow"``,
        ``"commit"``) now: its KV is moving between nodes."""
        ...

    def admitted(self, seq_id: Hashable, cached: CachedTokens) -> None:
        """``seq_id``'s admission settled with these hits (counted once, by the manager)."""
        ...

    def leaving(self, seq_id: Hashable, *, freeing: bool) -> None:
        """``seq_id`` is about to be freed (``freeing``) or preempted: raise to refuse."""
        ...

    def forget(self, seq_id: Hashable) -> None:
        """``seq_id`` was freed."""
        ...

    def window_token(self, s: _Sequence) -> int:
        """The token the windows of admitted ``s`` are placed at (its committed line, unless the role says)."""
        ...

    def check(self) -> None:
        """Raise :class:`~kvblocks.errors.IntegrityError` on any broken invariant of the role's state."""
        ...


class RoleFactory(Protocol):
    """How a role facade's manager gets its role: the component, built from the manager and its configuration."""

    def __call__(self, manager: Any, disagg: DisaggConfig) -> Role: ...
