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

When two sequences compute the same block at once (both allocated before either
committed), the first commit makes its block the tree node. The second keeps its
own copy private -- the engine already wrote KV into it -- and *pins* the node, so
that the prefix it builds on stays cached while it lives; the private copy goes
back to the fresh queue when the sequence is freed. A sequence therefore holds a
reference on every block of its table plus every pinned node, and a holder of a
node always holds the node's ancestors.

The manager is not thread-safe: call it from the scheduler's thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, ClassVar, TypeVar

from kvblocks.accounting import BlockLifetimes, CachedTokens, CacheStats, HitCounters
from kvblocks.config import CacheConfig, DisaggConfig
from kvblocks.core.coordinator import GroupCoordinator, split_groups
from kvblocks.core.groups.cross_group import _Cross
from kvblocks.core.groups.hits import longest_common_hit, needed_blocks
from kvblocks.core.groups.local_group import LocalGroupManager
from kvblocks.core.groups.protocol import Ask, GroupCopies
from kvblocks.core.groups.recurrent_group import StateCopy, _Recurrent
from kvblocks.core.groups.sources import take_blocks
from kvblocks.core.integrity import check_manager_integrity, check_release_order
from kvblocks.core.role import Role, RoleFactory
from kvblocks.core.sequence import _FREED_MEMORY, _NEVER, BlockTable
from kvblocks.core.sequence import _count_arg as _count_arg  # re-exported
from kvblocks.core.sequence import _Sequence as _Sequence  # re-exported
from kvblocks.core.step import run_step
from kvblocks.core.timed_tree import _TimedTree
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
from kvblocks.tiers.host import HostTier
from kvblocks.tiers.pending import TierStats, _Admission, _Pending
from kvblocks.tiers.stack import TierStack
from kvblocks.tiers.storage_tier import StorageTier
from kvblocks.tiers.tiering import Tiering
from kvblocks.tiers.transfers import AdmittedTable, LoadResult, TransferPlan

__all__ = ["BlockTable", "KVCacheManager"]

_M = TypeVar("_M", bound="KVCacheManager")


