"""Prefill/decode disaggregation for hybrid models: a handoff carries each local group's table.

A hybrid prefill node's handoff names, beside the full-attention blocks (group 0, ``source_blocks``),
each sliding-window or chunked-local group's blocks of the window at the prompt's end (the prefill
node already released the rest: :data:`~kvblocks.hybrid.manager.PLACEHOLDER`). The decode node takes
only those window blocks in each local group, so a long prompt costs it no more than ``ceil(W / B) + 1``
blocks per sliding-window group::

    block size 4, window 6, a 17-token prompt (token 17 attends to tokens 12..17)
    position              0    1    2    3    4
    prefill  group 0      5    6    7    8    9        source_blocks
             group 1     -1   -1   -1    3    4        handoff.groups[0].blocks
    decode   group 0      0    1    2    3    4        five copies
             group 1     -1   -1   -1    0    1        two copies: (3 -> 0), (4 -> 1)

``accept_handoff`` takes its room in every group or in none (a refusal changes no group), and
``receive_done`` caches the prompt's blocks in every group: group 0 all of them, a local group those
it holds. A recurrent group's state after the prompt travels as one state copy (prefill state id ->
the decode node's new slot). Not handed off: cross-attention groups (the decode node runs the encoder)
and local groups whose block size differs from the manager's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvblocks.config import CacheConfig
from kvblocks.core.groups.local_group import PLACEHOLDER, LocalGroup, LocalGroupManager
from kvblocks.core.groups.recurrent_group import RecurrentGroup
from kvblocks.disagg.config import DisaggConfig
from kvblocks.disagg.decode import DecodeManager
from kvblocks.disagg.handoff import HandoffGroup, PrefillHandoff
from kvblocks.disagg.prefill import PrefillManager
from kvblocks.errors import ConfigError, IntegrityError
from kvblocks.events import EventSink
from kvblocks.hashing import DEFAULT_SCHEME, Namespace
from kvblocks.hybrid.manager import HybridKVCacheManager
from kvblocks.hybrid.tiers import TieredHybridKVCacheManager
from kvblocks.manager import _Sequence
from kvblocks.tiers.config import TierConfig

__all__ = ["HybridDecodeManager", "HybridPrefillManager", "TieredHybridDecodeManager", "TieredHybridPrefillManager"]


def _local_groups(manager: HybridKVCacheManager) -> list[LocalGroupManager]:
    """The manager's local groups; refuses a layout with groups a handoff cannot carry (cross-attention)."""
    locals_ = manager._locals
    if manager._crosses:
        raise ConfigError("a handoff does not carry cross-attention groups (the decode node runs the encoder)")
    if any(local.ratio != 1 for local in locals_):
        raise ConfigError("a handoff carries local groups of the manager's block size only")
    return locals_


def _kind(local: LocalGroupManager) -> str:
    return local.kind.name


class HybridPrefillManager(PrefillManager, HybridKVCacheManager):
    """The prefill role over a hybrid manager: ``finish_prefill`` also describes every local group's table.

    >>> p = HybridPrefillManager(16, 4, local_groups=[LocalGroup("sliding_window", span=6, num_blocks=16)])
    >>> p.add_sequence("r", list(range(17))); _ = p.allocate("r", 17); p.commit("r", 17)
    >>> h = p.finish_prefill("r"); h.source_blocks, h.groups[0].blocks
    ((0, 1, 2, 3, 4), (-1, -1, -1, 3, 4))
    """

    def _handoff_groups(self, s: _Sequence, num_blocks: int) -> tuple[HandoffGroup, ...]:
        key = id(s)
        tables = tuple(
            HandoffGroup(_kind(local), local.span, tuple(local.tables[key][:num_blocks]))
            for local in _local_groups(self)
        )
        states = tuple(HandoffGroup("recurrent", r.step, (r.slots[key],)) for r in self._recurrents)
        return tables + states

    def check_integrity(self) -> None:
        """Also: a sequence being handed off still holds every local block and state its handoff names."""
        super().check_integrity()
        for seq_id, handoff in self._transferring.items():
            s = self._seqs[seq_id]
            held: list[tuple[int | None, ...]] = [tuple(local.tables.get(id(s), ())) for local in self._locals]
            held += [(r.slots.get(id(s)),) for r in self._recurrents]
            for number, (own, group) in enumerate(zip(held, handoff.groups, strict=True), 1):
                if own[: len(group.blocks)] != group.blocks:
                    raise IntegrityError(f"sequence {seq_id!r} lost group {number}'s blocks it is transferring")


