"""The prefill role: :class:`PrefillRole`, which hands a prefilled sequence off, and :class:`PrefillManager`,
the manager facade that adds its calls.

A prefill node commits on exactly the mixed path (so it reaches a mixed node's hit rate), over any
group layout and any tiers; ``finish_prefill`` describes every group's part of the prompt for the
decode node, and the blocks stay held until ``transfer_done``::

    block size 4, window 6, a 17-token prompt (token 17 attends to tokens 12..17)
    position              0    1    2    3    4
    group 0               5    6    7    8    9        handoff.source_blocks
    group 1 (window)     -1   -1   -1    3    4        handoff.groups[0].blocks: released before the window

Not handed off: cross-attention groups (the decode node runs the encoder) and local groups whose block
size differs from the manager's (refused when the role is set up).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import ClassVar

from kvblocks.accounting import CachedTokens
from kvblocks.config import DisaggConfig
from kvblocks.core.manager import KVCacheManager
from kvblocks.core.sequence import _Sequence
from kvblocks.disagg.handoff import (
    GROUPS_HANDOFF_VERSION,
    HANDOFF_VERSION,
    LOCAL_GROUP_KINDS,
    HandoffGroup,
    PrefillHandoff,
)
from kvblocks.errors import ConfigError, IntegrityError, InvalidArgumentError, SequenceStateError
from kvblocks.hashing import Namespace

__all__ = ["PrefillManager", "PrefillRole", "handoff_layout"]


def handoff_layout(manager: KVCacheManager) -> tuple[tuple[str, int], ...]:
    """(kind, span) of each group a handoff carries beside full attention: the local groups, then the
    recurrent ones. Raises :class:`ConfigError` for a layout a handoff cannot carry."""
    if manager._crosses:
        raise ConfigError("a handoff does not carry cross-attention groups (the decode node runs the encoder)")
    if any(local.ratio != 1 for local in manager._locals):
        raise ConfigError("a handoff carries local groups of the manager's block size only")
    for local in manager._locals:
        if local.kind.name not in LOCAL_GROUP_KINDS:
            raise ConfigError(f"a handoff does not carry {local.kind.name} groups (it carries {LOCAL_GROUP_KINDS})")
    tables = tuple((local.kind.name, local.span) for local in manager._locals)
    return tables + tuple(("recurrent", r.step) for r in manager._recurrents)


class PrefillRole:
    """The prefill role of a manager: the handoffs in flight and each request's first admission's hits."""

    name = "prefill"

    def __init__(self, manager: PrefillManager, disagg: DisaggConfig) -> None:
        handoff_layout(manager)  # refuses a layout a handoff cannot carry, before any request
        config = manager.config
        self.key_space = Namespace.of(config.namespace).tag(config.hash_scheme, config.block_size)
        self.first_cached: dict[Hashable, CachedTokens] = {}
        self.transferring: dict[Hashable, PrefillHandoff] = {}
        manager._prefill = self

    # ------------------------------------------------------------------ what the manager asks

    def guard(self, seq_id: Hashable, what: str) -> None:
        if seq_id in self.transferring:
            raise SequenceStateError(f"sequence {seq_id!r} was handed off; it cannot {what} here")

    def admitted(self, seq_id: Hashable, cached: CachedTokens) -> None:
        # the first admission's hits are the request's; a re-admission would count its own blocks
        self.first_cached.setdefault(seq_id, cached)

    def leaving(self, seq_id: Hashable, *, freeing: bool) -> None:
        if seq_id in self.transferring:
            if freeing:
                raise SequenceStateError(f"sequence {seq_id!r} is being transferred to decode: call transfer_done")
            raise SequenceStateError(f"sequence {seq_id!r} is being transferred to decode; it cannot be preempted")

    def forget(self, seq_id: Hashable) -> None:
        self.first_cached.pop(seq_id, None)

    def window_token(self, s: _Sequence) -> int:
        return s.num_committed

    def check(self, m: KVCacheManager) -> None:
        """A sequence being handed off still holds every block and state its handoff names, in every group."""
        for seq_id, handoff in self.transferring.items():
            s = m._seqs.get(seq_id)
            if s is None or s.table is None or tuple(s.table[: len(handoff.source_blocks)]) != handoff.source_blocks:
                raise IntegrityError(f"sequence {seq_id!r} lost the blocks it is transferring")
            held: list[tuple[int | None, ...]] = [tuple(local.tables.get(id(s), ())) for local in m._locals]
            held += [(r.slots.get(id(s)),) for r in m._recurrents]
            for number, (own, group) in enumerate(zip(held, handoff.groups, strict=True), 1):
                if own[: len(group.blocks)] != group.blocks:
                    raise IntegrityError(f"sequence {seq_id!r} lost group {number}'s blocks it is transferring")

    # ------------------------------------------------------------------ its own calls

    def finish_prefill(self, m: KVCacheManager, seq_id: Hashable) -> PrefillHandoff:
        s = m._get(seq_id)
        if seq_id in self.transferring:
            raise SequenceStateError(f"sequence {seq_id!r} was already handed off")
        if not isinstance(seq_id, (str, int)) or isinstance(seq_id, bool):
            raise InvalidArgumentError(f"a handed-off sequence id must be a str or int, got {type(seq_id).__name__}")
        content = s.content
        prompt = content.num_tokens
        if s.table is None or s.num_committed != prompt:
            raise SequenceStateError(
                f"sequence {seq_id!r} has {s.num_committed} of {prompt} tokens committed; commit the whole prompt first"
            )
        size = m.block_size
        num_blocks = math.ceil(prompt / size)
        key = id(s)
        groups = tuple(
            HandoffGroup(local.kind.name, local.span, tuple(local.tables[key][:num_blocks])) for local in m._locals
        ) + tuple(HandoffGroup("recurrent", r.step, (r.slots[key],)) for r in m._recurrents)
        handoff = PrefillHandoff(
            seq_id=seq_id,
            num_prompt_tokens=prompt,
            block_hashes=tuple(content.hashes[: prompt // size]),
            source_blocks=tuple(s.table[:num_blocks]),
            cached=self.first_cached.get(seq_id, CachedTokens(num_prompt_tokens=prompt)),
            scheme=m.config.hash_scheme,
            block_size=size,
            key_space=self.key_space,
            version=GROUPS_HANDOFF_VERSION if groups else HANDOFF_VERSION,
            groups=groups,
        )
        self.transferring[seq_id] = handoff
        return handoff

    def transfer_done(self, m: KVCacheManager, seq_id: Hashable) -> None:
        if seq_id not in self.transferring:
            m._get(seq_id)  # unknown -> UnknownSequenceError
            raise SequenceStateError(f"sequence {seq_id!r} is not being transferred")
        del self.transferring[seq_id]
        m.free(seq_id)


class PrefillManager(KVCacheManager):
    """A :class:`KVCacheManager` in the prefill role: the mixed path, plus handing sequences off.

    It takes every argument :class:`KVCacheManager` takes (``tiers=``, ``groups=`` among them): admissions
    find their prefix on device, in host memory or in storage exactly as on a mixed node, and the handoff
    reports the hits as they settled, split by tier.

    >>> m = PrefillManager(num_blocks=8, block_size=4)
    >>> m.add_sequence("r", list(range(10)))
    >>> list(m.allocate("r", 10)); m.commit("r", 10)
    [0, 1, 2]
    >>> h = m.finish_prefill("r"); (h.source_blocks, h.cached.total)
    ((0, 1, 2), 0)
    >>> m.free("r")
    Traceback (most recent call last):
    ...
    kvblocks.errors.SequenceStateError: sequence 'r' is being transferred to decode: call transfer_done
    >>> m.transfer_done("r"); len(m.tree)                # its two full blocks are cached now
    2
    """

    role: ClassVar[str] = "prefill"
    _role_component = PrefillRole
    _prefill: PrefillRole

    def finish_prefill(self, seq_id: Hashable) -> PrefillHandoff:
        """The prompt's KV is written: describe every group's part of it for the decode node. The blocks stay
        held until :meth:`transfer_done`."""
        return self._prefill.finish_prefill(self, seq_id)

    def is_transferring(self, seq_id: Hashable) -> bool:
        return seq_id in self._prefill.transferring

    @property
    def num_transferring(self) -> int:
        return len(self._prefill.transferring)

    def transfer_done(self, seq_id: Hashable) -> None:
        """The decode node has the KV (or gave up on it): free the sequence's blocks into the cache (and its tiers)."""
        self._prefill.transfer_done(self, seq_id)