class KVCacheManager:
    """Prefix-caching block manager for one tier of device blocks.

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
    """

    role: ClassVar[str] = "mixed"
    """The node's role in prefill/decode disaggregation (see :mod:`kvblocks.disagg`)."""

    _role_component: ClassVar[RoleFactory | None] = None
    """What a role facade's managers own: its role's component, built from the manager and its configuration."""

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
        self.config = config
        self._block_size = config.block_size
        self._caching = config.enable_prefix_caching
        self._reserve = config.reserved_blocks
        self._drop_last = config.drop_last_matched_block
        self._hasher = BlockHasher(config.block_size, config.hash_scheme, config.namespace)
        self._pool = BlockPool(config.num_blocks, eviction=config.eviction)
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
            raise ConfigError(f"groups must be a sequence of layer groups, got {type(groups).__name__}")
        group, kind = (0, "full") if groups else (None, None)  # a hybrid manager tags every group's events
        self._tree = _TimedTree(
            self._pool, events=event_sink, group=group, group_kind=kind, block_size=config.block_size
        )
        self._seqs: dict[Hashable, _Sequence] = {}
        self._freed: OrderedDict[Hashable, None] = OrderedDict()
        self._counters = HitCounters()
        self._coordinator: GroupCoordinator | None = None  # the layer groups beside full attention, if any
        self._locals: list[LocalGroupManager] = []
        self._recurrents: list[_Recurrent] = []
        self._crosses: list[_Cross] = []
        self._encoder_tokens: dict[int, int] = {}  # id(_Sequence) -> encoder tokens, for sequences with any
        if groups:
            coordinator = GroupCoordinator(*split_groups(groups), chain_block_size=config.block_size, events=event_sink)
            self._coordinator = coordinator
            self._locals, self._recurrents = coordinator.locals, coordinator.recurrents
            self._crosses = coordinator.crosses
            self._encoder_tokens = coordinator.encoder_tokens
        self.tiers = tiers
        """The host and storage tiers' configuration (None: device blocks only)."""
        self._tiers: Tiering | None = None
        self._stack0: TierStack | None = None  # group 0's tiers
        if tiers is not None:
            if self._recurrents:
                raise ConfigError(
                    "tiers serve attention groups only: recurrent groups have no host or storage tier yet"
                )
            if self._crosses:
                raise ConfigError(
                    "tiers serve sliding-window and chunked-local groups; cross-attention groups have none"
                )
            for local in self._locals:
                local.require_block_per_position("a tiered manager")
            self._tiers = Tiering(tiers, config, self._pool, self._locals, events=event_sink, tag=(group, kind))
            self._stack0 = self._tiers.stacks[0]
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
        """The block pool (read it; change it only through the manager)."""
        return self._pool

    @property
    def tree(self) -> PrefixTree:
        """The prefix tree (read it; change it only through the manager)."""
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
        if self._tiers is not None and self._caching and not s.skip_read:
            self._probe(seq_id, s)

    def _probe(self, seq_id: Hashable, s: _Sequence) -> None:
        """Ask each group's storage (off-thread) which of the new sequence's blocks it holds, beyond what the
        group holds on device (and, for a local group, in its host tier)."""
        tiers: Tiering = self._tiers  # type: ignore[assignment]  # the caller checked
        hashes = s.content.hashes
        limit = self._cacheable_blocks(s.content.num_tokens)
        start = self._match_length(s)
        if start < limit:
            tiers.probe(seq_id, 0, hashes[start:limit])
        for local in self._locals:
            stack = local.tiers
            if stack is None or stack.storage is None:
                continue
            keys = local.keys(hashes)
            host = stack.host
            unknown = [
                key
                for key in (keys[p] for p in range(limit // local.ratio))
                if local.index.block_of(key) is None and (host is None or key not in host)
            ]
            tiers.probe(seq_id, local.number, unknown)

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
        return CachedTokens(len(device) * size, len(host) * size, loads * size, num_prompt_tokens=s.content.num_tokens)

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
        groups = self._coordinator
        return max(0, short, groups.growth_short(id(s), total)) if groups is not None else max(0, short)

    def can_allocate(self, seq_id: Hashable, num_new_tokens: int, *, num_lookahead_tokens: int = 0) -> bool:
        """Whether :meth:`allocate` would succeed now. Pure: never evicts."""
        return self.blocks_short(seq_id, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens) == 0

    def block_table(self, seq_id: Hashable) -> BlockTable:
        """The sequence's block table (empty when it is not admitted)."""
        view = self._get(seq_id).view
        return view if view is not None else BlockTable([])

    def block_tables(self, seq_id: Hashable) -> tuple[list[int], ...]:
        """One entry per layer group, group 0 first (copies; empty lists when not admitted): an attention group's
        table (a local group's holds PLACEHOLDER where released), a recurrent group's running state slot as a
        one-entry list. A manager of full attention only has one group, whose table is :meth:`block_table`'s."""
        s = self._get(seq_id)
        first = list(s.table or ())
        groups = self._coordinator
        return (first,) if groups is None else (first, *groups.tables(id(s)))

    def group_block_table(self, seq_id: Hashable, group: int) -> list[int]:
        """Group ``group``'s table of ``seq_id`` (a copy; 0: the full-attention table); PLACEHOLDER where a local
        group released a position. A recurrent group has no table (:meth:`state_slot` is its per-sequence state)."""
        s = self._get(seq_id)
        number = self._group(group)
        if number == 0:
            return list(s.table or ())
        return self._coordinator.table(number, id(s))  # type: ignore[union-attr]  # number > 0: there are groups

    def group_pool(self, group: int) -> BlockPool:
        """The block pool of group ``group``: group 0's is :attr:`pool`; a recurrent group's holds its checkpoints."""
        number = self._group(group)
        return self._pool if number == 0 else self._coordinator.pool(number)  # type: ignore[union-attr]

    @property
    def num_groups(self) -> int:
        """Groups of layers: full attention (0), then the local, recurrent and cross-attention groups."""
        groups = self._coordinator
        return 1 if groups is None else len(groups.kinds)

    @property
    def group_kinds(self) -> tuple[str, ...]:
        """Each group's kind, by group index."""
        groups = self._coordinator
        return ("full",) if groups is None else groups.kinds

    @property
    def hit_step(self) -> int:
        """Every hit is a multiple of this many tokens: each group's block size and checkpoint spacing divide it."""
        groups = self._coordinator
        return self._block_size if groups is None else groups.hit_step

    def _group(self, group: object) -> int:
        groups = self._coordinator
        if groups is None:
            if isinstance(group, bool) or group != 0 or type(group) is not int:
                raise ConfigError(f"group must be an int in [0, 1), got {group!r}")
            return 0
        return groups.number(group)

    def set_encoder_tokens(self, seq_id: Hashable, num_encoder_tokens: int) -> None:
        """How many encoder outputs ``seq_id``'s cross-attention layers attend to (0 by default).

        Give it before the admission: the cross-attention groups take their blocks then.
        """
        s = self._get(seq_id)
        count = _count_arg(num_encoder_tokens, "num_encoder_tokens")
        if s.table is not None:
            raise SequenceStateError(f"sequence {seq_id!r} is admitted: its encoder tokens are fixed until it leaves")
        if not self._crosses and count:
            raise InvalidArgumentError("this manager has no cross-attention group")
        if count:
            self._encoder_tokens[id(s)] = count
        else:
            self._encoder_tokens.pop(id(s), None)

    def state_slot(self, seq_id: Hashable, group: int) -> int:
        """The running state id of admitted ``seq_id`` in recurrent group ``group`` (what its forward pass updates)."""
        s = self._get(seq_id)
        slot = self._recurrent(group).slots.get(id(s))
        if slot is None:
            raise InvalidArgumentError(f"sequence {seq_id!r} is not admitted: it has no state slot")
        return slot

    def num_state_slots(self, group: int) -> int:
        """Running slots of recurrent group ``group``; its state ids ``num_state_slots(g) + c`` are checkpoints."""
        return self._recurrent(group).num_slots

    def _recurrent(self, group: object) -> _Recurrent:
        number = self._group(group)
        if self._coordinator is None or number == 0:
            raise InvalidArgumentError(f"group {number} is 'full', not recurrent")
        return self._coordinator.recurrent(number)

    def next_checkpoint(self, seq_id: Hashable) -> int | None:
        """The first token count after ``seq_id``'s committed line at which every recurrent group checkpoints.

        A scheduler that ends a prefill chunk there gets the prompt's state cached (a commit elsewhere
        takes no checkpoint). None without recurrent groups.
        """
        s = self._get(seq_id)
        step = self._coordinator.checkpoint_step if self._coordinator is not None else 0
        return (s.num_committed // step + 1) * step if step else None

    def take_state_plan(self) -> list[StateCopy]:
        """The state operations planned since the last call, to run in order before the next forward pass.

        Call it once per step, after the scheduling calls and before the forward pass, and run what it
        returns first: calling it again is what tells the manager the previous plan has run, so the
        checkpoints that plan saved become findable then (never earlier). See :mod:`kvblocks.hybrid.recurrent`.
        """
        return self._coordinator.take_state_plan() if self._coordinator is not None else []

    def state_plan_done(self) -> None:
        """Say that the plan :meth:`take_state_plan` handed out last has run, so that its checkpoints are
        findable at once (the next :meth:`take_state_plan` says it too; calling both is harmless).

        Without this call a checkpoint saved by the plan of step ``t`` is first findable by the admissions
        after the next ``take_state_plan``: a step later than it could be.
        """
        if self._coordinator is not None:
            self._coordinator.state_plan_done()

    @property
    def checkpoints_skipped(self) -> int:
        """Checkpoints not taken because every checkpoint of the group was being written or restored from."""
        return sum(r.skipped for r in self._recurrents)

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
        if self._coordinator is not None and tokens % self._coordinator.hit_step:
            raise InvalidArgumentError(
                f"num_cached_tokens must be a multiple of {self._coordinator.hit_step} (every group's block boundary "
                f"and checkpoint spacing), got {tokens}"
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
            table += self._take(need)
        elif need < 0:
            surplus = table[need:]
            del table[need:]
            self._pool._release_valid(reversed(surplus))
        s.num_covered = covered
        s.lookahead = lookahead
        if self._coordinator is not None and need:
            self._coordinator.resize(id(s), len(table))
        return True

    def _room_to_grow(self, s: _Sequence, need: int) -> bool:
        """Whether admitted ``s`` may take ``need`` more blocks now, in every layer group. Pure."""
        if need > self._pool.num_free:
            return False
        groups = self._coordinator
        return groups is None or groups.growth_short(id(s), len(s.table) + need) <= 0  # type: ignore[arg-type]

    def _admit(self, seq_id: Hashable, s: _Sequence, n: int, k: int, expected: int | None) -> BlockTable | None:
        """The admission of ``s``: every group keeps its cached blocks, copies in what its tiers hold and takes
        new ones, or nothing changes (None). With copies pending the table is an :class:`AdmittedTable` naming
        them, and the sequence is not ready (:meth:`is_ready`) until they are reported."""
        hit = self._hit(seq_id, s, expected)
        short, beside = self._prepare(s, hit, n, k, True)
        if beside is not None and None in beside[1]:  # only when the caller named a shorter hit than every group serves
            tokens = hit[0] * self._block_size
            raise StaleLookupError(
                f"sequence {seq_id!r}: a group no longer holds what the {tokens}-token hit seen needs"
            )
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
        if self._tiers is None:
            matched = self._match(s)
            if expected is not None:
                self._check_expected(seq_id, expected, len(matched))
                del matched[expected:]
            return len(matched), matched, _NO_BLOCKS, 0
        return self._tier_hit(s, seq_id, expected)

    def _tier_hit(self, s: _Sequence, seq_id: Hashable, expected: int | None) -> _Hit:
        """:meth:`_hit` through tiers: the hit every group serves from device or its tiers, group 0's device
        blocks within it, its host blocks after those, its storage loads after those. Pure; no I/O."""
        if not self._caching or s.skip_read:
            return 0, [], _NO_BLOCKS, 0
        content = s.content
        hashes = content.hashes
        limit = self._cacheable_blocks(content.num_tokens)
        matched = self._tree.matched_blocks(hashes, limit)
        device = len(matched)
        stack: TierStack = self._stack0  # type: ignore[assignment]  # a tiered manager's
        host = stack.host_run(hashes, device, limit)
        hit = device + len(host)
        hit += stack.stored_run(hashes, hit, limit)
        if self._coordinator is not None:
            hit = self._hit_within(hashes, hit, tiers=True)
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
        groups = self._coordinator
        if groups is None or (admitting and short > 0):
            return short, None
        tokens = hits * size
        encoder = self._encoder_tokens.get(id(s), 0) if self._crosses else 0
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
        copies = self._coordinator.take(id(s), *beside) if beside is not None else ()  # type: ignore[union-attr]
        device = len(matched)
        covered = hits * size + n
        need = (covered + k + size - 1) // size - device
        if device:
            self._pool._acquire_valid(matched)  # nodes the tree just matched: valid by construction
        if host:
            self._stack0.host.acquire(host)  # type: ignore[union-attr]  # before an eviction can write back into it
        if need:
            matched += self._take(need)
        s.table = matched
        s.view = BlockTable(matched, hits * size)
        s.num_covered = covered
        s.lookahead = k
        s.num_committed = device * size
        if beside is not None:
            s.watch = self._coordinator.next_move(hits * size)  # type: ignore[union-attr]
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
        """An admission's hits are final (at once here; once its copies settle with tiers): count them.

        The one place admissions are counted, so a role can also keep the figure per request.
        """
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
        if self._coordinator is not None:
            return self._hit_within(content.hashes, found)
        return found - 1 if found and self._drop_last else found

    def _match(self, s: _Sequence) -> list[int]:
        if not self._caching or s.skip_read:
            return []
        content = s.content
        matched = self._tree.matched_blocks(content.hashes, self._cacheable_blocks(content.num_tokens))
        if self._coordinator is not None:
            del matched[self._hit_within(content.hashes, len(matched)) :]  # one walk of the tree, not two
        elif matched and self._drop_last:
            matched.pop()
        return matched

    def _hit_within(self, hashes: Sequence[BlockHash], run: int, *, tiers: bool = False) -> int:
        """The hit (blocks) every group serves within full attention's leading ``run`` of cached blocks (from
        device, or ``tiers``: also from each group's tiers). Pure.

        With ``drop_last_matched_block`` the hit is the largest one every group serves below the
        common hit (the last block's tokens are computed again, as EAGLE needs their hidden states).
        """
        if not run:
            return 0
        size = self._block_size
        groups: GroupCoordinator = self._coordinator  # type: ignore[assignment]  # callers checked
        hit = groups.common_hit(hashes, run * size, tiers=tiers)
        if hit and self._drop_last:
            hit = groups.common_hit(hashes, hit - size, tiers=tiers)
        return hit // size

    def _take(self, count: int) -> list[int]:
        """``count`` fresh blocks of group 0, evicting idle leaves (written back when it has tiers)."""
        pool = self._pool
        if count <= pool.num_fresh:  # the common case: no eviction
            return pool.take_fresh(count)
        return take_blocks(pool, self._tree, self._stack0, count)

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
        """Cached blocks that committing blocks ``[start, stop)`` of ``s`` would pin while they are idle.

        Pinning one takes it out of the free supply, so a step counts them before it commits.
        """
        if not self._caching or stop <= start:
            return 0
        hashes = s.content.hashes
        table = s.table
        block_of = self._tree.block_of
        ref = self._pool._ref
        count = 0
        for position in range(start, stop):
            node = block_of(hashes[position])
            if node is not None and node != table[position] and not ref[node]:  # type: ignore[index]
                count += 1
        return count

    def _commit(self, s: _Sequence, n: int) -> None:
        """Commit a checked ``n``: blocks newly below the line enter the tree."""
        # Blocks fully below the old line are already in the tree (inserted, hit or pinned);
        # those newly below the new line go in now.
        size = self._block_size
        start = s.num_committed // size
        full = n // size
        if full > start and self._caching:
            tree = self._tree
            content = s.content
            # The tree's events name the blocks' tokens (package-private). stable: a sequence's hashes and
            # tokens only grow (HashedTokens.truncate replaces them), so its events read them when built.
            tokens = content._tokens if tree._events is not None and isinstance(content, HashedTokens) else None
            table: list[int] = s.table  # type: ignore[assignment]  # admitted: checked by the caller
            lora = s.lora_name
            existing = tree.insert(content.hashes, table, start, full, tokens=tokens, lora_name=lora, stable=True)
            if existing:
                self._pin_duplicates(s, start, existing)
        before = s.num_committed
        s.num_committed = n
        if n > s.num_covered:  # accepted drafts, committed in lookahead slots: they are allocated tokens now
            s.lookahead -= n - s.num_covered
            s.num_covered = n
        stack = self._stack0
        if full > start and stack is not None and stack.writes_through and self._caching:
            stack.written(self._tree.block_of, s.content.hashes, start, full)  # write-through, group 0
        groups = self._coordinator
        if groups is not None:
            s.watch = groups.committed(id(s), s.content.hashes, before, n, full > start and self._caching)

    # ------------------------------------------------------------------ the batched step

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

    def _pin_duplicates(self, s: _Sequence, start: int, existing: list[int]) -> None:
        table = s.table
        pins = s.pins if s.pins is not None else {}
        nodes = []
        for position, node in enumerate(existing, start):
            if node != table[position]:  # type: ignore[index]
                pins[position] = node
                nodes.append(node)
        self._pool.acquire(nodes)
        s.pins = pins

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
            self._encoder_tokens.pop(id(s), None)
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
            self._save_before_preempt(s)
        try:
            self._release(s)
        finally:
            if tiers is not None:
                tiers.hold_for = None
        s.preempted = True
        self._counters.preemptions += 1

    def _save_before_preempt(self, s: _Sequence) -> None:
        """Queue the committed blocks of ``s`` for storage; if any is, its release waits for the open plan."""
        stack: TierStack = self._stack0  # type: ignore[assignment]  # tiered
        pins = s.pins or {}
        table: list[int] = s.table  # type: ignore[assignment]  # admitted
        hashes = s.content.hashes
        saving = False
        for position in range(s.num_committed // self._block_size):
            saving |= stack.plan_save("device", pins.get(position, table[position]), hashes[position])
        if saving:
            self._tiers.hold_for = s  # type: ignore[union-attr]

    def _release(self, s: _Sequence) -> None:
        if s.table is None:
            return
        tiers = self._tiers
        if tiers is None:
            if self._coordinator is not None:
                self._coordinator.release(id(s))
            self._pool._release_valid(self._release_order(s))  # the manager's own table: valid by construction
        else:  # a copy in flight into its blocks, or a save of them, holds their release until its plan completes
            admission, copying = tiers.leave(s)
            if admission is not None:  # its hits are final now: what was on device
                cached = CachedTokens(admission.device * self._block_size, num_prompt_tokens=s.content.num_tokens)
                self._admitted(admission.seq_id, cached, admission.readmission)
            if self._coordinator is not None:
                self._coordinator.release(id(s), [part.deferred for part in copying.groups[1:]] if copying else ())
            held = copying or (tiers.open if tiers.hold_for is s else None)
            if held is None:
                self._pool._release_valid(self._release_order(s))
            else:
                held.groups[0].deferred.append(list(self._release_order(s)))
        self._clear_table(s)

    @staticmethod
    def _release_order(s: _Sequence) -> Iterable[int]:
        """The sequence's references, tail first (a pinned node right before its private copy's position)."""
        table = s.table
        if table is None:
            return ()
        pins = s.pins
        if not pins:
            return reversed(table)
        order = []
        for position in range(len(table) - 1, -1, -1):
            pinned = pins.get(position)
            if pinned is not None:
                order.append(pinned)
            order.append(table[position])
        return order

    @staticmethod
    def _clear_table(s: _Sequence) -> None:
        s.table = None
        s.view = None
        s.pins = None
        s.num_covered = s.num_committed = s.lookahead = 0
        s.watch = _NEVER

    def snapshot_events(self) -> list[BlockStored]:
        """The cache's contents as ``BlockStored`` events, parents first (``EventPublisher(snapshot=...)``). Pure.

        Every layer group's cached blocks are tagged with the group (a local group records chain parents only
        with an event sink); the tiered managers add their tiers' contents.
        """
        events = self._tree.snapshot_events()
        if self._coordinator is not None:
            events += self._coordinator.snapshot_events()
        if self._tiers is not None:
            events += self._tiers.snapshot_events()
        return events

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (after a weight update, say), the host tiers' too. Refused (False) while any
        block is in use or copies are pending."""
        groups = self._coordinator
        tiers = self._tiers
        if tiers is not None and tiers.busy:
            return False
        if self._pool.num_in_use or (groups is not None and groups.busy):  # a state plan's checkpoint would return
            return False
        self._tree.clear()
        if groups is not None:
            groups.clear()
        if tiers is not None:
            tiers.clear_hosts()
        return True

    # ------------------------------------------------------------------ tiers: copies between device, host, storage

    @property
    def host(self) -> HostTier | None:
        """Group 0's host tier (read it; change it only through the manager); None without one."""
        return self._stack0.host if self._stack0 is not None else None

    @property
    def storage(self) -> StorageTier | None:
        """Group 0's storage tier; None without one."""
        return self._stack0.storage if self._stack0 is not None else None

    def group_host(self, group: int) -> HostTier | None:
        """Group ``group``'s host tier (0: :attr:`host`); read it, change it only through the manager."""
        number = self._group(group)
        return self._tiers.stacks[number].host if self._tiers is not None and number < len(self._tiers.stacks) else None

    def group_storage(self, group: int) -> StorageTier | None:
        """Group ``group``'s storage tier (0: :attr:`storage`); a local group's has keys and a format of its own."""
        number = self._group(group)
        tiers = self._tiers
        return tiers.stacks[number].storage if tiers is not None and number < len(tiers.stacks) else None

    def is_ready(self, seq_id: Hashable) -> bool:
        """Whether the sequence has no copies pending (it may run and commit)."""
        s = self._get(seq_id)
        return self._tiers is None or id(s) not in self._tiers.admissions

    @property
    def num_pending_admissions(self) -> int:
        return len(self._tiers.admissions) if self._tiers is not None else 0

    @property
    def num_pending_loads(self) -> int:
        """Storage reads of every group not yet reported by :meth:`poll_loads`."""
        return self._tiers.num_pending_loads if self._tiers is not None else 0

    def is_storage_check_pending(self, seq_id: Hashable) -> bool:
        """Whether a storage check :meth:`add_sequence` queued for ``seq_id``, in any group, is unanswered. Pure.

        A sequence registered and admitted in the same step sees no storage hits from that check
        (``lookup`` never waits on I/O). An engine that prefers storage hits to recomputing can leave such a
        sequence waiting a step or two while this is True; a dropped probe (a full queue) or a check already
        answered is False.
        """
        self._get(seq_id)
        return self._tiers is not None and self._tiers.is_storage_check_pending(seq_id)

    def take_transfers(self) -> TransferPlan:
        """The copies this step's scheduling calls planned, one :class:`GroupTransfers` per group; run them in
        order, then :meth:`complete_transfers` (see :mod:`kvblocks.tiers.tiering`). Empty without tiers."""
        if self._tiers is None:
            return TransferPlan(0, ())
        return self._tiers.take_transfers()

    def complete_transfers(
        self,
        plan: TransferPlan,
        *,
        saved: Mapping[int, Sequence[object]] | Sequence[object] | None = None,
        failed_swap_ins: Mapping[int, Collection[int]] | Collection[int] = (),
        failed_swap_outs: Mapping[int, Collection[int]] | Collection[int] = (),
        saved_groups: Mapping[int, Sequence[object]] | None = None,
        failed_group_swap_ins: Mapping[int, Collection[int]] | None = None,
        failed_group_swap_outs: Mapping[int, Collection[int]] | None = None,
    ) -> None:
        """Report that ``plan`` ran. Each argument maps a group to its figures (``{0: ...}`` for one group).

        ``saved[g]`` holds the payload of each of ``plan.group_transfers[g].saves`` (one bytes-like per block,
        or one per rank): they are queued for storage; without it the saves are dropped and counted.
        ``failed_swap_ins[g]`` / ``failed_swap_outs[g]`` name group ``g``'s device / host blocks whose copy
        failed: a failed swap-in leaves its host block a host hit, and the admission's hit is cut back to the
        longest one every group still serves with what landed (the engine computes the rest); a failed
        swap-out host block becomes free. Every argument is checked before anything changes.

        The previous release's forms are still taken: group 0's figures bare (not in a mapping), and the
        other groups' in ``saved_groups``, ``failed_group_swap_ins``, ``failed_group_swap_outs``.
        """
        tiers = self._tiers
        previous = (saved_groups, failed_group_swap_ins, failed_group_swap_outs)
        if tiers is None:
            if not isinstance(plan, TransferPlan):
                raise InvalidArgumentError(f"expected a TransferPlan, got {type(plan).__name__}")
            if plan or any(previous) or failed_swap_ins or failed_swap_outs:
                raise InvalidArgumentError("this manager has no tiers: its plans move nothing")
            return
        for admission in tiers.complete_transfers(plan, saved, failed_swap_ins, failed_swap_outs, previous):
            if admission.settled:
                self._settle(admission)

    def poll_loads(self) -> list[LoadResult]:
        """Storage reads of every group that finished (or timed out) since the last poll. Never waits.

        Group 0's results first, then each local group's (``group`` set; its ``blocks`` are that group's
        device blocks). A read is reported only once the plan of the step that admitted its sequence was
        taken, so a block evicted in that step is saved before a load overwrites it. An admission settles
        once every group's reads and copies are reported.
        """
        tiers = self._tiers
        if tiers is None:
            return []
        results = []
        for number, admission, outcome, timed_out in tiers.poll_loads():
            pending: _Pending = admission.groups[number]  # type: ignore[assignment]  # it had loads
            loads = pending.copies.loads
            payloads = outcome.payloads[: len(loads)]
            pending.loaded = {p for _, p in loads[: len(payloads)]}
            pending.request = -1
            if number == 0 and self._usable_hit(admission, hopeful=True) <= loads[0][1]:
                payloads = ()  # the hit broke before the stored blocks: they are of no use
            blocks = tuple(d for d, _ in loads[: len(payloads)])
            results.append(LoadResult(admission.seq_id, blocks, payloads, len(loads), timed_out, group=number))
            if admission.settled:
                self._settle(admission)
        return results

    def _usable_hit(self, admission: _Admission, *, hopeful: bool = False) -> int:
        """The leading chain blocks of a pending admission every group serves with the copies that landed
        (``hopeful``: counting a read not yet reported as landed, and a swap-in not yet reported as failed)."""
        groups = admission.groups
        run = admission.hit
        first = groups[0]
        if first is not None:
            landed = _landed(first, hopeful)
            run = admission.device
            while run < admission.hit and run in landed:
                run += 1
        if not self._locals:
            return run
        size = self._block_size
        answers = []
        whole = run == admission.hit  # every group got every block the hit needs: the hit stands
        for local, pending in zip(self._locals, groups[1:], strict=True):
            held = set(needed_blocks(local.rule, admission.hit * size))  # what the group holds for the hit ...
            if pending is not None:  # ... but the blocks its copies fill only once they landed
                copies = pending.copies
                moved = {p for _, _, p in copies.swaps} | {p for _, p in copies.loads}
                landed = _landed(pending, hopeful)
                whole = whole and moved <= landed
                held = (held - moved) | landed
            answers.append(held.__contains__)
        if whole:
            return run
        return longest_common_hit([local.rule for local in self._locals], run * size, answers) // size

    def _settle(self, admission: _Admission) -> None:
        """Every copy of ``admission`` was reported: its hits count, the usable leading run becomes committed
        and findable, the rest of every table goes back and the engine computes those tokens."""
        s = admission.seq
        tiers: Tiering = self._tiers  # type: ignore[assignment]
        del tiers.admissions[id(s)]
        size = self._block_size
        valid = self._usable_hit(admission)
        device = min(admission.device, valid)
        first = admission.groups[0]
        host_ok = min(len(first.copies.swaps) if first is not None else 0, valid - device)
        stored = valid - device - host_ok
        cached = CachedTokens(device * size, host_ok * size, stored * size, num_prompt_tokens=s.content.num_tokens)
        self._admitted(admission.seq_id, cached, admission.readmission)
        table = s.table
        if table is None:
            raise IntegrityError(f"pending admission of {admission.seq_id!r} lost its table")
        if valid < admission.hit:
            self._cut_back(s, valid)
        if valid > admission.device:
            self._commit(s, valid * size)
        if self._caching:
            for local in self._locals:
                local.index_landed(id(s), s.content.hashes, s.num_committed)

    def _cut_back(self, s: _Sequence, valid: int) -> None:
        """A copy failed: every table keeps what a hit of ``valid`` blocks needs, the rest (never committed) goes
        back, and the sequence allocates its remaining tokens again (draft slots included)."""
        table: list[int] = s.table  # type: ignore[assignment]  # settling an admitted sequence
        dropped = table[valid:]
        del table[valid:]
        self._pool._release_valid(reversed(dropped))  # never committed: back to the fresh queue
        size = self._block_size
        s.num_covered = valid * size
        s.num_committed = min(s.num_committed, s.num_covered)
        s.lookahead = 0
        for local in self._locals:
            local.cut_back(id(s), valid, size)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every group's queued storage writes are done (shutdown, tests). True if they are."""
        return self._tiers.flush(timeout) if self._tiers is not None else True

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop every group's storage threads (queued writes get ``timeout`` seconds each) and close the backend."""
        if self._tiers is not None:
            self._tiers.close(timeout)

    def __enter__(self: _M) -> _M:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        """Leaving the ``with`` block closes the manager (its storage threads stop), also on an exception."""
        self.close()

    @property
    def tier_stats(self) -> TierStats:
        """The tiers' counters (all zero without tiers)."""
        if self._tiers is None:
            return TierStats(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, None, None)
        return self._tiers.stats()

    # ------------------------------------------------------------------ statistics and checks

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
        """Raise :class:`IntegrityError` on any broken invariant of the pool, the tree, the groups, the tiers,
        the sequences or the role."""
        check_manager_integrity(self)
        if self._tiers is not None:
            self._tiers.check(self._block_size, self._device_block_of)
        if self._role is not None:
            self._role.check()

    def _device_block_of(self, group: int, key: BlockHash) -> int | None:
        return self._tree.block_of(key) if group == 0 else self._locals[group - 1].index.block_of(key)

    def _window_tokens(self, s: _Sequence) -> int:
        """The token the windows of ``s`` are placed at: its committed line, or the hit a pending admission
        will have, or the prompt's end while a decode node receives it."""
        tiers = self._tiers
        admission = tiers.admissions.get(id(s)) if tiers is not None else None
        if admission is not None:
            return admission.hit * self._block_size
        if self._role is not None:
            return self._role.window_token(s)
        return s.num_committed

    def _count_other_local_holders(self, index: int, expected: list[int]) -> None:
        """Add references on local group ``index``'s blocks held by something other than the tables (a copy in
        flight into a freed sequence's blocks)."""
        if self._tiers is not None:
            self._tiers.count_deferred(index + 1, expected)

    def _count_other_holders(self, expected: list[int]) -> None:
        """Add references held by something other than sequences' tables and pins (a plan's deferred releases)."""
        if self._tiers is not None:
            self._tiers.count_deferred(0, expected)

    def _check_release_order(self) -> None:
        """A node in use has its parent in use; with LRU, an idle node was released before its idle parent
        (another policy's order is its own: it keeps a blocked parent until its children are gone)."""
        check_release_order(self)

    # ------------------------------------------------------------------ internals

    def _get(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            detail = "it was freed" if seq_id in self._freed else ""
            raise UnknownSequenceError(seq_id, detail) from None
        except TypeError:
            raise InvalidArgumentError(f"sequence id must be hashable, got {type(seq_id).__name__}") from None


def _landed(pending: _Pending, hopeful: bool) -> set[int]:
    """The positions of one group's copies that landed (``hopeful``: those not reported yet count as landed)."""
    copies = pending.copies
    landed: set[int] = set()
    if pending.swapped is not None:
        landed |= pending.swapped
    elif hopeful:
        landed.update(p for _, _, p in copies.swaps)
    if pending.loaded is not None:
        landed |= pending.loaded
    elif hopeful:
        landed.update(p for _, p in copies.loads)
    return landed


_NO_BLOCKS: list[int] = []  # the host blocks of an untiered hit (never changed)
_Hit = tuple[int, list[int], list[int], int]
"""An admission's hit: (chain blocks, group 0's device blocks, its host blocks after them, its storage loads)."""
_Beside = tuple[Ask, list[tuple[int, Any] | None]]
"""The other groups' part of an admission: what they were asked, and their answers."""
