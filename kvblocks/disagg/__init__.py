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

from __future__ import annotations

import json
import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from kvblocks.accounting import CachedTokens
from kvblocks.config import CacheConfig
from kvblocks.core.groups import kind_rules
from kvblocks.errors import (
    AccountingError,
    ConfigError,
    DuplicateSequenceError,
    HandoffError,
    IntegrityError,
    InvalidArgumentError,
    InvalidBlockHashError,
    SequenceStateError,
)
from kvblocks.events import EventSink
from kvblocks.hashing import (
    DEFAULT_SCHEME,
    BlockExtras,
    BlockHash,
    HashedTokens,
    Namespace,
    hashes_from_json,
    hashes_to_json,
)
from kvblocks.manager import BlockTable, KVCacheManager, _Sequence
from kvblocks.strict_json import MAX_INT, StrictJSONError, brief, is_text, parse
from kvblocks.tiers.config import TierConfig
from kvblocks.tiers.manager import TieredKVCacheManager

__all__ = [
    "HANDOFF_VERSION",
    "ROLES",
    "DecodeAdmission",
    "DecodeManager",
    "DisaggConfig",
    "GROUPS_HANDOFF_VERSION",
    "HANDOFF_GROUP_KINDS",
    "LOCAL_GROUP_KINDS",
    "HandoffGroup",
    "PrefillHandoff",
    "PrefillManager",
    "RequestUsage",
    "TieredDecodeManager",
    "TieredPrefillManager",
    "manager_for_role",
]

ROLES = ("mixed", "prefill", "decode")
HANDOFF_VERSION = 1
"""The format of a handoff without per-group tables (one group of full-attention layers)."""
GROUPS_HANDOFF_VERSION = 2
"""The format of a handoff that carries per-group tables: a reader of version 1 only, which would
ignore them and move the full-attention KV alone, refuses it instead."""
LOCAL_GROUP_KINDS = ("sliding_window", "chunked_local")
HANDOFF_GROUP_KINDS = (*LOCAL_GROUP_KINDS, "recurrent")
"""Kinds of the groups a handoff carries beside full attention: local groups' tables, recurrent groups' states."""
PLACEHOLDER = -1
"""A local group's entry for a block position the prefill node released (it left the window)."""


@dataclass(frozen=True)
class DisaggConfig:
    """A node's role, validated once.

    >>> DisaggConfig(role="decode", reserve_blocks_per_sequence=2).role
    'decode'
    >>> DisaggConfig(role="both")
    Traceback (most recent call last):
    ...
    kvblocks.errors.ConfigError: role must be one of mixed, prefill, decode; got 'both'
    """

    role: str = "mixed"
    reserve_blocks_per_sequence: int = 1
    """Decode: blocks kept free for each running sequence's growth; a handoff may not use them."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {', '.join(ROLES)}; got {self.role!r}")
        reserve = self.reserve_blocks_per_sequence
        if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
            raise ConfigError(f"reserve_blocks_per_sequence must be an int >= 0, got {reserve!r}")


# ---------------------------------------------------------------------------------------------- handoff


def _hashes_from_json(raw: object) -> tuple[BlockHash, ...]:
    try:
        return hashes_from_json(raw)
    except InvalidBlockHashError as e:
        raise HandoffError(f"{e} in handoff") from None


def first_held_block(kind: str, span: int, block_size: int, num_tokens: int) -> int:
    """The first block position a local group holds once ``num_tokens`` tokens are committed: the first
    any token from ``num_tokens`` on attends to (its window's or chunk's start). The hybrid manager's rule."""
    return kind_rules(kind).first_needed(num_tokens, block_size, span)


