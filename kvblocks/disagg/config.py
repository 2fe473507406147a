"""A node's role in prefill/decode disaggregation: :class:`DisaggConfig` (defined in :mod:`kvblocks.config`,
beside the cache's configuration, so that the manager reads it without importing the roles)."""

from kvblocks.config import ROLES, DisaggConfig

__all__ = ["ROLES", "DisaggConfig"]
