"""The decode role: :class:`DecodeManager`, which accepts handoffs, keeps a growth reserve and counts
cached tokens once across the two nodes, and its tiered form."""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from kvblocks.accounting import CachedTokens
from kvblocks.config import CacheConfig
from kvblocks.disagg.config import DisaggConfig
from kvblocks.disagg.handoff import PrefillHandoff
from kvblocks.errors import ConfigError, DuplicateSequenceError, HandoffError, IntegrityError, SequenceStateError
from kvblocks.events import EventSink
from kvblocks.hashing import DEFAULT_SCHEME, BlockExtras, HashedTokens, Namespace
from kvblocks.manager import BlockTable, KVCacheManager, _Sequence
from kvblocks.tiers.config import TierConfig
from kvblocks.tiers.manager import TieredKVCacheManager

__all__ = ["DecodeAdmission", "DecodeCounters", "DecodeManager", "RequestUsage", "TieredDecodeManager"]


@dataclass(frozen=True)
class DecodeAdmission:
    """An accepted handoff: the sequence's decode-side table and the copies that must fill it."""

    seq_id: Hashable
    table: BlockTable
    transfers: tuple[tuple[int, int], ...]
    """(prefill source block, decode block) pairs: the prompt's blocks beyond the decode-side hit."""
    cached: CachedTokens
    """The request's cached tokens: the prefill report plus the decode-side hit beyond it."""
    group_tables: tuple[tuple[int, ...], ...] = ()
    """Per group (0: ``table``; then a hybrid model's local groups): the decode-side table, PLACEHOLDER where
    a local group holds no block (positions its window at the prompt's end does not reach)."""
    group_transfers: tuple[tuple[tuple[int, int], ...], ...] = ()
    """Per group (0: ``transfers``): the (source block, decode block) copies that fill that group's table."""


