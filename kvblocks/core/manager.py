"""KVCacheManager: the request-level API an engine's scheduler calls.

One sequence, block size 4, a 10-token prompt whose first 8 tokens are cached::

    tokens              | a b c d | e f g h | i j . . |
    lookup(s)           |<---- 8 cached --->|              never the last token: its logits are needed
    allocate(s, 2)      [ hit     , hit     , new     ]    the table covers 8 + 2 = 10 tokens
    commit(s, 10)       only full blocks below the line enter the tree; block 2 is partial
    append_tokens(s, [k]); allocate(s, 1); commit(s, 11)   ...one decode step
    free(s)             references drop tail first, so the tail is evicted before the head

``commit`` is the only way a block becomes findable: a block whose KV the engine
has not reported written is never handed to another sequence.

The manager is one class, composed of parts it owns (:mod:`kvblocks.core`, docs/architecture.md)::

    KVCacheManager      the request registry, validation, the order of calls, counting
      GroupCoordinator  group 0 (full attention: pool, prefix tree) and the groups beside it, one
                        group manager per kind; the common hit and two-phase admission over them
      Tiering           (tiers=) a TierStack per attention group, the step's plans, pending copies
      a role            (a PrefillManager / DecodeManager facade) the requests moving between nodes

The manager is not thread-safe: call it from the scheduler's thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, ClassVar, TypeVar

from kvblocks.accounting import BlockLifetimes, CachedTokens, CacheStats, HitCounters
from kvblocks.config import CacheConfig, DisaggConfig
from kvblocks.core.coordinator import GroupCoordinator
from kvblocks.core.groups.full_group import FullAttentionGroup
from kvblocks.core.groups.protocol import Ask, GroupCopies
from kvblocks.core.manager_groups import GroupCalls
from kvblocks.core.manager_tiers import TierCalls
from kvblocks.core.role import Role, RoleFactory
from kvblocks.core.sequence import _FREED_MEMORY, _NEVER, BlockTable
from kvblocks.core.sequence import _count_arg as _count_arg  # re-exported
from kvblocks.core.sequence import _Sequence as _Sequence  # re-exported
from kvblocks.core.step import run_step
from kvblocks.errors import (
    CommitOutOfRangeError,
    ConfigError,
    DoubleFreeError,
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidTokenError,
    SequenceStateError,
    StaleLookupError,
    UnknownSequenceError,
)
from kvblocks.events import BlockStored, EventSink
from kvblocks.eviction import DEFAULT_EVICTION
from kvblocks.hashing import (
    DEFAULT_SCHEME,
    BlockExtras,
    BlockHash,
    BlockHasher,
    HashedTokens,
    Namespace,
    PrecomputedHashes,
)
from kvblocks.pool import BlockPool
from kvblocks.radix import PrefixTree
from kvblocks.tiers.config import TierConfig
from kvblocks.tiers.tiering import Tiering
from kvblocks.tiers.transfers import AdmittedTable

__all__ = ["BlockTable", "KVCacheManager"]

_M = TypeVar("_M", bound="KVCacheManager")
_Hit = tuple[int, list[int], list[int], int]
"""An admission's hit: (chain blocks, group 0's device blocks, its host blocks after them, its storage loads)."""
_Beside = tuple[Ask, list[tuple[int, Any] | None]]
"""The other groups' part of an admission: what they were asked, and their answers."""
_NO_BLOCKS: list[int] = []  # the host blocks of an untiered hit (never changed)


