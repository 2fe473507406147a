"""The prefill role: :class:`PrefillManager`, which hands a prefilled sequence off, and its tiered form."""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import ClassVar

from kvblocks.accounting import CachedTokens
from kvblocks.config import CacheConfig
from kvblocks.disagg.handoff import GROUPS_HANDOFF_VERSION, HANDOFF_VERSION, HandoffGroup, PrefillHandoff
from kvblocks.errors import IntegrityError, InvalidArgumentError, SequenceStateError
from kvblocks.events import EventSink
from kvblocks.hashing import Namespace
from kvblocks.manager import KVCacheManager, _Sequence
from kvblocks.tiers.manager import TieredKVCacheManager

__all__ = ["PrefillManager", "TieredPrefillManager"]


class PrefillManager(KVCacheManager):
    """A :class:`KVCacheManager` in the prefill role: the mixed path, plus handing sequences off.

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

    _guards_changes = True  # its _check_can_change may refuse

    role: ClassVar[str] = "prefill"

    def _setup(self, config: CacheConfig, event_sink: EventSink | None) -> None:
        super()._setup(config, event_sink)
        self._key_space = Namespace.of(config.namespace).tag(config.hash_scheme, config.block_size)
        self._first_cached: dict[Hashable, CachedTokens] = {}
        self._transferring: dict[Hashable, PrefillHandoff] = {}

    def _check_can_change(self, seq_id: Hashable, s: _Sequence, what: str) -> None:
        if seq_id in self._transferring:
            raise SequenceStateError(f"sequence {seq_id!r} was handed off; it cannot {what} here")
        super()._check_can_change(seq_id, s, what)

    def _admitted(self, seq_id: Hashable, cached: CachedTokens, readmission: bool) -> None:
        super()._admitted(seq_id, cached, readmission)
        # the first admission's hits are the request's; a re-admission would count its own blocks
        self._first_cached.setdefault(seq_id, cached)

    def finish_prefill(self, seq_id: Hashable) -> PrefillHandoff:
        """The prompt's KV is written: describe it for the decode node. The blocks stay held until
        :meth:`transfer_done`."""
        s = self._get(seq_id)
        if seq_id in self._transferring:
            raise SequenceStateError(f"sequence {seq_id!r} was already handed off")
        if not isinstance(seq_id, (str, int)) or isinstance(seq_id, bool):
            raise InvalidArgumentError(f"a handed-off sequence id must be a str or int, got {type(seq_id).__name__}")
        content = s.content
        prompt = content.num_tokens
        if s.table is None or s.num_committed != prompt:
            raise SequenceStateError(
                f"sequence {seq_id!r} has {s.num_committed} of {prompt} tokens committed; commit the whole prompt first"
            )
        size = self._block_size
        groups = self._handoff_groups(s, math.ceil(prompt / size))
        handoff = PrefillHandoff(
            seq_id=seq_id,
            num_prompt_tokens=prompt,
            block_hashes=tuple(content.hashes[: prompt // size]),
            source_blocks=tuple(s.table[: math.ceil(prompt / size)]),
            cached=self._first_cached.get(seq_id, CachedTokens(num_prompt_tokens=prompt)),
            scheme=self.config.hash_scheme,
            block_size=size,
            key_space=self._key_space,
            version=GROUPS_HANDOFF_VERSION if groups else HANDOFF_VERSION,
            groups=groups,
        )
        self._transferring[seq_id] = handoff
        return handoff

    def _handoff_groups(self, s: _Sequence, num_blocks: int) -> tuple[HandoffGroup, ...]:
        """The tables of the layer groups beside the full-attention one (a hybrid manager has them). None here."""
        return ()

    def is_transferring(self, seq_id: Hashable) -> bool:
        return seq_id in self._transferring

    @property
    def num_transferring(self) -> int:
        return len(self._transferring)

    def transfer_done(self, seq_id: Hashable) -> None:
        """The decode node has the KV (or gave up on it): free the sequence's blocks into the cache."""
        if seq_id not in self._transferring:
            self._get(seq_id)  # unknown -> UnknownSequenceError
            raise SequenceStateError(f"sequence {seq_id!r} is not being transferred")
        del self._transferring[seq_id]
        super().free(seq_id)
        self._first_cached.pop(seq_id, None)

    def free(self, seq_id: Hashable) -> None:
        if seq_id in self._transferring:
            raise SequenceStateError(f"sequence {seq_id!r} is being transferred to decode: call transfer_done")
        super().free(seq_id)  # may settle a pending tiered admission, which reports its hits first
        self._first_cached.pop(seq_id, None)

    def preempt(self, seq_id: Hashable) -> None:
        if seq_id in self._transferring:
            raise SequenceStateError(f"sequence {seq_id!r} is being transferred to decode; it cannot be preempted")
        super().preempt(seq_id)

    def check_integrity(self) -> None:
        super().check_integrity()
        for seq_id, handoff in self._transferring.items():
            s = self._seqs.get(seq_id)
            if s is None or s.table is None or tuple(s.table[: len(handoff.source_blocks)]) != handoff.source_blocks:
                raise IntegrityError(f"sequence {seq_id!r} lost the blocks it is transferring")


class TieredPrefillManager(PrefillManager, TieredKVCacheManager):
    """The prefill role over host and storage tiers.

    Admissions find their prefix on device, in host memory or in storage exactly as on a
    tiered mixed node; the handoff reports the hits as they *settled* (a storage read that
    found fewer blocks than the index promised reports the shorter run), split by tier.
    Blocks being handed off stay held, and are freed into the tiers by ``transfer_done``.

    >>> from kvblocks.tiers import TierConfig
    >>> p = TieredPrefillManager(3, 4, tiers=TierConfig(num_host_blocks=4))
    >>> p.add_sequence("a", list(range(9))); _ = p.allocate("a", 9); p.commit("a", 9)
    >>> p.transfer_done(p.finish_prefill("a").seq_id)                # a's blocks stay cached on device
    >>> p.add_sequence("b", list(range(50, 59))); _ = p.allocate("b", 9)  # evicts them: copied to host
    >>> p.complete_transfers(p.take_transfers()); p.free("b")
    >>> p.add_sequence("c", list(range(9))); t = p.allocate("c", 1)  # a's prefix comes back from host
    >>> p.complete_transfers(p.take_transfers()); p.commit("c", 9)
    >>> p.finish_prefill("c").cached
    CachedTokens(device=0, host=8, storage=0, num_prompt_tokens=9)
    """
