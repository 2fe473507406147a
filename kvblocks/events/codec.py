"""KV events as values and as bytes: the event types, :class:`EventBatch` and its wire format.

This is the layer both sides of a transport share: the sink, publisher and consumer of
:mod:`kvblocks.events` and the transports of :mod:`kvblocks.events.transport` (and
:func:`~kvblocks.events.transport.pump`) all build on it; it imports none of them, so a
transport never imports the layer that uses it. The event types, :class:`EventBatch` and the wire
format's functions are re-exported by :mod:`kvblocks.events`, the usual place to import them from.

Wire format (:func:`encode_batch`): compact JSON, ``{"version": 1, "producer": ...,
"seq": ..., "ts": ..., "snapshot": ..., "events": [...]}`` with each event a list:
``["S", tier, hashes, parent]`` (plus ``token_ids`` when known), ``["R", tier,
hashes]``, ``["C", tier]``. ``hashes`` is ``"W:HEX"`` when all are bytes of width W
(the usual case: one hex string), else a list of ints and hex strings; ``parent``
is null, an int or a hex string.

An event may end with one JSON object of metadata, each key optional: ``group`` and ``kind``
(the group of a hybrid model's cache it is about: ``["R", "device", "16:...", {"group": 1, "kind":
"sliding_window"}]``; ``group`` is the group's index in its manager -- 0: full attention, 1, 2, ...:
the other groups -- and ``kind`` one of :data:`EVENT_GROUP_KINDS`, which a foreign producer may leave
out), and for ``"S"`` events ``block_size``, ``lora_id`` and ``lora_name``. An event without any is
written exactly as before the metadata existed, so old producers and consumers keep working; an old
consumer refuses an event with metadata as malformed (a gap it recovers from) rather than mistaking a
sliding-window group's removals for the prefix's.

:func:`decode_batch` reads bytes from outside (another process, a shared stream):
whatever they hold, it returns a batch or raises :class:`kvblocks.errors.EventDecodeError`,
nothing else.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from kvblocks.errors import EventDecodeError, InvalidArgumentError, InvalidBlockHashError, InvalidTokenError
from kvblocks.hashing import (
    TOKEN_LIMIT,
    BlockHash,
    hash_from_json,
    hash_to_json,
    hashes_from_json,
    hashes_to_json,
)
from kvblocks.strict_json import MAX_INT, brief, is_text, parse_versioned

__all__ = [
    "EVENT_FORMAT_VERSION",
    "EVENT_GROUP_KINDS",
    "MAX_BATCH_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEvent",
    "PendingEvent",
    "are_token_ids",
    "build_pending",
    "decode_batch",
    "encode_batch",
    "is_event_group",
    "is_prefix_event",
    "is_group_tag",
]


EVENT_GROUP_KINDS: tuple[str, ...] = ("full", "sliding_window", "chunked_local", "recurrent", "cross_attention")
"""The group kinds an event's ``group_kind`` may name: :data:`kvblocks.layouts.plan.GROUP_KINDS`, repeated
here because this layer is below :mod:`kvblocks.hybrid` (a test keeps the two equal)."""


@dataclass(slots=True, eq=False)  # not frozen: a frozen init costs 5x, on the hot path
class BlockStored:
    """Blocks became findable in ``tier``; ``block_hashes`` form a chain hanging off ``parent_hash``.

    The fields after ``tier`` are what vLLM's ``BlockStored`` carries besides, each None when the
    producer does not know it: ``token_ids`` (the tokens of those blocks, in order), ``group`` /
    ``group_kind`` (the group of a hybrid model's cache; a foreign producer may name a group without
    its kind), ``block_size`` (tokens per block), ``lora_id`` / ``lora_name`` (the adapter the blocks
    were computed with). ``parent_hash`` is the chain's previous hash even when that group does not
    hold it (a sliding-window group keeps only a window of the chain).

    ``token_ids`` is any sequence of ints: kvblocks' own caches hand over an ``array('I')`` copy (a
    memcpy, where a tuple would build an int object per token on the hot path). Equality and hashing
    read it as a tuple, so ``token_ids=(1, 2)`` and ``array('I', [1, 2])`` make equal events.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    tier: str
    token_ids: Sequence[int] | None = None
    group: int | None = None
    group_kind: str | None = None
    block_size: int | None = None
    lora_id: int | None = None
    lora_name: str | None = None

    def _key(self) -> tuple[object, ...]:
        tokens = self.token_ids
        return (
            self.block_hashes,
            self.parent_hash,
            self.tier,
            None if tokens is None else tuple(tokens),
            self.group,
            self.group_kind,
            self.block_size,
            self.lora_id,
            self.lora_name,
        )

    def __eq__(self, other: object) -> bool:
        if type(other) is not BlockStored:
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