@dataclass(frozen=True)
class HandoffGroup:
    """A group's part of a handoff beside full attention.

    A local group: its kind, span (window or chunk, tokens) and, per block position of the prompt, the
    prefill node's block (:data:`PLACEHOLDER` where it was released: the decode node needs only the
    blocks of the window at the prompt's end). A recurrent group: kind ``"recurrent"``, span its
    checkpoint spacing (tokens), and one entry: the prefill node's state id holding the state after the
    whole prompt (a recurrent state is one per sequence, whatever its length)."""

    kind: str
    span: int
    blocks: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "span": self.span, "blocks": list(self.blocks)}

    @classmethod
    def from_json(cls, raw: object) -> HandoffGroup:
        if type(raw) is not dict or set(raw) != _GROUP_FIELDS:
            raise HandoffError(f"malformed handoff group: expected an object of kind, span, blocks, got {brief(raw)}")
        blocks = raw["blocks"]
        if type(blocks) is not list:
            raise HandoffError(f"malformed handoff group: blocks must be a list, got {brief(blocks)}")
        return cls(raw["kind"], raw["span"], tuple(blocks))

    def validate(self, num_prompt_tokens: int, block_size: int) -> None:
        """Kind known, span a positive count; a local group: one entry per prompt block, a block id exactly
        where the window at the prompt's end reaches, PLACEHOLDER before it; a recurrent group: one state id."""
        if not is_text(self.kind) or self.kind not in HANDOFF_GROUP_KINDS:
            raise HandoffError(
                f"handoff group kind must be one of {', '.join(HANDOFF_GROUP_KINDS)}, got {brief(self.kind)}"
            )
        if not _is_wire_count(self.span) or self.span == 0:
            raise HandoffError(f"handoff group span must be a positive int of at most 63 bits, got {brief(self.span)}")
        blocks = self.blocks
        if self.kind == "recurrent":
            if type(blocks) is not tuple or len(blocks) != 1 or not _is_wire_count(blocks[0]):
                raise HandoffError(f"a recurrent handoff group carries one state id (an int >= 0), got {brief(blocks)}")
            return
        total = -(-num_prompt_tokens // block_size)
        if type(blocks) is not tuple or len(blocks) != total:
            raise HandoffError(f"handoff group has {_length(blocks)} blocks for {total} prompt blocks")
        if not all(type(b) is int and PLACEHOLDER <= b <= MAX_INT for b in blocks):
            raise HandoffError("handoff group blocks must be ints in -1..2**63-1")
        first = first_held_block(self.kind, self.span, block_size, num_prompt_tokens)
        if any(b == PLACEHOLDER for b in blocks[first:]) or any(b != PLACEHOLDER for b in blocks[:first]):
            raise HandoffError(
                f"handoff {self.kind} group of span {self.span}: positions from {first} on need a block, "
                f"those before it are released (PLACEHOLDER)"
            )

    @property
    def layout(self) -> tuple[str, int]:
        return (self.kind, self.span)


_GROUP_FIELDS = frozenset(("kind", "span", "blocks"))


def _length(value: object) -> str:
    return str(len(value)) if isinstance(value, tuple) else brief(value)


@dataclass(frozen=True)
class PrefillHandoff:
    """What a decode node needs to take over a prefilled request (serialisable with :meth:`to_bytes`).

    ``source_blocks`` cover the whole prompt, the partial last block included;
    ``block_hashes`` name its full blocks; ``cached`` is what the prefill node found cached.
    ``groups`` are the tables of a hybrid model's local groups 1, 2, ... (``source_blocks`` is group 0,
    full attention): empty for a model of full attention only, whose bytes are then format version 1
    exactly as before; a handoff with groups is format :data:`GROUPS_HANDOFF_VERSION`.
    """

    seq_id: str | int
    num_prompt_tokens: int
    block_hashes: tuple[BlockHash, ...]
    source_blocks: tuple[int, ...]
    cached: CachedTokens
    scheme: str
    block_size: int
    key_space: str
    version: int = HANDOFF_VERSION
    groups: tuple[HandoffGroup, ...] = ()

    def to_bytes(self) -> bytes:
        raw: dict[str, Any] = {
            "version": self.version,
            "seq_id": self.seq_id,
            "num_prompt_tokens": self.num_prompt_tokens,
            "block_hashes": hashes_to_json(self.block_hashes),
            "source_blocks": list(self.source_blocks),
            "cached": [self.cached.device, self.cached.host, self.cached.storage],
            "scheme": self.scheme,
            "block_size": self.block_size,
            "key_space": self.key_space,
        }
        if self.groups:
            raw["groups"] = [g.to_json() for g in self.groups]
        return json.dumps(raw, separators=(",", ":")).encode()

    @property
    def group_blocks(self) -> tuple[tuple[int, ...], ...]:
        """The prefill node's blocks per group, group 0 (``source_blocks``) first, then each of ``groups``
        (a local group's table with PLACEHOLDER where released; a recurrent group's one state id)."""
        return (self.source_blocks, *(g.blocks for g in self.groups))

    @property
    def group_layout(self) -> tuple[tuple[str, int], ...]:
        """(kind, span) of each local group (empty: full attention only)."""
        return tuple(g.layout for g in self.groups)

    @classmethod
    def from_bytes(cls, data: bytes) -> PrefillHandoff:
        """Parse a handoff; raises :class:`HandoffError` and nothing else.

        The bytes come from another node: anything but one strict JSON object in UTF-8
        (:func:`kvblocks.strict_json.parse`: bounded nesting, no repeated keys, no NaN), another
        format version, a field of a wrong type or out of range, or counts that do not fit
        together is refused.
        """
        raw = _parse_handoff(data)
        missing = _HANDOFF_FIELDS.difference(raw)
        if missing:
            raise HandoffError(f"malformed handoff: missing {', '.join(sorted(missing))}")
        prompt, cached, source = raw["num_prompt_tokens"], raw["cached"], raw["source_blocks"]
        if not _is_wire_count(prompt) or type(source) is not list:
            raise HandoffError("malformed handoff: num_prompt_tokens or source_blocks of a wrong type")
        if type(cached) is not list or len(cached) != 3 or not all(_is_wire_count(c) for c in cached):
            raise HandoffError(f"malformed handoff: cached must be 3 counts, got {brief(cached)}")
        try:
            cached_tokens = CachedTokens(*cached, num_prompt_tokens=prompt)
        except AccountingError as e:
            raise HandoffError(f"malformed handoff: {e}") from None
        handoff = cls(
            seq_id=raw["seq_id"],
            num_prompt_tokens=prompt,
            block_hashes=_hashes_from_json(raw["block_hashes"]),
            source_blocks=tuple(source),
            cached=cached_tokens,
            scheme=raw["scheme"],
            block_size=raw["block_size"],
            key_space=raw["key_space"],
            version=raw["version"],
            groups=_groups_from_json(raw),
        )
        handoff.validate()
        return handoff

    def validate(self) -> None:
        """Types, counts, block ids, hashes against the prompt length (checked once per object)."""
        if self.__dict__.get("_validated"):
            return
        if not (is_text(self.seq_id) or type(self.seq_id) is int):
            raise HandoffError(f"handoff seq_id must be a str or an int, got {brief(self.seq_id)}")
        for name in ("num_prompt_tokens", "block_size"):
            value = getattr(self, name)
            if not _is_wire_count(value) or value == 0:
                raise HandoffError(f"handoff {name} must be a positive int of at most 63 bits, got {brief(value)}")
        for name in ("scheme", "key_space"):
            if not is_text(getattr(self, name)):
                raise HandoffError(f"handoff {name} must be a str, got {brief(getattr(self, name))}")
        if type(self.groups) is not tuple or not all(isinstance(g, HandoffGroup) for g in self.groups):
            raise HandoffError(f"handoff groups must be a tuple of HandoffGroup, got {brief(self.groups)}")
        expected = GROUPS_HANDOFF_VERSION if self.groups else HANDOFF_VERSION
        if type(self.version) is not int or self.version != expected:
            raise HandoffError(
                f"handoff format version {brief(self.version)}; a handoff "
                f"{'with' if self.groups else 'without'} per-group tables is version {expected}"
            )
        size = self.block_size
        if len(self.block_hashes) != self.num_prompt_tokens // size:
            raise HandoffError(
                f"handoff names {len(self.block_hashes)} full blocks for {self.num_prompt_tokens} tokens of {size}"
            )
        if len(self.source_blocks) != -(-self.num_prompt_tokens // size):
            raise HandoffError(
                f"handoff has {len(self.source_blocks)} source blocks for {self.num_prompt_tokens} tokens"
            )
        if not all(_is_wire_count(b) for b in self.source_blocks):
            raise HandoffError("handoff source blocks must be ints in 0..2**63-1")
        if not isinstance(self.cached, CachedTokens) or self.cached.num_prompt_tokens != self.num_prompt_tokens:
            raise HandoffError("handoff cached tokens must be a CachedTokens of the same prompt")
        for group in self.groups:
            group.validate(self.num_prompt_tokens, size)
        object.__setattr__(self, "_validated", True)  # immutable: once sound, always sound


_HANDOFF_FIELDS = frozenset(
    ("seq_id", "num_prompt_tokens", "block_hashes", "source_blocks", "cached", "scheme", "block_size", "key_space")
)


def _parse_handoff(data: object) -> dict[str, Any]:
    """One strict JSON object of a known handoff format version (1, or 2 with per-group tables)."""
    try:
        raw = parse(data)
    except StrictJSONError as e:
        raise HandoffError(f"handoff: {e}") from None
    if type(raw) is not dict:
        raise HandoffError("handoff must be a JSON object")
    found = raw.get("version")
    if type(found) is not int or found not in (HANDOFF_VERSION, GROUPS_HANDOFF_VERSION):
        raise HandoffError(
            f"handoff format version {brief(found)}; this kvblocks reads {HANDOFF_VERSION} and {GROUPS_HANDOFF_VERSION}"
        )
    return raw


def _groups_from_json(raw: dict[str, Any]) -> tuple[HandoffGroup, ...]:
    """Version 2 carries a non-empty list of groups; version 1 none (validate checks the pairing)."""
    if "groups" not in raw:
        return ()
    groups = raw["groups"]
    if type(groups) is not list or not groups:
        raise HandoffError(f"malformed handoff: groups must be a non-empty list, got {brief(groups)}")
    return tuple(HandoffGroup.from_json(g) for g in groups)


def _is_wire_count(value: object) -> bool:
    """An int in ``0..MAX_INT``: what a count or block id on the wire may be (no bools, floats or absurd sizes)."""
    return type(value) is int and 0 <= value <= MAX_INT


# ---------------------------------------------------------------------------------------------- prefill


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


# ---------------------------------------------------------------------------------------------- decode


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


# ---------------------------------------------------------------------------------------------- roles over tiers


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


# ---------------------------------------------------------------------------------------------- roles


def manager_for_role(
    config: CacheConfig,
    disagg: DisaggConfig | None = None,
    *,
    tiers: TierConfig | None = None,
    groups: Sequence[object] = (),
    event_sink: EventSink | None = None,
) -> KVCacheManager:
    """The manager for a node: its role, over host/storage tiers when ``tiers`` is given, with the layer
    ``groups`` beside full attention when the model is hybrid.

    ``groups`` lists :class:`~kvblocks.hybrid.LocalGroup` s, then :class:`~kvblocks.hybrid.RecurrentGroup` s,
    then :class:`~kvblocks.hybrid.CrossAttentionGroup` s (their group numbers 1, 2, ... follow that order).

    ========  ===================  ===========================  ================================
    role      one group            one group, tiers             hybrid (no tiers / tiers)
    ========  ===================  ===========================  ================================
    mixed     ``KVCacheManager``   ``TieredKVCacheManager``     ``HybridKVCacheManager`` /
                                                                ``TieredHybridKVCacheManager``
    prefill   ``PrefillManager``   ``TieredPrefillManager``     ``HybridPrefillManager`` /
                                                                ``TieredHybridPrefillManager``
    decode    ``DecodeManager``    ``TieredDecodeManager``      ``HybridDecodeManager`` /
                                                                ``TieredHybridDecodeManager``
    ========  ===================  ===========================  ================================

    >>> type(manager_for_role(CacheConfig(64, 16), DisaggConfig(role="prefill"))).__name__
    'PrefillManager'
    """
    disagg = disagg or DisaggConfig()
    if not isinstance(disagg, DisaggConfig):
        raise ConfigError(f"disagg must be a DisaggConfig, got {type(disagg).__name__}")
    if tiers is not None and not isinstance(tiers, TierConfig):
        raise ConfigError(f"tiers must be a TierConfig or None, got {type(tiers).__name__}")
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
        raise ConfigError(f"groups must be a sequence of layer groups, got {type(groups).__name__}")
    if groups:
        # the hybrid wing is loaded only for a hybrid model: `import kvblocks` stays light
        from kvblocks.hybrid.roles import hybrid_manager_for_role

        return hybrid_manager_for_role(config, disagg, tiers=tiers, groups=groups, event_sink=event_sink)
    if disagg.role == "decode":
        if tiers is not None:
            return TieredDecodeManager.from_config(config, tiers=tiers, disagg=disagg, event_sink=event_sink)
        return DecodeManager.from_config(config, disagg=disagg, event_sink=event_sink)
    if disagg.role == "prefill":
        if tiers is not None:
            return TieredPrefillManager.from_config(config, tiers=tiers, event_sink=event_sink)
        return PrefillManager.from_config(config, event_sink=event_sink)
    if tiers is not None:
        return TieredKVCacheManager.from_config(config, tiers=tiers, event_sink=event_sink)
    return KVCacheManager.from_config(config, event_sink=event_sink)