class HybridDecodeManager(DecodeManager, HybridKVCacheManager):
    """The decode role over a hybrid manager: accepts handoffs whose local groups match its own.

    A local group takes only the blocks of the window at the prompt's end: those its own cache holds
    below the decode-side hit are kept, the others are copied from the prefill node (one transfer list
    per group in :attr:`~kvblocks.disagg.DecodeAdmission.group_transfers`). Each local group, like the
    full-attention pool, keeps ``reserve_blocks_per_sequence`` free per running sequence.

    >>> window = [LocalGroup("sliding_window", span=6, num_blocks=8)]
    >>> p = HybridPrefillManager(16, 4, local_groups=window)
    >>> d = HybridDecodeManager(16, 4, local_groups=window)
    >>> p.add_sequence("r", list(range(17))); _ = p.allocate("r", 17); p.commit("r", 17)
    >>> a = d.accept_handoff(p.finish_prefill("r"), list(range(17)))
    >>> a.group_tables[1], a.group_transfers[1]
    ((-1, -1, -1, 0, 1), ((3, 0), (4, 1)))
    >>> d.receive_done("r"); p.transfer_done("r")
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        local_groups: Sequence[LocalGroup] = (),
        recurrent_groups: Sequence[RecurrentGroup] = (),
        reserve_blocks_per_sequence: int = 1,
        hash_scheme: str = DEFAULT_SCHEME,
        namespace: str | Namespace = "default",
        enable_prefix_caching: bool = True,
        event_sink: EventSink | None = None,
        reserved_blocks: int = 0,
    ) -> None:
        HybridKVCacheManager.__init__(
            self,
            num_blocks,
            block_size,
            local_groups=local_groups,
            recurrent_groups=recurrent_groups,
            hash_scheme=hash_scheme,
            namespace=namespace,
            enable_prefix_caching=enable_prefix_caching,
            event_sink=event_sink,
            reserved_blocks=reserved_blocks,
        )
        self._set_role(DisaggConfig(role="decode", reserve_blocks_per_sequence=reserve_blocks_per_sequence))

    @classmethod
    def from_config(  # type: ignore[override]
        cls,
        config: CacheConfig,
        *,
        local_groups: Sequence[LocalGroup] = (),
        recurrent_groups: Sequence[RecurrentGroup] = (),
        disagg: DisaggConfig | None = None,
        event_sink: EventSink | None = None,
    ) -> HybridDecodeManager:
        if not isinstance(config, CacheConfig):
            raise ConfigError(f"config must be a CacheConfig, got {type(config).__name__}")
        if config.drop_last_matched_block:
            raise ConfigError("drop_last_matched_block is not supported with local groups")
        manager = cls(
            config.num_blocks,
            config.block_size,
            local_groups=local_groups,
            recurrent_groups=recurrent_groups,
            hash_scheme=config.hash_scheme,
            namespace=config.namespace,
            enable_prefix_caching=config.enable_prefix_caching,
            event_sink=event_sink,
            reserved_blocks=config.reserved_blocks,
        )
        manager._set_role(disagg or DisaggConfig(role="decode"))
        return manager

    def _group_layout(self) -> tuple[tuple[str, int], ...]:
        tables = tuple((_kind(local), local.span) for local in _local_groups(self))
        return tables + tuple(("recurrent", r.step) for r in self._recurrents)

    def _accept_beside(
        self, s: _Sequence, handoff: PrefillHandoff, hits: int, reserve: int
    ) -> list[tuple[list[int], list[tuple[int, int]]]] | None:
        """Every local group's window at the prompt's end: kept from this node's cache below the hit,
        new (and copied) above it; every recurrent group's state: a slot, copied from the prefill node's
        (the state after the whole prompt). Checked in every group before any takes a block or slot."""
        if any(not recurrent.free_slots for recurrent in self._recurrents):
            return None
        prompt = handoff.num_prompt_tokens
        total = math.ceil(prompt / self._block_size)
        hashes = s.content.hashes
        plans: list[tuple[LocalGroupManager, int, list[int | None]]] = []
        for local in self._locals:
            first = local.first_needed(prompt)
            found = [local.index.block_of(hashes[p]) if p < hits else None for p in range(first, total)]
            kept = [b for b in found if b is not None]
            if found.count(None) + reserve > local.pool.num_free - local.pool.count_idle(kept):
                return None
            plans.append((local, first, found))
        for local, _, found in plans:  # every kept block held before any group takes (and maybe evicts)
            local.pool._acquire_valid(b for b in found if b is not None)
        out: list[tuple[list[int], list[tuple[int, int]]]] = []
        for number, ((local, first, found), group) in enumerate(zip(plans, handoff.groups[: len(plans)], strict=True)):
            new = iter(self._take_local(number, found.count(None)))  # through the tiers: evictions are written back
            table: list[int] = [PLACEHOLDER] * first
            moves: list[tuple[int, int]] = []
            for position, block in enumerate(found, first):
                if block is None:
                    block = next(new)
                    moves.append((group.blocks[position], block))
                table.append(block)
            local.set_table(id(s), table, prompt, prompt)
            out.append((table, moves))
        for recurrent, group in zip(self._recurrents, handoff.groups[len(plans) :], strict=True):
            slot = recurrent.receive(id(s))
            out.append(([slot], [(group.blocks[0], slot)]))
        return out

    def _window_tokens(self, s: _Sequence) -> int:
        """A sequence still receiving its prompt holds the windows at the prompt's end already."""
        if any(self._seqs.get(seq_id) is s for seq_id in self._receiving):
            return max(s.num_committed, s.content.num_tokens)
        return super()._window_tokens(s)  # a tiered node's pending re-admission places them at its hit