@dataclass(slots=True, unsafe_hash=True)  # not frozen: a frozen init costs 5x, on the hot path
class BlockRemoved:
    """Blocks are no longer findable in ``tier`` (of group ``group``, when tagged; see :class:`BlockStored`)."""

    block_hashes: tuple[BlockHash, ...]
    tier: str
    group: int | None = None
    group_kind: str | None = None


@dataclass(slots=True, unsafe_hash=True)  # not frozen: a frozen init costs 5x, on the hot path
class AllBlocksCleared:
    """Every block of ``tier`` (of group ``group``, when tagged; see :class:`BlockStored`) was dropped."""

    tier: str
    group: int | None = None
    group_kind: str | None = None


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
"""An event is a value: compared and hashed by its fields, shared by every subscriber, never modified
(the classes are not frozen only because a frozen dataclass takes ~2 us to build, a plain one ~0.3 us,
and a cache emits one per batch of blocks it stores or evicts)."""


PendingEvent = tuple[Any, ...]
"""An event a sink holds: ``(seq, timestamp, factory, *args)`` (five argument places), the event being
``factory(*args)`` -- built only when somebody reads it (:meth:`kvblocks.events.EventSink.record`); trailing
:data:`NO_ARG` are not arguments -- or ``(seq, timestamp, None, event)`` for an event built already."""

NO_ARG: Any = type("NoArg", (), {"__repr__": lambda self: "NO_ARG", "__slots__": ()})()
"""The filler of a :data:`PendingEvent`'s unused argument places."""


def pending_args(entry: PendingEvent) -> tuple[Any, ...]:
    """The arguments of a pending entry's factory."""
    end = len(entry)
    while end > 3 and entry[end - 1] is NO_ARG:
        end -= 1
    return entry[3:end]


def build_pending(entries: Iterable[PendingEvent]) -> Iterator[KVEvent]:
    """The events of ``entries``, built one at a time as the iterator is read."""
    for entry in entries:
        factory = entry[2]
        yield entry[3] if factory is None else factory(*pending_args(entry))


def stored_event(
    tier: str,
    group: int | None,
    group_kind: str | None,
    block_size: int | None,
    block_hashes: Iterable[BlockHash],
    parent_hash: BlockHash | None,
    token_ids: Sequence[int] | None,
    lora: str | tuple[str, int] | None,
) -> BlockStored:
    """A cache's ``BlockStored`` from its fixed tags and one commit's parts: the factory a cache records
    (``functools.partial(stored_event, tier, group, group_kind, block_size)``), so that its hot path passes
    four arguments and never builds the tuple of hashes. ``token_ids`` may be the bytes of an ``array('I')``:
    what a cache records, as bytes are the one form of them the garbage collector does not track. ``lora``:
    the adapter's name, or its name and the engine's integer id for it."""
    if type(token_ids) is bytes:
        token_ids = array("I", token_ids)
    name: str | None
    lora_id: int | None
    if isinstance(lora, tuple):
        name, lora_id = lora
    else:
        name, lora_id = lora, None
    return BlockStored(tuple(block_hashes), parent_hash, tier, token_ids, group, group_kind, block_size, lora_id, name)


def stored_range_event(
    tier: str,
    group: int | None,
    group_kind: str | None,
    block_size: int | None,
    chain: Sequence[BlockHash],
    start: int,
    stop: int,
    tokens: Sequence[int] | None,
    lora: str | tuple[str, int] | None,
) -> BlockStored:
    """The ``BlockStored`` of blocks ``start..stop-1`` of one sequence, read from the sequence's own ``chain``
    of hashes and ``tokens`` when the event is built, not when it is recorded: what a cache records for a
    commit whose hashes and tokens only grow (``PrefixTree.insert(..., stable=True)``), so that its hot path
    copies nothing and the copies are made on the reader's thread::

        chain   h0 h1 h2 h3 h4          start 2, stop 4, block size bs
        event   hashes (h2, h3), parent h1, token ids tokens[2*bs : 4*bs]

    Only sound while positions below ``stop`` of both never change: a sequence's
    :class:`~kvblocks.hashing.HashedTokens` appends, and replaces rather than cuts when it truncates."""
    return stored_event(tier, group, group_kind, block_size, *range_parts(chain, start, stop, tokens, block_size), lora)


