"""The decode role: :class:`DecodeRole`, which accepts handoffs, keeps a growth reserve and counts cached
tokens once across the two nodes, and :class:`DecodeManager`, the manager facade that adds its calls.

``accept_handoff`` is the manager's one admission (every group says it has room, then every group
takes), with the role supplying the hit and the copies: each group keeps what this node holds of the
prompt below its device-side hit and copies the rest from the prefill node's blocks; a local group
takes only the window at the prompt's end::

    block size 4, window 6, a 17-token prompt (token 17 attends to tokens 12..17), a cold decode cache
    position              0    1    2    3    4
    prefill  group 0      5    6    7    8    9        source_blocks
             group 1     -1   -1   -1    3    4        handoff.groups[0].blocks
    decode   group 0      0    1    2    3    4        five copies
             group 1     -1   -1   -1    0    1        two copies: (3 -> 0), (4 -> 1)

A recurrent group's state after the prompt travels as one state copy (prefill state id -> a new slot).
Handoffs are matched against the device only (host and storage runs are for this node's own
re-admissions); the blocks an acceptance evicts go down the tiers as any eviction does, so run the
step's plan (``take_transfers`` ... ``complete_transfers``) before the transferred KV is written.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from kvblocks.accounting import CachedTokens
from kvblocks.config import DisaggConfig
from kvblocks.core.manager import KVCacheManager
from kvblocks.core.sequence import BlockTable, _Sequence
from kvblocks.disagg.handoff import PrefillHandoff
from kvblocks.disagg.prefill import handoff_layout
from kvblocks.errors import DuplicateSequenceError, HandoffError, IntegrityError, SequenceStateError
from kvblocks.hashing import BlockExtras, HashedTokens, Namespace

__all__ = ["DecodeAdmission", "DecodeCounters", "DecodeManager", "DecodeRole", "RequestUsage"]


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
    """Per group (0: ``table``; then a hybrid model's local groups, then its recurrent groups' slots): the
    decode-side table, PLACEHOLDER where a local group holds no block (positions its window at the prompt's
    end does not reach)."""
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


class DecodeRole:
    """The decode role of a manager: the prompts being received, each request's usage, the growth reserve."""

    name = "decode"

    def __init__(self, manager: DecodeManager, disagg: DisaggConfig) -> None:
        self.layout = handoff_layout(manager)  # what a handoff must carry; refuses a layout it cannot carry
        self.reserve_per_sequence = disagg.reserve_blocks_per_sequence
        config = manager.config
        self.key_space = Namespace.of(config.namespace).tag(config.hash_scheme, config.block_size)
        self.receiving: dict[Hashable, int] = {}  # sequence -> id(_Sequence), while its prompt's KV arrives
        self.usage: dict[Hashable, CachedTokens] = {}
        self.counters = DecodeCounters()
        manager._decode = self

    # ------------------------------------------------------------------ what the manager asks

    def guard(self, seq_id: Hashable, what: str) -> None:
        if seq_id in self.receiving:
            raise SequenceStateError(f"sequence {seq_id!r} is receiving its prompt's KV; it cannot {what} yet")

    def admitted(self, seq_id: Hashable, cached: CachedTokens) -> None:
        """A re-admission on this node (after a preemption): the request's usage stays the handoff's."""

    def leaving(self, seq_id: Hashable, *, freeing: bool) -> None:
        self.guard(seq_id, "be freed (use receive_done(ok=False))" if freeing else "be preempted")

    def forget(self, seq_id: Hashable) -> None:
        self.usage.pop(seq_id, None)

    def window_token(self, s: _Sequence) -> int:
        """A sequence still receiving its prompt holds the windows at the prompt's end already."""
        if id(s) in self.receiving.values():
            return max(s.num_committed, s.content.num_tokens)
        return s.num_committed

    def check(self, m: KVCacheManager) -> None:
        """Receiving sequences are admitted; usage figures are sound."""
        seqs = m._seqs
        for seq_id in self.receiving:
            s = seqs.get(seq_id)
            if s is None or s.table is None or id(s) != self.receiving[seq_id]:
                raise IntegrityError(f"receiving sequence {seq_id!r} has no table")
        for seq_id, cached in self.usage.items():
            if seq_id not in seqs or cached.total > cached.num_prompt_tokens:
                raise IntegrityError(f"usage of {seq_id!r} is inconsistent")

    # ------------------------------------------------------------------ its own calls

    @staticmethod
    def num_running(m: KVCacheManager) -> int:
        return sum(1 for s in m._seqs.values() if s.table is not None)

    def _check_compatible(self, m: KVCacheManager, handoff: PrefillHandoff) -> None:
        if not isinstance(handoff, PrefillHandoff):
            raise HandoffError(f"expected a PrefillHandoff, got {type(handoff).__name__}")
        handoff.validate()  # the format version among the rest: 1, or 2 with per-group tables
        config = m.config
        if handoff.scheme != config.hash_scheme or handoff.block_size != config.block_size:
            raise HandoffError(
                f"handoff from a {handoff.scheme} / block size {handoff.block_size} node; "
                f"this node uses {config.hash_scheme} / block size {config.block_size}"
            )
        if handoff.key_space != self.key_space:
            raise HandoffError("handoff from another namespace (model or salt): its block hashes mean nothing here")
        if handoff.group_layout != self.layout:
            raise HandoffError(
                f"handoff from a node whose local groups are {list(handoff.group_layout) or 'none'}; "
                f"this node's are {list(self.layout) or 'none'}"
            )

    def accept(
        self, m: KVCacheManager, handoff: PrefillHandoff, token_ids: Iterable[int], extras: BlockExtras | None
    ) -> DecodeAdmission | None:
        """See :meth:`DecodeManager.accept_handoff`."""
        self._check_compatible(m, handoff)
        seq_id = handoff.seq_id
        if seq_id in m._seqs:
            raise DuplicateSequenceError(f"sequence {seq_id!r} is already registered on this decode node")
        content = HashedTokens(m._hasher, token_ids, extras)
        prompt = content.num_tokens
        if prompt != handoff.num_prompt_tokens or tuple(content.hashes) != handoff.block_hashes:
            raise HandoffError(f"handoff {seq_id!r} does not describe these prompt tokens (length or block hashes)")
        s = _Sequence(content)  # registered only if the handoff is accepted
        admission = m._admission
        matched = admission.match(s)  # the prefill node's last-token rule: a prefix reports the same number on both
        kept = len(matched)  # the table grows from this list: count it first
        hit: tuple[int, list[int], list[int], int] = (kept, matched, [], 0)
        hits = kept * m.block_size
        reserve = self.reserve_per_sequence * (self.num_running(m) + 1)
        remotes = [group.blocks for group in handoff.groups]
        short, beside = admission.prepare(
            s, hit, prompt - hits, 0, admitting=True, reserve=reserve, window_token=prompt, remotes=remotes
        )
        if short > 0:
            self.counters.handoffs_refused += 1
            return None
        m._seqs[seq_id] = s
        m._freed.pop(seq_id, None)
        copies = admission.take(s, hit, prompt - hits, 0, beside)
        self.receiving[seq_id] = id(s)
        seeded = handoff.cached
        delta = max(0, min(hits - seeded.total, prompt - seeded.total))
        cached = CachedTokens(seeded.device + delta, seeded.host, seeded.storage, num_prompt_tokens=prompt)
        self.usage[seq_id] = cached
        table = s.blocks()
        transfers = tuple(zip(handoff.source_blocks[kept:], table[kept:], strict=True))
        moves = [tuple(c.moves) if c is not None else () for c in copies]
        counters = self.counters
        counters.handoffs_accepted += 1
        counters.seeded_hit_tokens += seeded.total
        counters.decode_hit_tokens += delta
        counters.transferred_blocks += len(transfers) + sum(len(group) for group in moves)
        return DecodeAdmission(
            seq_id,
            m.block_table(seq_id),
            transfers,
            cached,
            group_tables=tuple(tuple(table) for table in m.block_tables(seq_id)),
            group_transfers=(transfers, *moves),
        )

    def receive_done(self, m: KVCacheManager, seq_id: Hashable, ok: bool) -> None:
        if seq_id not in self.receiving:
            m._get(seq_id)
            raise SequenceStateError(f"sequence {seq_id!r} is not receiving a handoff")
        del self.receiving[seq_id]
        if not ok:
            m.free(seq_id)
            return
        m.commit(seq_id, m.num_tokens(seq_id))

    def request_usage(self, m: KVCacheManager, seq_id: Hashable) -> RequestUsage:
        m._get(seq_id)
        cached = self.usage.get(seq_id)
        if cached is None:
            raise SequenceStateError(f"sequence {seq_id!r} did not arrive through a handoff")
        return RequestUsage(cached.num_prompt_tokens, cached)