class TieredHybridPrefillManager(HybridPrefillManager, TieredHybridKVCacheManager):
    """The prefill role over a hybrid manager with host and storage tiers.

    Admissions find every group's prefix on device, in that group's host tier or its storage, as on a
    tiered hybrid mixed node; the handoff describes every group's table as :class:`HybridPrefillManager`'s.
    Blocks being handed off stay held in every group, and are freed into the tiers by ``transfer_done``.
    Build it with :func:`kvblocks.manager_for_role` (or its ``from_config``).
    """


class TieredHybridDecodeManager(HybridDecodeManager, TieredHybridKVCacheManager):
    """The decode role over a hybrid manager with host and storage tiers.

    Handoffs are matched against every group's device cache only; the blocks a handoff's admission
    evicts (in any group) are written back through that group's tiers, so run the step's plan
    (``take_transfers`` ... ``complete_transfers``) before the transferred KV is written. What the node
    decodes goes down the tiers as on any tiered hybrid node.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        tiers: TierConfig,
        local_groups: Sequence[LocalGroup] = (),
        recurrent_groups: Sequence[RecurrentGroup] = (),
        reserve_blocks_per_sequence: int = 1,
        event_sink: EventSink | None = None,
    ) -> None:
        TieredHybridKVCacheManager.__init__(
            self,
            num_blocks,
            block_size,
            tiers=tiers,
            local_groups=local_groups,
            recurrent_groups=recurrent_groups,
            event_sink=event_sink,
        )
        self._set_role(DisaggConfig(role="decode", reserve_blocks_per_sequence=reserve_blocks_per_sequence))

    @classmethod
    def from_config(  # type: ignore[override]
        cls,
        config: CacheConfig,
        *,
        tiers: TierConfig,
        local_groups: Sequence[LocalGroup] = (),
        recurrent_groups: Sequence[RecurrentGroup] = (),
        disagg: DisaggConfig | None = None,
        event_sink: EventSink | None = None,
    ) -> TieredHybridDecodeManager:
        manager = cls.__new__(cls)
        manager._setup(config, event_sink)
        manager._setup_groups(local_groups, recurrent_groups)
        manager._setup_tiers(tiers)
        manager._set_role(disagg or DisaggConfig(role="decode"))
        return manager