def range_parts(
    chain: Sequence[BlockHash], start: int, stop: int, tokens: Sequence[int] | None, block_size: int | None
) -> tuple[Sequence[BlockHash], BlockHash | None, Sequence[int] | None]:
    """The hashes, parent hash and token ids (None: unknown) of blocks ``start..stop-1`` of a sequence whose
    chain of hashes and tokens are given: what :func:`stored_range_event` builds its event from."""
    parent = chain[start - 1] if start else None
    token_ids = None if tokens is None or block_size is None else tokens[start * block_size : stop * block_size]
    return chain[start:stop], parent, token_ids


def removed_event(
    tier: str, group: int | None, group_kind: str | None, block_hashes: Iterable[BlockHash]
) -> BlockRemoved:
    """A cache's ``BlockRemoved`` from its fixed tags and the hashes removed (see :func:`stored_event`)."""
    return BlockRemoved(tuple(block_hashes), tier, group, group_kind)


EVENT_FORMAT_VERSION = 1
"""The ``version`` field :func:`encode_batch` writes and the only one :func:`decode_batch` reads."""

MAX_BATCH_SEQ = MAX_INT
"""The largest batch number on the wire: a number no producer reaches, but one a forged batch
could use to make every later batch of its producer look like a duplicate."""


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events of one producer, numbered ``seq`` = 0, 1, 2, ... per producer.

    ``timestamp`` is wall-clock seconds: when the newest event of the batch happened
    (for a snapshot, when it was taken). A ``snapshot`` batch carries the producer's
    whole current cache as ``BlockStored`` events, parents before children, and tells
    consumers to replace what they know of that producer.
    """

    producer: str
    seq: int
    timestamp: float
    events: tuple[KVEvent, ...]
    snapshot: bool = False


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


_INT_ONLY = frozenset((int,))


def are_token_ids(values: Sequence[object]) -> bool:
    """Whether every value is an int (not a bool) in ``[0, 2**32)``: a test in C, not a Python loop per token."""
    if not values or (type(values) is array and values.typecode == "I"):  # u32 by construction
        return True
    if not set(map(type, values)) <= _INT_ONLY:
        return False
    return min(values) >= 0 and max(values) < TOKEN_LIMIT  # type: ignore[type-var, operator]


def _is_seq(value: object) -> TypeGuard[int]:
    return type(value) is int and 0 <= value <= MAX_BATCH_SEQ


def _is_timestamp(value: object) -> TypeGuard[int | float]:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if isinstance(value, int):  # math.isfinite(10**400) raises OverflowError
        return -MAX_INT <= value <= MAX_INT
    return math.isfinite(value)


def is_group_tag(group: object, kind: object) -> bool:
    """Whether ``(group, kind)`` is a producer's group tag: both None, or an int in ``0..MAX_INT`` and a known kind."""
    if group is None and kind is None:
        return True
    return type(group) is int and 0 <= group <= MAX_INT and type(kind) is str and kind in EVENT_GROUP_KINDS


def is_event_group(group: object, kind: object) -> bool:
    """Whether an event may carry ``(group, kind)``: a group tag, or a group whose producer named no kind
    (vLLM's ``BlockRemoved`` carries only ``group_idx``)."""
    return is_group_tag(group, kind) or (kind is None and type(group) is int and 0 <= group <= MAX_INT)


def is_prefix_event(event: KVEvent) -> bool:
    """Whether ``event`` is about the prefix a router scores: untagged, of a ``"full"`` group, or of group 0
    when its producer named no kind (vLLM's ``BlockRemoved``). Another group's copy of the chain -- a
    sliding window's, whose removals say nothing of the full group's -- is not."""
    kind = event.group_kind
    return kind == "full" or (kind is None and event.group in (None, 0))


_META_KEYS = frozenset(("group", "kind", "block_size", "lora_id", "lora_name"))
_STORED_ONLY_KEYS = frozenset(("block_size", "lora_id", "lora_name"))


def _is_positive(value: object) -> bool:
    return type(value) is int and 1 <= value <= MAX_INT


