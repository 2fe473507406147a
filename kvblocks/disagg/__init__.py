"""Prefill/decode disaggregation: roles, the handoff, the decode reserve, and cached-token accounting.

A request is prefilled on one node and decoded on another. Its KV moves once, from the
prefill node's blocks to the decode node's, described by a :class:`PrefillHandoff`::

    prefill node                                  decode node
    allocate / commit (same path as mixed)
    finish_prefill(r) -> handoff  ──bytes──>      accept_handoff(handoff, tokens) -> DecodeAdmission
      blocks stay held                              (source block -> decode block) transfers
    ...the engine moves the KV...                 ...the engine moves the KV...
    transfer_done(r): blocks freed into the cache  receive_done(r): the prompt is committed; decode runs

Three bugs of other engines are ruled out here:

* A prefill node that never registered its blocks (near-zero hit rate in PD mode): the prefill
  role commits on exactly the mixed path, so a prefill node reaches a mixed node's hit rate.
* A decode node that double-counted cached tokens (128 cached for an 87-token prompt): the
  decode node seeds the request's cached tokens with the prefill report and adds only what its
  own cache found *beyond* it, never a negative delta, never past the prompt.
* A decode node that accepted handoffs until its running sequences could not grow: it keeps a
  reserve of blocks per running sequence and refuses (changing nothing) a handoff that would eat it.

Worked accounting example, block size 16, a 100-token prompt::

    prefill node found 32 tokens cached           handoff.cached = CachedTokens(device=32)
    decode node (prefix cache on) matches 64      delta = max(0, 64 - 32) = 32
    usage: cached_tokens = 64 of 100              prefill node counted 32, decode node 32: summed once
"""

from kvblocks.disagg.config import ROLES, DisaggConfig
from kvblocks.disagg.decode import DecodeAdmission, DecodeManager, DecodeRole, RequestUsage
from kvblocks.disagg.decode import DecodeCounters as DecodeCounters
from kvblocks.disagg.factory import ROLE_MANAGERS, manager_for_role, register_role, unregister_role
from kvblocks.disagg.handoff import (
    GROUPS_HANDOFF_VERSION,
    HANDOFF_GROUP_KINDS,
    HANDOFF_VERSION,
    LOCAL_GROUP_KINDS,
    HandoffGroup,
    PrefillHandoff,
)
from kvblocks.disagg.handoff import PLACEHOLDER as PLACEHOLDER
from kvblocks.disagg.handoff import first_held_block as first_held_block
from kvblocks.disagg.prefill import PrefillManager, PrefillRole
from kvblocks.presets import TieredDecodeManager, TieredPrefillManager  # the previous release's names

# DecodeCounters, PLACEHOLDER, first_held_block: public but outside __all__, re-exported as before
__all__ = [
    "HANDOFF_VERSION",
    "ROLES",
    "DecodeAdmission",
    "DecodeManager",
    "DecodeRole",
    "DisaggConfig",
    "GROUPS_HANDOFF_VERSION",
    "HANDOFF_GROUP_KINDS",
    "LOCAL_GROUP_KINDS",
    "HandoffGroup",
    "PrefillHandoff",
    "PrefillManager",
    "PrefillRole",
    "RequestUsage",
    "TieredDecodeManager",
    "TieredPrefillManager",
    "ROLE_MANAGERS",
    "manager_for_role",
    "register_role",
    "unregister_role",
]
