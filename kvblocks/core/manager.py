"""KVCacheManager: the request-level API an engine's scheduler calls.

One sequence, block size 4, a 10-token prompt whose first 8 tokens are cached::

    tokens              | a b c d | e f g h | i j . . |
    lookup(s)           |<---- 8 cached --->|              never the last token: its logits are needed
    allocate(s, 2)      [ hit     , hit     , new     ]    the table covers 8 + 2 = 10 tokens
    commit(s, 10)       only full blocks below the line enter the tree (the only way a block becomes
                        findable: a block whose KV is not reported written is never handed out)
    free(s)             references drop tail first, so the tail is evicted before the head

One class, composed of parts it owns (docs/architecture.md); not thread-safe (the scheduler's thread)::

    KVCacheManager      the request registry, validation, the order of calls, counting
      GroupCoordinator  group 0 (full attention: pool, prefix tree) and one group manager per group
                        beside it, by kind; Admission: the common hit and two-phase admission
      Tiering           (tiers=) a TierStack per attention group, the step's plans, pending copies
      a role            (a PrefillManager / DecodeManager facade) the requests moving between nodes
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import ClassVar, TypeVar

from kvblocks.accounting import BlockLifetimes, CachedTokens, CacheStats, HitCounters
from kvblocks.config import CacheConfig, DisaggConfig
from kvblocks.core.admission import Admission
from kvblocks.core.coordinator import GroupCoordinator
from kvblocks.core.eviction import DEFAULT_EVICTION
from kvblocks.core.groups.full_group import FullAttentionGroup
from kvblocks.core.manager_groups import GroupCalls
from kvblocks.core.manager_tiers import TierCalls
from kvblocks.core.pool import BlockPool
from kvblocks.core.prefix_tree import PrefixTree
from kvblocks.core.role import Role, RoleFactory, role_for
from kvblocks.core.sequence import _FREED_MEMORY, BlockTable, hashed_content
from kvblocks.core.sequence import _count_arg as _count_arg  # re-exported
from kvblocks.core.sequence import _Sequence as _Sequence  # re-exported
from kvblocks.core.step import commit_checked, run_step
from kvblocks.errors import (
    CommitOutOfRangeError,
    ConfigError,
    DoubleFreeError,
    DuplicateSequenceError,
    IntegrityError,
    InvalidArgumentError,
    InvalidTokenError,
    SequenceStateError,
    StaleLookupError,
    UnknownSequenceError,
)
from kvblocks.events import BlockStored, EventSink
from kvblocks.hashing import (
    DEFAULT_SCHEME,
    BlockExtras,
    BlockHash,
    BlockHasher,
    Namespace,
)
from kvblocks.tiers.config import TierConfig
from kvblocks.tiers.tiering import Tiering

__all__ = ["BlockTable", "KVCacheManager"]

_M = TypeVar("_M", bound="KVCacheManager")


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

    Its group calls and tier calls are kept in modules of their own (:mod:`kvblocks.core.manager_groups`,
    :mod:`kvblocks.core.manager_tiers`).
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
        (:mod:`kvblocks.core.eviction`); ``tiers``: host and storage tiers under every attention group
        (:mod:`kvblocks.tiers`); ``groups``: the layer groups beside full attention of a hybrid model
        (:mod:`kvblocks.core.coordinator`); ``disagg``: the node's role (a role facade's: see
        :mod:`kvblocks.disagg`); the other arguments are :class:`~kvblocks.config.CacheConfig`'s."""
        cache = (num_blocks, block_size, hash_scheme, namespace, enable_prefix_caching, reserved_blocks)
        config = CacheConfig(*cache, drop_last_matched_block=drop_last_matched_block, eviction=eviction)
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
        self._hasher = BlockHasher(config.block_size, config.hash_scheme, config.namespace)
        tag = (0, "full") if groups else (None, None)  # a hybrid manager tags every group's events
        full = FullAttentionGroup(config, event_sink, tag)
        self._full = full
        self._pool = full.pool  # the hot paths read group 0's pool and tree directly
        self._tree = full.tree
        self._groups = GroupCoordinator(full, groups, chain_block_size=config.block_size, events=event_sink)
        self._beside = self._groups if self._groups.groups else None  # None: no group beside full attention
        self._locals, self._recurrents = self._groups.locals, self._groups.recurrents
        self._crosses = self._groups.crosses
        self._seqs: dict[Hashable, _Sequence] = {}
        self._freed: OrderedDict[Hashable, None] = OrderedDict()
        self._counters = HitCounters()
        self.tiers = tiers  # the host and storage tiers' configuration (None: device blocks only)
        self._tiers = None if tiers is None else Tiering.under(self._groups, tiers, config, events=event_sink, tag=tag)
        self._admission = Admission(config, self._groups, self._tiers)
        self._role: Role | None = role_for(self, type(self)._role_component, disagg)
        self._step_marks = 0  # the number of the last batched step that checked its sequences for repeats
        self._guards_changes = self._tiers is not None or self._role is not None  # the step checks every entry then

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
        content = hashed_content(self._hasher, token_ids, extras, block_hashes, num_tokens)
        if content.num_tokens == 0:
            raise InvalidTokenError(f"sequence {seq_id!r} has no tokens; a prompt needs at least one")
        if not isinstance(skip_cache_read, bool):
            raise InvalidArgumentError(f"skip_cache_read must be a bool, got {skip_cache_read!r}")
        s = self._seqs[seq_id] = _Sequence(content, skip_cache_read)
        if extras is not None:
            s.lora_name, s.lora_id = extras.lora, extras.lora_id
        self._freed.pop(seq_id, None)
        tiers = self._tiers
        if tiers is not None and self._caching and not skip_cache_read:  # which blocks does storage hold?
            limit = self._admission.cacheable_blocks(content.num_tokens)
            tiers.probe(seq_id, content.hashes, self._admission.match_length(s), limit)

    def append_tokens(self, seq_id: Hashable, token_ids: Iterable[int]) -> None:
        """Append tokens (decode output); full blocks they complete are hashed now, once."""
        self._get(seq_id).content.extend(token_ids)

    # ------------------------------------------------------------------ pure queries

    def lookup(self, seq_id: Hashable) -> CachedTokens:
        """How many leading tokens are cached now. Pure: no references, no eviction, no statistics.

        The last token is never counted: the engine must compute it to get logits.
        """
        return self._admission.cached(self._get(seq_id))

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
        probe = _Sequence(hashed_content(self._hasher, token_ids, extras, block_hashes, num_tokens))
        return self._admission.cached(probe)

    def blocks_short(self, seq_id: Hashable, num_new_tokens: int, *, num_lookahead_tokens: int = 0) -> int:
        """How many blocks ``allocate(seq_id, num_new_tokens, ...)`` would lack now (0: it would succeed), the most
        any layer group lacks. Pure.

        An admission must leave ``reserved_blocks`` free; a running sequence's growth may use them.
        """
        s = self._get(seq_id)
        n = _count_arg(num_new_tokens, "num_new_tokens")
        k = _count_arg(num_lookahead_tokens, "num_lookahead_tokens")
        if s.table is None:
            admission = self._admission
            return max(0, admission.prepare(s, admission.hit(seq_id, s, None), n, k)[0])
        size = self._block_size
        total = (s.num_covered + n + k + size - 1) // size
        short = total - len(s.table) - self._pool.num_free
        groups = self._beside
        return max(0, short, groups.growth_short(id(s), total)) if groups is not None else max(0, short)

    def can_allocate(self, seq_id: Hashable, num_new_tokens: int, *, num_lookahead_tokens: int = 0) -> bool:
        """Whether :meth:`allocate` would succeed now. Pure: never evicts."""
        return self.blocks_short(seq_id, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens) == 0

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens the sequence has (its prompt and what was appended)."""
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
        if self._guards_changes:
            self._check_can_change(seq_id, s, "grow")
        if s.table is None:
            return self._admit(seq_id, s, n, k, self._admission.expected(num_cached_tokens))
        if num_cached_tokens is not None:
            raise InvalidArgumentError(f"sequence {seq_id!r} is admitted: num_cached_tokens is for admissions")
        covered = s.num_covered + n
        if k == s.lookahead and (covered + k + self._block_size - 1) // self._block_size == len(s.table):
            s.num_covered = covered  # the common decode call: the slots fit in the table as it is
            return s.view
        return s.view if self._groups.grow(s, covered, k) else None

    def _check_can_change(self, seq_id: Hashable, s: _Sequence, what: str) -> None:
        """Raise if ``s`` may not grow or commit now: copies are pending (commit), or its role refuses."""
        tiers = self._tiers
        if tiers is not None and what == "commit" and id(s) in tiers.admissions:
            raise SequenceStateError(f"sequence {seq_id!r} has transfers pending: complete them before commit")
        if self._role is not None:
            self._role.guard(seq_id, what)

    # ------------------------------------------------------------------ admission

    def _admit(self, seq_id: Hashable, s: _Sequence, n: int, k: int, expected: int | None) -> BlockTable | None:
        """The admission of ``s`` (:mod:`kvblocks.core.admission`): every group keeps its cached blocks, copies in
        what its tiers hold and takes new ones, or nothing changes (None). With copies pending the table is an
        :class:`AdmittedTable` naming them, and the sequence is not ready (:meth:`is_ready`) until they land."""
        admission = self._admission
        hit = admission.hit(seq_id, s, expected)
        short, beside = admission.prepare(s, hit, n, k, True)
        if beside is not None and None in beside[1]:  # only when the caller named a shorter hit than every group serves
            tokens = hit[0] * self._block_size
            raise StaleLookupError(f"sequence {seq_id!r}: a group no longer holds what the {tokens}-token hit needs")
        if short > 0:
            return None
        copies = admission.take(s, hit, n, k, beside)
        hits, _, host, loads = hit
        if not host and not loads and (beside is None or not any(copies)):
            cached = CachedTokens.counted(hits * self._block_size, s.content.num_tokens)
            self._admitted(seq_id, cached, s.preempted)
            return s.view
        return admission.pend(seq_id, s, hit, copies)

    def _admitted(self, seq_id: Hashable, cached: CachedTokens, readmission: bool) -> None:
        """An admission's hits are final (at once, or once its copies settle): the one place they are counted."""
        self._counters.record(cached, readmission=readmission)
        if self._role is not None:
            self._role.admitted(seq_id, cached)

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
        slots = s.num_covered + s.lookahead  # the full check only where it may refuse:
        if s.table is None or self._guards_changes or not s.num_committed <= n <= slots or n > s.content.num_tokens:
            self._check_commit(seq_id, s, n)
        if n // self._block_size == s.num_committed // self._block_size and n <= s.num_covered and n < s.watch:
            s.num_committed = n  # as step has it: no block newly full, nothing watched, nothing enters an index
        else:
            self._commit(s, n)

    def _check_commit(self, seq_id: Hashable, s: _Sequence, n: int, appended: int = 0) -> None:
        """Raise unless ``commit(seq_id, n)`` is valid once ``appended`` more tokens are known."""
        if s.table is None:
            raise SequenceStateError(f"sequence {seq_id!r} is not admitted: allocate before commit")
        if self._guards_changes:
            self._check_can_change(seq_id, s, "commit")
        known = s.content.num_tokens + appended
        slots = s.num_covered + s.lookahead
        if n < s.num_committed or n > slots or n > known:
            raise CommitOutOfRangeError(
                f"commit({seq_id!r}, {n}): must be within [{s.num_committed}, "
                f"{min(slots, known)}] (last commit {s.num_committed}, "
                f"{slots} tokens allocated, {known} tokens known)"
            )

    _commit = commit_checked  # the one commit rule, in the compiled step module (typed there): commit and step
    """Commit a checked ``n`` (:func:`kvblocks.core.step.commit_checked`)."""

    def step(
        self,
        seq_ids: Sequence[Hashable],
        num_computed_tokens: Sequence[int | None] | None = None,
        new_token_ids: Sequence[Iterable[int] | None] | None = None,
        num_new_tokens: int | Sequence[int] = 1,
        num_lookahead_tokens: int | Sequence[int] = 0,
    ) -> list[Hashable]:
        """One scheduling step for running sequences: append each one's sampled tokens, commit what the forward
        pass wrote, give it slots for the next; returns the ids that could not get their slots (nothing changed
        for them). The whole rule: :func:`kvblocks.core.step.run_step`."""
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
        deferred: Sequence[list[list[int]] | None] = ()  # every group releases at once
        if tiers is not None:  # a copy in flight into its blocks, or a save of them, holds their release
            admission, deferred = tiers.leave(s)
            if admission is not None:  # its hits are final now: what was on device
                cached = CachedTokens(admission.device * self._block_size, num_prompt_tokens=s.content.num_tokens)
                self._admitted(admission.seq_id, cached, admission.readmission)
        self._groups.release(s, deferred)
        s.clear_table()

    # ------------------------------------------------------------------ the cache as a whole

    def snapshot_events(self) -> list[BlockStored]:
        """The cache's contents as ``BlockStored`` events, parents first (``EventPublisher(snapshot=...)``). Pure.

        Every layer group's cached blocks are tagged with the group (a local group records chain parents only
        with an event sink), then every tier's contents.
        """
        events = self._groups.snapshot_events()
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
        lifetimes = self._tree.lifetimes
        if lifetimes is None:  # pragma: no cover - the full group's tree always records them
            raise IntegrityError("the device tree records no block lifetimes")
        return lifetimes

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
            tiers.check(self._block_size, self._groups.device_block_of)
        if self._role is not None:
            self._role.check(self)

    def _window_tokens(self, s: _Sequence) -> int:
        """The token the windows of ``s`` are placed at: its committed line, or the hit a pending admission
        will have, or the prompt's end while a decode node receives it."""
        tiers = self._tiers
        admission = tiers.admissions.get(id(s)) if tiers is not None else None
        if admission is not None:
            return admission.hit * self._block_size
        return self._role.window_token(s) if self._role is not None else s.num_committed

    def _get(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            detail = "it was freed" if seq_id in self._freed else ""
            raise UnknownSequenceError(seq_id, detail) from None
        except TypeError:
            raise InvalidArgumentError(f"sequence id must be hashable, got {type(seq_id).__name__}") from None