def _check_stored_fields(event: BlockStored) -> str | None:
    """What is wrong with a ``BlockStored``'s optional fields (None: nothing)."""
    if event.token_ids is not None and not are_token_ids(event.token_ids):
        return f"token ids must be ints in [0, 2**32), got {brief(event.token_ids)}"
    if event.block_size is not None and not _is_positive(event.block_size):
        return f"block_size must be an int in 1..{MAX_INT}, got {brief(event.block_size)}"
    if event.lora_id is not None and not _is_count(event.lora_id):
        return f"lora_id must be an int >= 0, got {brief(event.lora_id)}"
    if event.lora_id is not None and event.lora_id > MAX_INT:
        return f"lora_id must be at most {MAX_INT}, got {event.lora_id}"
    if event.lora_name is not None and not (is_text(event.lora_name) and event.lora_name):
        return f"lora_name must be a non-empty str, got {brief(event.lora_name)}"
    if event.token_ids is not None and event.block_size is not None:
        expected = event.block_size * len(event.block_hashes)
        if len(event.token_ids) != expected:
            return (
                f"{len(event.token_ids)} token ids for {len(event.block_hashes)} blocks of {event.block_size} tokens "
                f"(expected {expected})"
            )
    return None


def _meta_from_json(raw: dict[str, Any], tag: str) -> dict[str, Any]:
    """The trailing object of an event: its group tag and (``BlockStored`` only) block size and LoRA."""
    keys = set(raw)
    if not raw or keys - _META_KEYS or (tag != "S" and keys & _STORED_ONLY_KEYS):
        raise EventDecodeError(f"malformed event metadata {brief(raw)} in event batch")
    group, kind = raw.get("group"), raw.get("kind")
    if ("kind" in raw and kind is None) or ("group" in raw and group is None) or not is_event_group(group, kind):
        raise EventDecodeError(f"malformed group tag {brief(raw)} in event batch")
    return raw


def _hash_from_json(raw: object) -> BlockHash:
    try:
        return hash_from_json(raw)
    except InvalidBlockHashError as e:
        raise EventDecodeError(f"{e} in event batch") from None


def _hashes_from_json(raw: object) -> tuple[BlockHash, ...]:
    try:
        return hashes_from_json(raw)
    except InvalidBlockHashError as e:
        raise EventDecodeError(f"{e} in event batch") from None


def _event_to_json(event: KVEvent) -> list[Any]:
    if not isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared):
        raise InvalidArgumentError(f"not a KV event: {event!r}")
    if type(event.tier) is not str:
        raise InvalidArgumentError(f"an event's tier must be a str, got {event.tier!r}")
    if not is_event_group(event.group, event.group_kind):
        raise InvalidArgumentError(
            f"an event's group must be an int in 0..{MAX_INT} and its group_kind None or one of "
            f"{', '.join(EVENT_GROUP_KINDS)} (a kind needs a group); "
            f"got {brief(event.group)}, {brief(event.group_kind)}"
        )
    meta: dict[str, Any] = {}
    if event.group is not None:
        meta["group"] = event.group
        if event.group_kind is not None:
            meta["kind"] = event.group_kind
    if isinstance(event, BlockStored):
        problem = _check_stored_fields(event)
        if problem is not None:
            exc = InvalidTokenError if problem.startswith("token ids") else InvalidArgumentError
            raise exc(f"cannot encode BlockStored: {problem}")
        parent = None if event.parent_hash is None else hash_to_json(event.parent_hash)
        out: list[Any] = ["S", event.tier, hashes_to_json(event.block_hashes), parent]
        tokens = event.token_ids
        if tokens is not None:
            out.append(tokens.tolist() if type(tokens) is array else list(tokens))
        for name in ("block_size", "lora_id", "lora_name"):
            value = getattr(event, name)
            if value is not None:
                meta[name] = value
    elif isinstance(event, BlockRemoved):
        out = ["R", event.tier, hashes_to_json(event.block_hashes)]
    else:
        out = ["C", event.tier]
    if meta:
        out.append(meta)
    return out