@dataclass(frozen=True)
class RequestUsage:
    """A finished request's cached-token figure, counted once across the two nodes."""

    prompt_tokens: int
    cached: CachedTokens

    @property
    def cached_tokens(self) -> int:
        return self.cached.total

    def openai(self) -> dict[str, Any]:
        """The OpenAI-style ``usage`` fields for the prompt."""
        return {"prompt_tokens": self.prompt_tokens, "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class DecodeCounters:
    """Monotonic counters of a decode node (tokens unless named otherwise)."""

    handoffs_accepted: int = 0
    handoffs_refused: int = 0
    seeded_hit_tokens: int = 0
    """Cached tokens the prefill nodes reported: counted there, not again here."""
    decode_hit_tokens: int = 0
    """Cached tokens found by this node beyond the prefill reports: counted only here."""
    transferred_blocks: int = 0


class DecodeManager(KVCacheManager):
    """A :class:`KVCacheManager` in the decode role: accepts handoffs, keeps a growth reserve.

    Its own prefix cache (``enable_prefix_caching``) is optional: when on, a handoff's prompt
    is matched against it first and only the blocks beyond that prefix are transferred.

    >>> from kvblocks.disagg import PrefillManager
    >>> d = DecodeManager(num_blocks=6, block_size=4, reserve_blocks_per_sequence=1)
    >>> p = PrefillManager(num_blocks=8, block_size=4)
    >>> p.add_sequence(1, list(range(10))); _ = p.allocate(1, 10); p.commit(1, 10)
    >>> a = d.accept_handoff(p.finish_prefill(1), list(range(10)))
    >>> a.transfers                                    # every prompt block moves (cold decode cache)
    ((0, 0), (1, 1), (2, 2))
    >>> d.receive_done(1); p.transfer_done(1)
    >>> d.usage(1).openai()
    {'prompt_tokens': 10, 'prompt_tokens_details': {'cached_tokens': 0}}
    """

    _guards_changes = True  # its _check_can_change may refuse

    role: ClassVar[str] = "decode"

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        reserve_blocks_per_sequence: int = 1,
        hash_scheme: str = DEFAULT_SCHEME,
        namespace: str | Namespace = "default",
        enable_prefix_caching: bool = True,
        event_sink: EventSink | None = None,
    ) -> None:
        super().__init__(
            num_blocks,
            block_size,
            hash_scheme=hash_scheme,
            namespace=namespace,
            enable_prefix_caching=enable_prefix_caching,
            event_sink=event_sink,
        )
        self._set_role(DisaggConfig(role="decode", reserve_blocks_per_sequence=reserve_blocks_per_sequence))

    @classmethod
    def from_config(
        cls, config: CacheConfig, *, disagg: DisaggConfig | None = None, event_sink: EventSink | None = None
    ) -> DecodeManager:
        manager = cls.__new__(cls)
        manager._setup(config, event_sink)
        manager._set_role(disagg or DisaggConfig(role="decode"))
        return manager

    def _set_role(self, disagg: DisaggConfig) -> None:
        if disagg.role != "decode":
            raise ConfigError(f"a DecodeManager runs in the decode role, not {disagg.role!r}")
        self._reserve_per_sequence = disagg.reserve_blocks_per_sequence
        config = self.config
        self._key_space = Namespace.of(config.namespace).tag(config.hash_scheme, config.block_size)
        self._receiving: set[Hashable] = set()
        self._usage: dict[Hashable, CachedTokens] = {}
        self.decode_counters = DecodeCounters()

    @property
    def num_running(self) -> int:
        """Admitted sequences (receiving ones included): each is owed its growth reserve."""
        return sum(1 for s in self._seqs.values() if s.table is not None)

    @property
    def reserve_blocks(self) -> int:
        """Blocks a new handoff may not take now: the growth reserve of the running sequences."""
        return self._reserve_per_sequence * self.num_running

    def _check_compatible(self, handoff: PrefillHandoff) -> None:
        if not isinstance(handoff, PrefillHandoff):
            raise HandoffError(f"expected a PrefillHandoff, got {type(handoff).__name__}")
        handoff.validate()  # the format version among the rest: 1, or 2 with per-group tables
        config = self.config
        if handoff.scheme != config.hash_scheme or handoff.block_size != config.block_size:
            raise HandoffError(
                f"handoff from a {handoff.scheme} / block size {handoff.block_size} node; "
                f"this node uses {config.hash_scheme} / block size {config.block_size}"
            )
        if handoff.key_space != self._key_space:
            raise HandoffError("handoff from another namespace (model or salt): its block hashes mean nothing here")
        layout = self._group_layout()
        if handoff.group_layout != layout:
            raise HandoffError(
                f"handoff from a node whose local groups are {list(handoff.group_layout) or 'none'}; "
                f"this node's are {list(layout) or 'none'}"
            )

    def _group_layout(self) -> tuple[tuple[str, int], ...]:
        """(kind, span) of the layer groups beside full attention, which a handoff must match. None here."""
        return ()

    def _accept_beside(
        self, s: _Sequence, handoff: PrefillHandoff, hits: int, reserve: int
    ) -> list[tuple[list[int], list[tuple[int, int]]]] | None:
        """The other groups' part of accepting ``handoff`` over a decode-side hit of ``hits`` blocks, each
        group keeping ``reserve`` blocks free: per group its table and transfers, or None (and no change)
        when some group has no room. No other groups here."""
        return []

    def accept_handoff(
        self, handoff: PrefillHandoff, token_ids: Iterable[int], *, extras: BlockExtras | None = None
    ) -> DecodeAdmission | None:
        """Register and admit a prefilled sequence; None (and no change) if it would eat the reserve.

        ``token_ids`` is the prompt (the decode engine has it with the request); its hashes must
        be the handoff's, so a handoff can never be applied to the wrong prompt.
        """
        self._check_compatible(handoff)
        seq_id = handoff.seq_id
        if seq_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {seq_id!r} is already registered on this decode node")
        content = HashedTokens(self._hasher, token_ids, extras)
        size = self._block_size
        prompt = content.num_tokens
        if prompt != handoff.num_prompt_tokens or tuple(content.hashes) != handoff.block_hashes:
            raise HandoffError(f"handoff {seq_id!r} does not describe these prompt tokens (length or block hashes)")
        s = _Sequence(content)  # registered only if the handoff is accepted
        matched = self._match(s)  # the prefill node's last-token rule: a prefix reports the same number on both
        hits = len(matched)
        total = math.ceil(prompt / size)
        need = total - hits
        pool = self._pool
        reserve = self._reserve_per_sequence * (self.num_running + 1) + self._reserve  # + the config's watermark
        beside = None
        if need + reserve <= pool.num_free - pool.count_idle(matched):
            beside = self._accept_beside(s, handoff, hits, self._reserve_per_sequence * (self.num_running + 1))
        if beside is None:
            self.decode_counters.handoffs_refused += 1
            return None
        self._seqs[seq_id] = s
        self._freed.pop(seq_id, None)
        if hits:
            pool._acquire_valid(matched)
        new = self._take(need) if need else []
        table = matched + new
        s.table = table
        s.view = BlockTable(table, hits * size)
        s.num_covered = prompt
        s.num_committed = hits * size
        self._receiving.add(seq_id)
        seeded = handoff.cached
        delta = max(0, min(hits * size - seeded.total, prompt - seeded.total))
        cached = CachedTokens(seeded.device + delta, seeded.host, seeded.storage, num_prompt_tokens=prompt)
        self._usage[seq_id] = cached
        counters = self.decode_counters
        counters.handoffs_accepted += 1
        counters.seeded_hit_tokens += seeded.total
        counters.decode_hit_tokens += delta
        counters.transferred_blocks += need
        transfers = tuple(zip(handoff.source_blocks[hits:], new, strict=True))
        counters.transferred_blocks += sum(len(moves) for _, moves in beside)
        return DecodeAdmission(
            seq_id,
            s.view,
            transfers,
            cached,
            group_tables=(tuple(table), *(tuple(t) for t, _ in beside)),
            group_transfers=(transfers, *(tuple(moves) for _, moves in beside)),
        )

    def is_receiving(self, seq_id: Hashable) -> bool:
        return seq_id in self._receiving

    def receive_done(self, seq_id: Hashable, *, ok: bool = True) -> None:
        """The handoff's KV arrived: the prompt counts as computed (and its full blocks become cached here).

        ``ok=False``: the transfer failed; the sequence is dropped and its blocks return to the pool.
        """
        if seq_id not in self._receiving:
            self._get(seq_id)
            raise SequenceStateError(f"sequence {seq_id!r} is not receiving a handoff")
        self._receiving.discard(seq_id)
        if not ok:
            self._usage.pop(seq_id, None)
            super().free(seq_id)
            return
        super().commit(seq_id, self._seqs[seq_id].content.num_tokens)

    def usage(self, seq_id: Hashable) -> RequestUsage:
        """The request's cached-token figure (prefill report + decode-side hit beyond it)."""
        self._get(seq_id)
        cached = self._usage.get(seq_id)
        if cached is None:
            raise SequenceStateError(f"sequence {seq_id!r} did not arrive through a handoff")
        return RequestUsage(cached.num_prompt_tokens, cached)

    def _refuse_while_receiving(self, seq_id: Hashable, what: str) -> None:
        if seq_id in self._receiving:
            raise SequenceStateError(f"sequence {seq_id!r} is receiving its prompt's KV; it cannot {what} yet")

    def _check_can_change(self, seq_id: Hashable, s: _Sequence, what: str) -> None:
        self._refuse_while_receiving(seq_id, what)
        super()._check_can_change(seq_id, s, what)

    def preempt(self, seq_id: Hashable) -> None:
        self._refuse_while_receiving(seq_id, "be preempted")
        super().preempt(seq_id)

    def free(self, seq_id: Hashable) -> None:
        self._refuse_while_receiving(seq_id, "be freed (use receive_done(ok=False))")
        self._usage.pop(seq_id, None)
        super().free(seq_id)

    def check_integrity(self) -> None:
        super().check_integrity()
        self._check_receiving()

    def _check_receiving(self) -> None:
        """The decode role's own invariants: receiving sequences are admitted, usage figures sound."""
        for seq_id in self._receiving:
            s = self._seqs.get(seq_id)
            if s is None or s.table is None:
                raise IntegrityError(f"receiving sequence {seq_id!r} has no table")
        for seq_id, cached in self._usage.items():
            if seq_id not in self._seqs or cached.total > cached.num_prompt_tokens:
                raise IntegrityError(f"usage of {seq_id!r} is inconsistent")


