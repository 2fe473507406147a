"""The one decision of who creates the KV cache tensors: the model runner, or the cache process.

FastDeploy kept a copy of this rule in every device runner, and the copies drifted: the XPU
runner created tensors the cache-transfer process had already created (PR #7420), and
elsewhere neither side created them while both waited. Here the rule exists once, takes no
device, and answers for both parties at the same time::

    cache process exists  <=>  a host tier (num_host_blocks > 0)
                               or a storage backend (storage_backend is not None)
                               or role is prefill / decode (disaggregation)

The rule reads configuration only, never state: a storage backend counts whether it holds
nothing or everything (the storage classes define ``__len__``, so an empty one is falsy; a
runner deciding before the first write and a cache process deciding after it must agree).

    profiling                     -> the runner allocates a private cache to measure memory;
                                     nothing is published, nobody waits
    no cache process              -> the runner creates; there is no second party
    otherwise                     -> the cache process creates and publishes; the runner attaches
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvblocks.errors import ConfigError

__all__ = ["ROLES", "Placement", "Role", "plan_placement"]

Role = Literal["mixed", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("mixed", "prefill", "decode")


@dataclass(frozen=True)
class Placement:
    """Who creates the KV tensors, who attaches, and why."""

    create_in_runner: bool
    reason: str
    cache_process: bool
    """Whether this configuration runs a cache process beside the runner at all."""
    publish: bool
    """Whether the creator publishes the tensors and signals ready (never for a profiling cache)."""

    @property
    def creator(self) -> Literal["runner", "cache_process"]:
        return "runner" if self.create_in_runner else "cache_process"

    @property
    def attacher(self) -> Literal["runner"] | None:
        """The party that waits for published tensors, if any."""
        return None if self.create_in_runner else "runner"

    def action(self, party: Literal["runner", "cache_process"]) -> Literal["create", "attach", "idle"]:
        """What ``party`` does under this placement."""
        if party == self.creator:
            return "create"
        if party == self.attacher:
            return "attach"
        return "idle"


def _check_storage_backend(storage_backend: object | None) -> None:
    """Refuse values that read as an on/off switch: by the rule they would configure a backend."""
    if isinstance(storage_backend, bool) or (isinstance(storage_backend, str) and not storage_backend.strip()):
        raise ConfigError(f"storage_backend must be None (no backend) or a backend, got {storage_backend!r}")


def plan_placement(role: Role, *, profiling: bool, num_host_blocks: int, storage_backend: object | None) -> Placement:
    """Decide where the KV tensors are created (see the module docstring for the rule).

    >>> plan_placement("mixed", profiling=False, num_host_blocks=0, storage_backend=None).creator
    'runner'
    >>> plan_placement("decode", profiling=False, num_host_blocks=0, storage_backend=None).creator
    'cache_process'
    """
    if role not in ROLES:
        raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if not isinstance(profiling, bool):
        raise ConfigError(f"profiling must be a bool, got {profiling!r}")
    if isinstance(num_host_blocks, bool) or not isinstance(num_host_blocks, int) or num_host_blocks < 0:
        raise ConfigError(f"num_host_blocks must be an int >= 0, got {num_host_blocks!r}")
    _check_storage_backend(storage_backend)
    needs = []
    if num_host_blocks > 0:
        needs.append(f"a host tier of {num_host_blocks} blocks")
    if storage_backend is not None:
        needs.append(f"a storage backend ({storage_backend!r})")
    if role != "mixed":
        needs.append(f"the {role} role")
    cache_process = bool(needs)
    if profiling:
        return Placement(
            True,
            "profiling: the runner allocates a private cache to measure memory; it is never published",
            cache_process,
            publish=False,
        )
    if not cache_process:
        return Placement(
            True, "mixed role, no host tier, no storage backend: the runner owns the tensors", False, False
        )
    return Placement(
        False,
        f"the cache process owns the tensors because of {' and '.join(needs)}; the runner attaches",
        True,
        publish=True,
    )