class KVCacheManager(GroupCalls, TierCalls):
    """Prefix-caching block manager: the one manager of every combination of layer groups, tiers and roles.

    >>> m = KVCacheManager(num_blocks=8, block_size=4)
    >>> m.add_sequence("a", list(range(10)))
    >>> m.lookup("a").device                      # nothing cached yet
    0
    >>> list(m.allocate("a", 10))                 # 10 tokens -> 3 blocks
    [0, 1, 2]
    >>> m.commit("a", 10)                         # KV written: blocks 0 and 1 are full, enter the tree
    >>> m.free("a")
    >>> m.add_sequence("b", list(range(10)) + [99])
    >>> m.lookup("b").device                      # b shares a's two full blocks
    8

    Its group calls (:class:`~kvblocks.core.manager_groups.GroupCalls`) and tier calls
    (:class:`~kvblocks.core.manager_tiers.TierCalls`) are kept in modules of their own.
    """

    role: ClassVar[str] = "mixed"
    """The node's role in prefill/decode disaggregation (see :mod:`kvblocks.disagg`)."""

    _role_component: ClassVar[RoleFactory | None] = None
    """A role facade's role: its component, built from the manager and its configuration."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        hash_scheme: str = DEFAULT_SCHEME,
        namespace: str | Namespace = "default",
        enable_prefix_caching: bool = True,
        event_sink: EventSink | None = None,
        reserved_blocks: int = 0,
        drop_last_matched_block: bool = False,
        eviction: str = DEFAULT_EVICTION,
        tiers: TierConfig | None = None,
        groups: Sequence[object] = (),
        disagg: DisaggConfig | None = None,
    ) -> None:
        """``eviction``: which idle block goes first, ``"lru"`` (default) or ``"s3fifo"``
        (:mod:`kvblocks.eviction`); ``tiers``: host and storage tiers under every attention group
        (:mod:`kvblocks.tiers`); ``groups``: the layer groups beside full attention of a hybrid model
        (:mod:`kvblocks.core.coordinator`); ``disagg``: the node's role (a role facade's: see
        :mod:`kvblocks.disagg`); the other arguments are :class:`~kvblocks.config.CacheConfig`'s."""
        config = CacheConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            hash_scheme=hash_scheme,
            namespace=namespace,
            enable_prefix_caching=enable_prefix_caching,
            reserved_blocks=reserved_blocks,
            drop_last_matched_block=drop_last_matched_block,
            eviction=eviction,
        )
        self._setup(config, event_sink, tiers, groups, disagg)

    @classmethod
    def from_config(
        cls: type[_M],
        config: CacheConfig,
        *,
        tiers: TierConfig | None = None,
        groups: Sequence[object] = (),
        disagg: DisaggConfig | None = None,
        event_sink: EventSink | None = None,
    ) -> _M:
        """The manager for ``config``, over ``tiers``, with the layer ``groups`` beside full attention, in the
        class's role (``disagg``: its configuration)."""
        manager = cls.__new__(cls)
        manager._setup(config, event_sink, tiers, groups, disagg)
        return manager

    def _setup(
        self,
        config: CacheConfig,
        event_sink: EventSink | None,
        tiers: TierConfig | None,
        groups: Sequence[object],
        disagg: DisaggConfig | None,
    ) -> None:
        if not isinstance(config, CacheConfig):
            raise InvalidArgumentError(f"config must be a CacheConfig, got {type(config).__name__}")
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
            raise ConfigError(f"groups must be a sequence of layer groups, got {type(groups).__name__}")
        self.config = config
        self._block_size = config.block_size
        self._caching = config.enable_prefix_caching
        self._reserve = config.reserved_blocks
        self._drop_last = config.drop_last_matched_block
        self._hasher = BlockHasher(config.block_size, config.hash_scheme, config.namespace)
        tag = (0, "full") if groups else (None, None)  # a hybrid manager tags every group's events
        full = FullAttentionGroup(config, event_sink, tag)
        self._full = full
        self._pool = full.pool  # the hot paths read group 0's pool and tree directly
        self._tree = full.tree
        self._groups = GroupCoordinator(full, groups, chain_block_size=config.block_size, events=event_sink)
        self._beside = self._groups if self._groups.groups else None  # None: no group beside full attention
        self._locals, self._recurrents, self._crosses = (
            self._groups.locals,
            self._groups.recurrents,
            self._groups.crosses,
        )
        self._seqs: dict[Hashable, _Sequence] = {}
        self._freed: OrderedDict[Hashable, None] = OrderedDict()
        self._counters = HitCounters()
        self.tiers = tiers
        """The host and storage tiers' configuration (None: device blocks only)."""
        self._tiers: Tiering | None = None
        if tiers is not None:
            if self._recurrents or self._crosses:
                raise ConfigError("tiers serve attention groups: recurrent and cross-attention groups have none")
            for local in self._locals:
                local.require_block_per_position("a tiered manager")
            self._tiers = Tiering(tiers, config, full.pool, self._locals, events=event_sink, tag=tag)
            full.tiers = self._tiers.stacks[0]
        disagg = DisaggConfig(role=self.role) if disagg is None else disagg
        if not isinstance(disagg, DisaggConfig):
            raise ConfigError(f"disagg must be a DisaggConfig, got {type(disagg).__name__}")
        if disagg.role != self.role:
            raise ConfigError(f"a {type(self).__name__} runs in the {self.role} role, not {disagg.role!r}")
        component = type(self)._role_component
        self._role: Role | None = None if component is None else component(self, disagg)
        self._guards_changes = tiers is not None or self._role is not None
        """Whether :meth:`_check_can_change` may refuse (a role or pending copies): the step checks every entry."""

    # ------------------------------------------------------------------ properties

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can obtain now (fresh plus evictable)."""
        return self._pool.num_free

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    @property
    def pool(self) -> BlockPool:
        """Group 0's block pool (read it; change it only through the manager)."""
        return self._pool

    @property
    def tree(self) -> PrefixTree:
        """Group 0's prefix tree (read it; change it only through the manager)."""
        return self._tree

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    # ------------------------------------------------------------------ registration

    def add_sequence(
        self,
        seq_id: Hashable,
        token_ids: Iterable[int] | None = None,
        *,
        extras: BlockExtras | None = None,
        block_hashes: Iterable[BlockHash] | None = None,
        num_tokens: int | None = None,
        skip_cache_read: bool = False,
    ) -> None:
        """Register a sequence by its token ids (copied), or by precomputed block hashes.

        With ``block_hashes`` (one per full block, as a router or trace has them),
        ``num_tokens`` gives the prompt length and ``token_ids`` must be None; such a
        sequence cannot :meth:`append_tokens`. ``skip_cache_read``: the sequence never takes a
        hit (every prompt token is computed, as prompt logprobs need) but its blocks are still
        cached when committed.
        """
        try:
            registered = seq_id in self._seqs
        except TypeError:
            raise InvalidArgumentError(f"sequence id must be hashable, got {type(seq_id).__name__}") from None
        if registered:
            raise DuplicateSequenceError(f"sequence {seq_id!r} is already registered")
        content = self._content(token_ids, extras, block_hashes, num_tokens)
        if content.num_tokens == 0:
            raise InvalidTokenError(f"sequence {seq_id!r} has no tokens; a prompt needs at least one")
        if not isinstance(skip_cache_read, bool):
            raise InvalidArgumentError(f"skip_cache_read must be a bool, got {skip_cache_read!r}")
        s = self._seqs[seq_id] = _Sequence(content, skip_cache_read)
        if extras is not None:
            s.lora_name = extras.lora
        self._freed.pop(seq_id, None)
        tiers = self._tiers
        if tiers is not None and self._caching and not skip_cache_read:  # which blocks does storage hold?
            tiers.probe(seq_id, content.hashes, self._match_length(s), self._cacheable_blocks(content.num_tokens))

    def _content(
        self,
        token_ids: Iterable[int] | None,
        extras: BlockExtras | None,
        block_hashes: Iterable[BlockHash] | None,
        num_tokens: int | None,
    ) -> HashedTokens | PrecomputedHashes:
        """A prompt's hashed content, from its token ids (and extras) or from its block hashes."""
        if extras is not None and not isinstance(extras, BlockExtras):
            raise InvalidArgumentError(f"extras must be a BlockExtras, got {type(extras).__name__}")
        if block_hashes is not None:
            if token_ids is not None or extras is not None:
                raise InvalidArgumentError("give either token_ids (and extras) or block_hashes, not both")
            if num_tokens is None:
                raise InvalidArgumentError("block_hashes needs num_tokens, the prompt length")
            return PrecomputedHashes(block_hashes, num_tokens, self._block_size)
        if token_ids is None:
            raise InvalidArgumentError("a prompt needs token_ids or block_hashes")
        if num_tokens is not None:
            raise InvalidArgumentError("num_tokens is only for sequences given by block_hashes")
        return HashedTokens(self._hasher, token_ids, extras)

    def append_tokens(self, seq_id: Hashable, token_ids: Iterable[int]) -> None:
        """Append tokens (decode output); full blocks they complete are hashed now, once."""
        self._get(seq_id).content.extend(token_ids)

    # ------------------------------------------------------------------ pure queries

    def lookup(self, seq_id: Hashable) -> CachedTokens:
        """How many leading tokens are cached now. Pure: no references, no eviction, no statistics.

        The last token is never counted: the engine must compute it to get logits.
        """
        return self._cached(self._get(seq_id))

    def match(
        self,
        token_ids: Iterable[int] | None = None,
        *,
        extras: BlockExtras | None = None,
        block_hashes: Iterable[BlockHash] | None = None,
        num_tokens: int | None = None,
    ) -> CachedTokens:
        """What :meth:`lookup` would report for a prompt, without registering it. Pure.

        For routers, schedulers and tests: the same rules as an admission (the last token is
        never counted; ``drop_last_matched_block`` applies), nothing is kept.
        """
        probe = _Sequence(self._content(token_ids, extras, block_hashes, num_tokens))
        return self._cached(probe)

    def _cached(self, s: _Sequence) -> CachedTokens:
        """The hit ``s`` would take now: group 0's device / host / storage split of the hit every group serves."""
        size = self._block_size
        if self._tiers is None:
            return CachedTokens(device=self._match_length(s) * size, num_prompt_tokens=s.content.num_tokens)
        _, device, host, loads = self._tier_hit(s, None, None)
        prompt = s.content.num_tokens
        return CachedTokens(len(device) * size, len(host) * size, loads * size, num_prompt_tokens=prompt)

    def blocks_short(self, seq_id: Hashable, num_new_tokens: int, *, num_lookahead_tokens: int = 0) -> int:
        """How many blocks ``allocate(seq_id, num_new_tokens, ...)`` would lack now (0: it would succeed), the most
        any layer group lacks. Pure.

        An admission must leave ``reserved_blocks`` free; a running sequence's growth may use them.
        """
        s = self._get(seq_id)
        n = _count_arg(num_new_tokens, "num_new_tokens")
        k = _count_arg(num_lookahead_tokens, "num_lookahead_tokens")
        if s.table is None:
            return max(0, self._prepare(s, self._hit(seq_id, s, None), n, k)[0])
        size = self._block_size
        total = (s.num_covered + n + k + size - 1) // size
        short = total - len(s.table) - self._pool.num_free
        groups = self._beside
        return max(0, short, groups.growth_short(id(s), total)) if groups is not None else max(0, short)

    def can_allocate(self, seq_id: Hashable, num_new_tokens: int, *, num_lookahead_tokens: int = 0) -> bool:
        """Whether :meth:`allocate` would succeed now. Pure: never evicts."""
        return self.blocks_short(seq_id, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens) == 0

    def block_table(self, seq_id: Hashable) -> BlockTable:
        """The sequence's block table (empty when it is not admitted)."""
        view = self._get(seq_id).view
        return view if view is not None else BlockTable([])

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._get(seq_id).content.num_tokens

    def num_computed_tokens(self, seq_id: Hashable) -> int:
        """Tokens whose KV is written (the last commit, or the hit the admission took)."""
        return self._get(seq_id).num_committed

    def num_allocated_tokens(self, seq_id: Hashable) -> int:
        """Tokens the sequence has slots for, its lookahead (draft) slots included; 0 when not admitted."""
        s = self._get(seq_id)
        return s.num_covered + s.lookahead

    def token_ids(self, seq_id: Hashable) -> tuple[int, ...] | None:
        """The sequence's tokens (None for a sequence given by block hashes)."""
        return self._get(seq_id).content.token_ids

    def block_hashes(self, seq_id: Hashable) -> tuple[BlockHash, ...]:
        """Hashes of the sequence's full blocks so far."""
        return tuple(self._get(seq_id).content.hashes)

    def is_admitted(self, seq_id: Hashable) -> bool:
        return self._get(seq_id).table is not None

    # ------------------------------------------------------------------ lifecycle

    def allocate(
        self,
        seq_id: Hashable,
        num_new_tokens: int,
        *,
        num_lookahead_tokens: int = 0,
        num_cached_tokens: int | None = None,
    ) -> BlockTable | None:
        """Grant slots for ``num_new_tokens`` more tokens, or change nothing and return None.

        The first call (admission) starts the table with the cached prefix and records the
        admission's hit statistics; ``num_new_tokens`` counts from the hit it takes, which
        :meth:`num_computed_tokens` reports. Pass the hit you saw as ``num_cached_tokens``
        (``lookup(...).total``) to take exactly that hit: if the cache no longer holds it, the
        admission raises :class:`StaleLookupError` and changes nothing, so a table can never
        cover less than the caller computes. New blocks come from the fresh queue first, then by
        evicting idle leaves; an admission leaves ``reserved_blocks`` free.

        ``num_lookahead_tokens`` reserves slots for that many draft tokens after the new ones
        (speculative decoding). They are not cumulative: each call says how many it wants now,
        slots of rejected drafts are reused, and the table never exceeds
        ``ceil((allocated tokens + lookahead) / block_size)`` blocks.
        """
        s = self._get(seq_id)
        n = num_new_tokens
        if type(n) is not int or n < 0:
            n = _count_arg(n, "num_new_tokens")
        k = num_lookahead_tokens
        if k and (type(k) is not int or k < 0):
            k = _count_arg(k, "num_lookahead_tokens")
        self._check_can_change(seq_id, s, "grow")
        if s.table is None:
            return self._admit(seq_id, s, n, k, self._expected_hit(num_cached_tokens))
        if num_cached_tokens is not None:
            raise InvalidArgumentError(f"sequence {seq_id!r} is admitted: num_cached_tokens is for admissions")
        return s.view if self._grow(s, s.num_covered + n, k) else None

    def _expected_hit(self, num_cached_tokens: object) -> int | None:
        """The hit the caller saw, in blocks (None: take the hit there is now)."""
        if num_cached_tokens is None:
            return None
        tokens = _count_arg(num_cached_tokens, "num_cached_tokens")
        if tokens % self._block_size:
            raise InvalidArgumentError(
                f"num_cached_tokens must be a multiple of the block size {self._block_size}, got {tokens}"
            )
        step = self._groups.hit_step
        if tokens % step:
            raise InvalidArgumentError(
                f"num_cached_tokens must be a multiple of {step} (every group's block boundary and checkpoint "
                f"spacing), got {tokens}"
            )
        return tokens // self._block_size

    def _check_can_change(self, seq_id: Hashable, s: _Sequence, what: str) -> None:
        """Raise if ``s`` may not grow or commit now: its copies are pending (commit), or its role refuses
        (a sequence being handed off)."""
        tiers = self._tiers
        if tiers is not None and what == "commit" and id(s) in tiers.admissions:
            raise SequenceStateError(f"sequence {seq_id!r} has transfers pending: complete them before commit")
        if self._role is not None:
            self._role.guard(seq_id, what)

    def _grow(self, s: _Sequence, covered: int, lookahead: int) -> bool:
        """Give admitted ``s`` slots for ``covered`` tokens plus ``lookahead`` drafts, or change nothing (False).

        Blocks beyond what that needs (a smaller lookahead than before) go back to the pool: they
        lie past every committed and every allocated token, so nothing in them is cached.
        """
        table = s.table
        if table is None:  # pragma: no cover - callers grow admitted sequences only
            raise SequenceStateError("only an admitted sequence grows")
        size = self._block_size
        need = (covered + lookahead + size - 1) // size - len(table)
        if need > 0:
            if not self._room_to_grow(s, need):
                return False
            table += self._full.take(need)
        elif need < 0:
            surplus = table[need:]
            del table[need:]
            self._pool._release_valid(reversed(surplus))
        s.num_covered = covered
        s.lookahead = lookahead
        if self._beside is not None and need:
            self._beside.resize(id(s), len(table))
        return True

    def _room_to_grow(self, s: _Sequence, need: int) -> bool:
        """Whether admitted ``s`` may take ``need`` more blocks now, in every layer group. Pure."""
        if need > self._pool.num_free:
            return False
        groups = self._beside
        return groups is None or groups.growth_short(id(s), len(s.table) + need) <= 0  # type: ignore[arg-type]

    # ------------------------------------------------------------------ admission

    def _admit(self, seq_id: Hashable, s: _Sequence, n: int, k: int, expected: int | None) -> BlockTable | None:
        """The admission of ``s``: every group keeps its cached blocks, copies in what its tiers hold and takes
        new ones, or nothing changes (None). With copies pending the table is an :class:`AdmittedTable` naming
        them, and the sequence is not ready (:meth:`is_ready`) until they are reported."""
        hit = self._hit(seq_id, s, expected)
        short, beside = self._prepare(s, hit, n, k, True)
        if beside is not None and None in beside[1]:  # only when the caller named a shorter hit than every group serves
            tokens = hit[0] * self._block_size
            raise StaleLookupError(f"sequence {seq_id!r}: a group no longer holds what the {tokens}-token hit needs")
        if short > 0:
            return None
        copies = self._take_admission(s, hit, n, k, beside)
        hits, _, host, loads = hit
        if not host and not loads and (beside is None or not any(copies)):
            cached = CachedTokens(device=hits * self._block_size, num_prompt_tokens=s.content.num_tokens)
            self._admitted(seq_id, cached, s.preempted)
            return s.view
        return self._pend(seq_id, s, hit, copies)

    def _hit(self, seq_id: Hashable, s: _Sequence, expected: int | None) -> _Hit:
        """The hit an admission of ``s`` takes now (``expected``: exactly that many blocks, the caller's lookup):
        (blocks, group 0's device blocks, its host blocks after them, its storage loads after those). Pure."""
        if self._tiers is not None:
            return self._tier_hit(s, seq_id, expected)
        matched = self._match(s)
        if expected is not None:
            self._check_expected(seq_id, expected, len(matched))
            del matched[expected:]
        return len(matched), matched, _NO_BLOCKS, 0

    def _tier_hit(self, s: _Sequence, seq_id: Hashable, expected: int | None) -> _Hit:
        """:meth:`_hit` through tiers: the hit every group serves from device or its tiers. Pure; no I/O."""
        if not self._caching or s.skip_read:
            return 0, [], _NO_BLOCKS, 0
        content = s.content
        hashes = content.hashes
        limit = self._cacheable_blocks(content.num_tokens)
        matched = self._tree.matched_blocks(hashes, limit)
        device = len(matched)
        stack = self._tiers.stacks[0]  # type: ignore[union-attr]  # the caller checked
        host = stack.host_run(hashes, device, limit)
        hit = device + len(host)
        hit += stack.stored_run(hashes, hit, limit)
        if self._beside is not None:
            hit = self._hit_within(hashes, hit, True)
        elif hit and self._drop_last:
            hit -= 1
        if expected is not None:
            self._check_expected(seq_id, expected, hit)
            hit = expected
        if device > hit:
            del matched[hit:]
            device = hit
        host = host[: hit - device]
        return hit, matched, host, hit - device - len(host)

    def _prepare(
        self,
        s: _Sequence,
        hit: _Hit,
        n: int,
        k: int,
        admitting: bool = False,
        *,
        reserve: int = 0,
        window_token: int | None = None,
        remotes: Sequence[Sequence[int]] = (),
    ) -> tuple[int, _Beside | None]:
        """The first phase of an admission taking ``hit``: (blocks the neediest group lacks, every other
        group's answer). Pure. ``admitting``: skip the other groups when full attention lacks room;
        ``reserve``: blocks every group leaves free besides; ``window_token``, ``remotes``: a handoff's."""
        hits, matched, _, _ = hit
        size = self._block_size
        total = (hits * size + n + k + size - 1) // size
        pool = self._pool
        short = total - len(matched) + reserve - (pool.num_free - pool.count_idle(matched) - self._reserve)
        groups = self._beside
        if groups is None or (admitting and short > 0):
            return short, None
        tokens = hits * size
        encoder = groups.encoder_tokens.get(id(s), 0) if self._crosses else 0
        window = tokens if window_token is None else window_token
        ask = Ask(s.content.hashes, hits, total, tokens, window, encoder, reserve, s.content.num_tokens, tokens + n)
        answers = groups.answers(ask, remotes)
        for answer in answers:
            if answer is not None and answer[0] > short:
                short = answer[0]
        return short, (ask, answers)

    def _take_admission(
        self, s: _Sequence, hit: _Hit, n: int, k: int, beside: _Beside | None
    ) -> Sequence[GroupCopies | None]:
        """The second phase: every group takes what :meth:`_prepare` found room for (the caller checked); the
        table covers the hit, ``n`` new tokens and ``k`` drafts. Returns the other groups' copies."""
        hits, matched, host, _ = hit
        size = self._block_size
        copies = self._beside.take(id(s), *beside) if beside is not None else ()  # type: ignore[union-attr]
        device = len(matched)
        covered = hits * size + n
        need = (covered + k + size - 1) // size - device
        if device:
            self._pool._acquire_valid(matched)  # nodes the tree just matched: valid by construction
        if host:
            self._tiers.stacks[0].host.acquire(host)  # type: ignore[union-attr]  # before an eviction writes back
        if need:
            matched += self._full.take(need)
        s.table = matched
        s.view = BlockTable(matched, hits * size)
        s.num_covered = covered
        s.lookahead = k
        s.num_committed = device * size
        if beside is not None:
            s.watch = self._groups.next_move(hits * size)
        return copies

    def _pend(self, seq_id: Hashable, s: _Sequence, hit: _Hit, copies: Sequence[GroupCopies | None]) -> AdmittedTable:
        """Hand an admission's copies to the tiers: pending until every one is reported."""
        hits, _, host, loads = hit
        table: list[int] = s.table  # type: ignore[assignment]  # just admitted
        device = s.num_committed // self._block_size
        start = device + len(host)
        swaps = [(h, table[p], p) for p, h in enumerate(host, device)]
        group0 = GroupCopies(swaps, [(table[p], p) for p in range(start, start + loads)]) if host or loads else None
        self._tiers.pend(seq_id, s, hits, device, [group0, *copies])  # type: ignore[union-attr]
        hashes = s.content.hashes
        view = AdmittedTable(
            table,
            tuple((h, d) for h, d, _ in swaps),
            tuple((table[p], hashes[p]) for p in range(start, start + loads)),
            hits * self._block_size,
        )
        s.view = view
        return view

    def _check_expected(self, seq_id: Hashable, expected: int, available: int) -> None:
        if expected > available:
            raise StaleLookupError(
                f"sequence {seq_id!r}: the lookup saw {expected * self._block_size} cached tokens, the cache holds "
                f"{available * self._block_size} now; look up again"
            )

    def _admitted(self, seq_id: Hashable, cached: CachedTokens, readmission: bool) -> None:
        """An admission's hits are final (at once, or once its copies settle): the one place they are counted."""
        self._counters.record(cached, readmission=readmission)
        if self._role is not None:
            self._role.admitted(seq_id, cached)

    def _cacheable_blocks(self, num_tokens: int) -> int:
        """Full blocks a prefix hit may cover: never the one holding the last token, whose logits are needed."""
        return (num_tokens - 1) // self._block_size

    def _match_length(self, s: _Sequence) -> int:
        """How many leading blocks of ``s`` every group serves now (the device hit). Pure."""
        if not self._caching or s.skip_read:
            return 0
        content = s.content
        found = self._tree.match_length(content.hashes, self._cacheable_blocks(content.num_tokens))
        if self._beside is not None:
            return self._hit_within(content.hashes, found)
        return found - 1 if found and self._drop_last else found

    def _match(self, s: _Sequence) -> list[int]:
        """Group 0's blocks of the device hit of ``s`` (:meth:`_match_length` of them). Pure."""
        if not self._caching or s.skip_read:
            return []
        content = s.content
        matched = self._tree.matched_blocks(content.hashes, self._cacheable_blocks(content.num_tokens))
        if self._beside is not None:
            del matched[self._hit_within(content.hashes, len(matched)) :]  # one walk of the tree, not two
        elif matched and self._drop_last:
            matched.pop()
        return matched

    def _hit_within(self, hashes: Sequence[BlockHash], run: int, tiers: bool = False) -> int:
        """The hit (blocks) every group serves within full attention's leading ``run`` of cached blocks (from
        device, or ``tiers``: also from each group's tiers). Pure.

        With ``drop_last_matched_block`` the hit is the largest one every group serves below the
        common hit (the last block's tokens are computed again, as EAGLE needs their hidden states).
        """
        if not run:
            return 0
        size = self._block_size
        groups = self._groups
        hit = groups.common_hit(hashes, run * size, tiers)
        if hit and self._drop_last:
            hit = groups.common_hit(hashes, hit - size, tiers)
        return hit // size

    # ------------------------------------------------------------------ commit and the batched step

    def commit(self, seq_id: Hashable, num_computed_tokens: int) -> None:
        """Report that the first ``num_computed_tokens`` tokens' KV is written.

        Full blocks below that line become findable by other sequences. The value
        counts from the sequence's start (cached prefix included), never decreases,
        and cannot pass the allocated slots (lookahead slots included: accepted drafts
        are committed there) or the known tokens.
        """
        s = self._get(seq_id)
        n = num_computed_tokens
        if type(n) is not int:
            n = _count_arg(n, "num_computed_tokens")
        self._check_commit(seq_id, s, n)
        self._commit(s, n)

    def _check_commit(self, seq_id: Hashable, s: _Sequence, n: int, appended: int = 0) -> None:
        """Raise unless ``commit(seq_id, n)`` is valid once ``appended`` more tokens are known."""
        if s.table is None:
            raise SequenceStateError(f"sequence {seq_id!r} is not admitted: allocate before commit")
        self._check_can_change(seq_id, s, "commit")
        known = s.content.num_tokens + appended
        slots = s.num_covered + s.lookahead
        if n < s.num_committed or n > slots or n > known:
            raise CommitOutOfRangeError(
                f"commit({seq_id!r}, {n}): must be within [{s.num_committed}, "
                f"{min(slots, known)}] (last commit {s.num_committed}, "
                f"{slots} tokens allocated, {known} tokens known)"
            )

    def _idle_duplicates(self, s: _Sequence, start: int, stop: int) -> int:
        """Cached blocks that committing blocks ``[start, stop)`` of ``s`` would pin while they are idle."""
        return self._full.idle_duplicates(s, start, stop)

    def _commit(self, s: _Sequence, n: int) -> None:
        """Commit a checked ``n``: blocks newly below the line enter every group's index."""
        # Blocks fully below the old line are already in the tree (inserted, hit or pinned);
        # those newly below the new line go in now.
        size = self._block_size
        start = s.num_committed // size
        full = n // size
        cache = full > start and self._caching
        if cache:
            self._full.cache(s, start, full)
        before = s.num_committed
        s.num_committed = n
        if n > s.num_covered:  # accepted drafts, committed in lookahead slots: they are allocated tokens now
            s.lookahead -= n - s.num_covered
            s.num_covered = n
        groups = self._beside
        if groups is not None:
            s.watch = groups.committed(id(s), s.content.hashes, before, n, cache)

    def step(
        self,
        seq_ids: Sequence[Hashable],
        num_computed_tokens: Sequence[int | None] | None = None,
        new_token_ids: Sequence[Iterable[int] | None] | None = None,
        num_new_tokens: int | Sequence[int] = 1,
        num_lookahead_tokens: int | Sequence[int] = 0,
    ) -> list[Hashable]:
        """One scheduling step for running sequences; returns the ids that could not get their slots.

        For each sequence ``seq_ids[i]``, in order: append ``new_token_ids[i]`` (the sampled token,
        or the accepted drafts and the bonus token), commit ``num_computed_tokens[i]`` (what the
        forward pass wrote, accepted drafts included; None keeps the last commit), then give it
        slots for the next forward pass: ``num_new_tokens[i]`` tokens after its committed line (1
        for decode, the next chunk for chunked prefill) plus ``num_lookahead_tokens[i]`` draft
        slots. ``allocate`` counts from its covered slots; ``step`` counts from the committed
        line, as an engine reasons::

            block size 4, decode, one draft slot (k=1)
            before      | a b c d | e f . . |        committed 6, known 6
            step(["r"], [6], [[g]], 1, 1)            g appended: 7 known
            after       | a b c d | e f g * |        slots for 7 + 1 draft; 6 committed

        A sequence that cannot get its slots is returned, and nothing changed for it (its entry
        may be sent again, e.g. after preempting another sequence). Bad input anywhere in the batch
        raises before anything changes. Same rules, same results as the per-sequence calls.
        """
        return run_step(self, seq_ids, num_computed_tokens, new_token_ids, num_new_tokens, num_lookahead_tokens)

    # ------------------------------------------------------------------ leaving

    def free(self, seq_id: Hashable) -> None:
        """Release the sequence's blocks (tail first) and forget it."""
        if self._role is not None:
            self._role.leaving(seq_id, freeing=True)  # a role refuses a sequence it is moving between nodes
        try:
            s = self._seqs.pop(seq_id)
        except KeyError:
            if seq_id in self._freed:
                raise DoubleFreeError(f"sequence {seq_id!r} was already freed") from None
            raise UnknownSequenceError(seq_id) from None
        self._release(s)
        if self._crosses:
            self._groups.encoder_tokens.pop(id(s), None)
        if self._tiers is not None:
            self._tiers.probes.pop(seq_id, None)
        if self._role is not None:
            self._role.forget(seq_id)
        freed = self._freed
        freed[seq_id] = None
        if len(freed) > _FREED_MEMORY:
            freed.popitem(last=False)

    def preempt(self, seq_id: Hashable) -> None:
        """Release the sequence's blocks but keep it registered; its next admission counts apart.

        With ``TierConfig.save_on_preempt``, its committed blocks are first queued for storage, and they stay
        held until the plan that saves them completes."""
        if self._role is not None:
            self._role.leaving(seq_id, freeing=False)
        s = self._get(seq_id)
        if s.table is None:
            raise SequenceStateError(f"sequence {seq_id!r} is not admitted; there is nothing to preempt")
        tiers = self._tiers
        if tiers is not None and tiers.save_on_preempt and id(s) not in tiers.admissions and self._caching:
            tiers.save_before_preempt(s, self._block_size)
        try:
            self._release(s)
        finally:
            if tiers is not None:
                tiers.hold_for = None
        s.preempted = True
        self._counters.preemptions += 1

    def _release(self, s: _Sequence) -> None:
        if s.table is None:
            return
        tiers = self._tiers
        if tiers is None:
            if self._beside is not None:
                self._beside.release(id(s))
            self._full.release(s)
        else:  # a copy in flight into its blocks, or a save of them, holds their release until its plan completes
            admission, copying = tiers.leave(s)
            if admission is not None:  # its hits are final now: what was on device
                cached = CachedTokens(admission.device * self._block_size, num_prompt_tokens=s.content.num_tokens)
                self._admitted(admission.seq_id, cached, admission.readmission)
            if self._beside is not None:
                self._beside.release(id(s), [part.deferred for part in copying.groups[1:]] if copying else ())
            held = copying or (tiers.open if tiers.hold_for is s else None)
            self._full.release(s, held.groups[0].deferred if held is not None else None)
        s.table = None
        s.view = None
        s.pins = None
        s.num_covered = s.num_committed = s.lookahead = 0
        s.watch = _NEVER

    # ------------------------------------------------------------------ the cache as a whole

    def snapshot_events(self) -> list[BlockStored]:
        """The cache's contents as ``BlockStored`` events, parents first (``EventPublisher(snapshot=...)``). Pure.

        Every layer group's cached blocks are tagged with the group (a local group records chain parents only
        with an event sink), then every tier's contents.
        """
        events = self._tree.snapshot_events()
        if self._beside is not None:
            events += self._beside.snapshot_events()
        if self._tiers is not None:
            events += self._tiers.snapshot_events()
        return events

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (after a weight update, say), the host tiers' too. Refused (False) while any
        block is in use or copies are pending."""
        groups = self._groups
        tiers = self._tiers
        if (tiers is not None and tiers.busy) or self._pool.num_in_use or groups.busy:
            return False  # (a state plan's checkpoint would come back)
        self._tree.clear()
        groups.clear()
        if tiers is not None:
            tiers.clear_hosts()
        return True

    @property
    def stats(self) -> CacheStats:
        pool = self._pool
        return CacheStats(
            **self._counters.as_dict(),
            evicted_blocks=self._tree.num_evicted,
            num_blocks=pool.num_blocks,
            blocks_in_use=pool.num_in_use,
            blocks_cached=len(self._tree),
            blocks_fresh=pool.num_fresh,
        )

    @property
    def block_lifetimes(self) -> BlockLifetimes:
        """Histograms of evicted device blocks' lifetime (allocation to eviction) and idle time (last release to
        eviction), in seconds of ``pool.clock``. Live objects: read them, do not change them."""
        return self._tree.lifetimes

    def check_integrity(self) -> None:
        """Raise :class:`IntegrityError` on any broken invariant of the groups, the tiers, the sequences or the
        role."""
        tiers = self._tiers
        self._full.check_integrity(self._seqs, tiers.deferred(0) if tiers is not None else ())
        live = {
            id(s): (seq_id, len(s.table), self._window_tokens(s))
            for seq_id, s in self._seqs.items()
            if s.table is not None
        }
        self._groups.check_integrity(live, {id(s) for s in self._seqs.values()}, tiers)
        if tiers is not None:
            tiers.check(self._block_size, self._device_block_of)
        if self._role is not None:
            self._role.check()

    def _window_tokens(self, s: _Sequence) -> int:
        """The token the windows of ``s`` are placed at: its committed line, or the hit a pending admission
        will have, or the prompt's end while a decode node receives it."""
        tiers = self._tiers
        admission = tiers.admissions.get(id(s)) if tiers is not None else None
        if admission is not None:
            return admission.hit * self._block_size
        return self._role.window_token(s) if self._role is not None else s.num_committed

    def _device_block_of(self, group: int, key: BlockHash) -> int | None:
        return self._tree.block_of(key) if group == 0 else self._locals[group - 1].index.block_of(key)

    def _get(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            detail = "it was freed" if seq_id in self._freed else ""
            raise UnknownSequenceError(seq_id, detail) from None
        except TypeError:
            raise InvalidArgumentError(f"sequence id must be hashable, got {type(seq_id).__name__}") from None