class TieredDecodeManager(DecodeManager, TieredKVCacheManager):
    """The decode role over host and storage tiers.

    Handoffs are matched against the device prefix cache only (host and storage runs are
    for this node's own re-admissions). What the node decodes goes down the tiers like on
    any tiered node: evicted blocks are written back, ``write-through`` stores each block
    on commit -- so the next turn of a conversation, prefilled on another node, can load
    the whole history from shared storage -- and ``save_on_preempt`` lets a preempted
    sequence come back from storage instead of being recomputed.

    Step order: ``accept_handoff`` may evict blocks to make room, so run the step's plan
    (``take_transfers`` ... ``complete_transfers``) before the transferred KV is written
    into the admission's blocks, as before any forward pass.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        tiers: TierConfig,
        reserve_blocks_per_sequence: int = 1,
        hash_scheme: str = DEFAULT_SCHEME,
        namespace: str | Namespace = "default",
        enable_prefix_caching: bool = True,
        event_sink: EventSink | None = None,
    ) -> None:
        TieredKVCacheManager.__init__(
            self,
            num_blocks,
            block_size,
            tiers=tiers,
            hash_scheme=hash_scheme,
            namespace=namespace,
            enable_prefix_caching=enable_prefix_caching,
            event_sink=event_sink,
        )
        self._set_role(DisaggConfig(role="decode", reserve_blocks_per_sequence=reserve_blocks_per_sequence))

    @classmethod
    def from_config(  # type: ignore[override]
        cls,
        config: CacheConfig,
        *,
        tiers: TierConfig,
        disagg: DisaggConfig | None = None,
        event_sink: EventSink | None = None,
    ) -> TieredDecodeManager:
        manager = cls.__new__(cls)
        manager._setup(config, event_sink)
        manager._setup_tiers(tiers)
        manager._set_role(disagg or DisaggConfig(role="decode"))
        return manager