class DecodeManager(KVCacheManager):
    """A :class:`KVCacheManager` in the decode role: accepts handoffs, keeps a growth reserve.

    It takes every argument :class:`KVCacheManager` takes (``tiers=``, ``groups=`` among them). Its own
    prefix cache (``enable_prefix_caching``) is optional: when on, a handoff's prompt is matched against it
    first and only the blocks beyond that prefix are transferred. Every group, like the full-attention
    pool, keeps ``reserve_blocks_per_sequence`` free per running sequence.

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

    role: ClassVar[str] = "decode"
    _role_component = DecodeRole
    _decode: DecodeRole

    def __init__(
        self, num_blocks: int, block_size: int, *, reserve_blocks_per_sequence: int = 1, **options: Any
    ) -> None:
        disagg = DisaggConfig(role="decode", reserve_blocks_per_sequence=reserve_blocks_per_sequence)
        super().__init__(num_blocks, block_size, disagg=disagg, **options)

    @property
    def decode_counters(self) -> DecodeCounters:
        return self._decode.counters

    @property
    def num_running(self) -> int:
        """Admitted sequences (receiving ones included): each is owed its growth reserve."""
        return self._decode.num_running(self)

    @property
    def reserve_blocks(self) -> int:
        """Blocks a new handoff may not take now: the growth reserve of the running sequences."""
        return self._decode.reserve_per_sequence * self.num_running

    def accept_handoff(
        self, handoff: PrefillHandoff, token_ids: Iterable[int], *, extras: BlockExtras | None = None
    ) -> DecodeAdmission | None:
        """Register and admit a prefilled sequence; None (and no change) if it would eat the reserve.

        ``token_ids`` is the prompt (the decode engine has it with the request); its hashes must
        be the handoff's, so a handoff can never be applied to the wrong prompt.
        """
        return self._decode.accept(self, handoff, token_ids, extras)

    def is_receiving(self, seq_id: Hashable) -> bool:
        return seq_id in self._decode.receiving

    def receive_done(self, seq_id: Hashable, *, ok: bool = True) -> None:
        """The handoff's KV arrived: the prompt counts as computed (and its full blocks become cached here).

        ``ok=False``: the transfer failed; the sequence is dropped and its blocks return to the pool.
        """
        self._decode.receive_done(self, seq_id, ok)

    def usage(self, seq_id: Hashable) -> RequestUsage:
        """The request's cached-token figure (prefill report + decode-side hit beyond it)."""
        return self._decode.request_usage(self, seq_id)
