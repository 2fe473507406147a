"""What a node's role (prefill, decode) tells the manager that owns it: the manager's one seam for roles.

A role is a component (:mod:`kvblocks.disagg`): it owns the request states that span nodes (a
prefill node's handoffs in flight, a decode node's prompts being received) and adds its own calls
(``finish_prefill``, ``accept_handoff``, ...), each given the manager it acts on. The manager asks it
only these questions, at the points where a sequence may change or leave. A role keeps no reference to
its manager, so a manager is freed as soon as it is dropped (no cycle for the collector to find).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol

from kvblocks.accounting import CachedTokens
from kvblocks.config import DisaggConfig
from kvblocks.core.sequence import _Sequence
from kvblocks.errors import ConfigError

__all__ = ["Role", "RoleFactory", "role_for"]


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

    def check(self, manager: Any) -> None:
        """Raise :class:`~kvblocks.errors.IntegrityError` on any broken invariant of the role's state in
        ``manager``."""
        ...


class RoleFactory(Protocol):
    """How a role facade's manager gets its role: the component, built from the manager and its configuration."""

    def __call__(self, manager: Any, disagg: DisaggConfig) -> Role: ...


def role_for(manager: Any, component: RoleFactory | None, disagg: DisaggConfig | None) -> Role | None:
    """The role ``manager`` runs in: its class's ``component`` built with ``disagg`` (checked: the class's role;
    None: its defaults), or None for a mixed node."""
    role = manager.role
    disagg = DisaggConfig(role=role) if disagg is None else disagg
    if not isinstance(disagg, DisaggConfig):
        raise ConfigError(f"disagg must be a DisaggConfig, got {type(disagg).__name__}")
    if disagg.role != role:
        raise ConfigError(f"a {type(manager).__name__} runs in the {role} role, not {disagg.role!r}")
    return None if component is None else component(manager, disagg)