def _event_from_json(raw: object) -> KVEvent:
    if type(raw) is not list or len(raw) < 2 or type(raw[0]) is not str or not is_text(raw[1]):
        raise EventDecodeError(f"malformed event {brief(raw)} in event batch")
    tag, tier = raw[0], raw[1]
    meta: dict[str, Any] = {}
    if len(raw) > 2 and type(raw[-1]) is dict:  # a trailing object is the metadata, and only that
        meta = _meta_from_json(raw[-1], tag)
        raw = raw[:-1]
    group, kind = meta.get("group"), meta.get("kind")
    if tag == "S" and len(raw) in (4, 5):
        parent = None if raw[3] is None else _hash_from_json(raw[3])
        tokens: tuple[int, ...] | None = None
        if len(raw) == 5:
            if type(raw[4]) is not list:
                raise EventDecodeError(f"malformed token ids {brief(raw[4])} in event batch")
            tokens = tuple(raw[4])
        event = BlockStored(
            _hashes_from_json(raw[2]),
            parent,
            tier,
            tokens,
            group,
            kind,
            meta.get("block_size"),
            meta.get("lora_id"),
            meta.get("lora_name"),
        )
        problem = _check_stored_fields(event)
        if problem is not None:
            raise EventDecodeError(f"malformed BlockStored in event batch: {problem}")
        return event
    if tag == "R" and len(raw) == 3:
        return BlockRemoved(_hashes_from_json(raw[2]), tier, group, kind)
    if tag == "C" and len(raw) == 2:
        return AllBlocksCleared(tier, group, kind)
    raise EventDecodeError(f"unknown or malformed event {brief(raw)} in event batch")


def encode_batch(batch: EventBatch) -> bytes:
    """The batch as compact JSON bytes (see the module docstring for the format).

    >>> batch = EventBatch("w0", 7, 12.5, (BlockStored((b"\\x01\\x02", b"\\x03\\x04"), None, "device"),))
    >>> encode_batch(batch)
    b'{"version":1,"producer":"w0","seq":7,"ts":12.5,"snapshot":false,"events":[["S","device","2:01020304",null]]}'
    >>> decode_batch(encode_batch(batch)) == batch
    True

    Raises :class:`kvblocks.errors.InvalidArgumentError` (or the hash / token error)
    for a batch that has no encoding: a hash that is not an int >= 0 or non-empty
    bytes, a seq that is not an int in ``0..MAX_BATCH_SEQ``, a non-finite timestamp,
    a token id outside ``[0, 2**32)``.
    """
    if type(batch.producer) is not str or not _is_seq(batch.seq) or type(batch.snapshot) is not bool:
        raise InvalidArgumentError(
            f"cannot encode batch: producer must be a str, seq an int in 0..{MAX_BATCH_SEQ} and snapshot a bool, "
            f"got {brief(batch.producer)}, {brief(batch.seq)}, {brief(batch.snapshot)}"
        )
    ts = batch.timestamp
    if not _is_timestamp(ts):
        raise InvalidArgumentError(f"cannot encode batch: timestamp must be a finite number, got {brief(ts)}")
    events = [_event_to_json(e) for e in batch.events]
    raw = {
        "version": EVENT_FORMAT_VERSION,
        "producer": batch.producer,
        "seq": batch.seq,
        "ts": float(ts),
        "snapshot": batch.snapshot,
        "events": events,
    }
    return json.dumps(raw, separators=(",", ":")).encode()


def decode_batch(data: bytes) -> EventBatch:
    """Parse :func:`encode_batch` output; raises :class:`kvblocks.errors.EventDecodeError` and nothing else.

    Refused: anything but one strict JSON object in UTF-8 (see :func:`kvblocks.strict_json.parse`:
    no repeated keys, no NaN, bounded nesting), another format version, a field of a wrong type
    or out of its range (a seq beyond ``MAX_BATCH_SEQ``, a token id beyond ``2**32 - 1``, a
    non-finite timestamp), a malformed event or hash, and a group tag that is not exactly
    ``{"group": int in 0..MAX_INT, "kind": one of EVENT_GROUP_KINDS}``.
    """
    raw = parse_versioned(data, "event batch", EVENT_FORMAT_VERSION, EventDecodeError)
    producer, seq, ts = raw.get("producer"), raw.get("seq"), raw.get("ts")
    snapshot, events = raw.get("snapshot"), raw.get("events")
    if not is_text(producer) or type(snapshot) is not bool or type(events) is not list:
        raise EventDecodeError("malformed event batch: producer, snapshot or events missing or of a wrong type")
    if not _is_seq(seq):
        raise EventDecodeError(f"malformed event batch: seq {brief(seq)}")
    if not _is_timestamp(ts):
        raise EventDecodeError(f"malformed event batch: timestamp {brief(ts)}")
    return EventBatch(producer, seq, float(ts), tuple(_event_from_json(e) for e in events), snapshot)
