"""vLLM's and SGLang's KV event payloads (msgpack ``KVEventBatch``) <-> kvblocks events.

One ZMQ message of an engine carries one payload: a msgpack array ``[ts, events, dp_rank]``, each event a
map tagged by its class name (``{"type": "BlockStored", "block_hashes": [...], ...}``). The two dialects:

=============  =====================================  =========================================
               vLLM (0.33)                            SGLang (0.5.23)
=============  =====================================  =========================================
batch          ``[ts, events, rank]`` (rank or nil)  ``[ts, events, rank]`` (rank or nil)
hashes         u64 ints (default) or digest bytes     signed int64
medium         ``GPU`` / ``CPU`` / ``STORAGE``         ``GPU`` / ``CPU_PINNED`` / ``DISK`` / ``EXTERNAL``
groups         ``group_idx`` + ``kv_cache_spec_kind``  none
=============  =====================================  =========================================

Older vLLM (0.11 and before) wrote events as positional arrays
(``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium]``); both shapes are read, and a
batch written as a map (``{"ts": ..., "events": ...}``) too.

Decoding (:class:`EngineEventDecoder`, one per stream) maps a medium to a kvblocks tier (GPU -> device,
CPU / CPU_PINNED -> host, STORAGE / DISK / EXTERNAL -> storage, none -> device; an unknown medium stays as
its own tier name, which the router ignores), a signed hash to its unsigned 64-bit form (``h & (2**64 - 1)``,
hashes and parents alike), vLLM's ``kv_cache_spec_kind`` to a kvblocks group kind, and an
``AllBlocksCleared`` (which names no medium) to one clear per kvblocks tier. vLLM's ``BlockRemoved`` names
only ``group_idx``: the decoder remembers each group's kind from the ``BlockStored`` events it has seen and
tags removals with it. Fields kvblocks has no place for (``extra_keys``, ``session_id``, ``cache_salt``,
``locality``, ...) are read past. An empty ``token_ids`` (or a zero ``block_size``) means "not known".
Whatever the bytes, decoding returns a batch or raises :class:`~kvblocks.errors.EventDecodeError`; the
decoder's memory changes only when a payload decodes.

Encoding (:func:`encode_engine_batch`) writes what the engine itself writes, so vLLM's consumers (llm-d's
indexer, Dynamo's router) read a kvblocks manager's events: tiers -> medium, bytes hashes -> their 64-bit
int form (:func:`kvblocks.hashing.vllm_int_hash`) unless ``int_hashes=False``, unknown ``token_ids`` /
``block_size`` -> ``[]`` / ``0`` (the engine's structs require them). vLLM has no snapshot flag: a snapshot
batch is written ``[AllBlocksCleared, BlockStored, ...]``, and a payload that *starts* with
``AllBlocksCleared`` reads back as a snapshot (:attr:`EngineBatch.resets`) -- clearing everything and then
applying the rest is what replacing a worker's view means. An ``AllBlocksCleared`` of one tier or group
becomes vLLM's (which clears everything): consumers forget more than they must, never less. SGLang has no
groups, so only the events a router scores (untagged, group 0 without a kind, or a ``"full"`` group) are
written in its dialect.

Nothing is unpickled or evaluated: msgspec decodes the bytes into the structs below (written for this
module), which bound every value (token ids below ``2**32``, sizes and ranks in ``0..2**63-1``).
"""

from __future__ import annotations

import itertools
import math
import struct
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from kvblocks.errors import ConfigError, EventDecodeError, InvalidArgumentError, InvalidTokenError, MissingExtraError
from kvblocks.events.codec import (
    EVENT_GROUP_KINDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    are_token_ids,
    is_prefix_event,
)
from kvblocks.hashing import BlockHash, sglang_int_hash, vllm_int_hash
from kvblocks.strict_json import MAX_INT, brief

__all__ = [
    "DIALECTS",
    "KVBLOCKS_TIERS",
    "MEDIUM_TO_TIER",
    "SPEC_KIND_TO_GROUP_KIND",
    "Dialect",
    "EngineBatch",
    "EngineEventDecoder",
    "decode_engine_batch",
    "encode_engine_batch",
    "encode_engine_events",
    "require_msgspec",
]

Dialect = Literal["vllm", "sglang"]
DIALECTS: tuple[str, ...] = ("vllm", "sglang")
KVBLOCKS_TIERS: tuple[str, ...] = ("device", "host", "storage")
"""The tiers one engine ``AllBlocksCleared`` clears (the tiers :class:`kvblocks.routing.Router` scores)."""

MEDIUM_TO_TIER: dict[str, str] = {
    "GPU": "device",
    "CPU": "host",
    "CPU_PINNED": "host",
    "STORAGE": "storage",
    "DISK": "storage",
    "EXTERNAL": "storage",
}
"""Both engines' medium strings (one table: they never disagree) -> kvblocks tiers."""

_TIER_TO_MEDIUM: dict[str, dict[str, str]] = {
    "vllm": {"device": "GPU", "host": "CPU", "storage": "STORAGE"},
    "sglang": {"device": "GPU", "host": "CPU_PINNED", "storage": "DISK"},
}

SPEC_KIND_TO_GROUP_KIND: dict[str, str] = {
    "full_attention": "full",
    "mla_attention": "full",
    "sink_full_attention": "full",
    "sliding_window": "sliding_window",
    "sliding_window_mla": "sliding_window",
    "chunked_local_attention": "chunked_local",
    "mamba": "recurrent",
    "cross_attention": "cross_attention",
    "encoder_only_attention": "cross_attention",
}
"""vLLM's ``KVCacheSpecKind`` values -> :data:`kvblocks.events.codec.EVENT_GROUP_KINDS` (others: no kind)."""

_GROUP_KIND_TO_SPEC_KIND: dict[str, str] = {
    "full": "full_attention",
    "sliding_window": "sliding_window",
    "chunked_local": "chunked_local_attention",
    "recurrent": "mamba",
    "cross_attention": "cross_attention",
}

_U64 = (1 << 64) - 1
_MAX_GROUPS = 4096  # group kinds one decoder remembers (a model has a handful of groups)
_CLEAR_ALL = tuple(AllBlocksCleared(tier) for tier in KVBLOCKS_TIERS)


def require_msgspec() -> Any:
    """Import msgspec, or raise :class:`MissingExtraError` naming the extra that installs it."""
    try:
        import msgspec
    except ImportError:
        raise MissingExtraError("vLLM/SGLang KV events need msgspec", "zmq") from None
    return msgspec


def _check_dialect(dialect: object) -> Dialect:
    if dialect == "vllm":
        return "vllm"
    if dialect == "sglang":
        return "sglang"
    raise ConfigError(f"dialect must be one of {DIALECTS}, got {dialect!r}")


@dataclass(frozen=True, slots=True)
class EngineBatch:
    """One engine payload, decoded: ``events`` in kvblocks' terms.

    ``resets`` is true when the payload began with ``AllBlocksCleared``: ``events`` then holds what followed
    it, and the batch replaces the worker's view (:meth:`as_event_batch` makes it a snapshot).
    """

    timestamp: float
    events: tuple[KVEvent, ...]
    dp_rank: int | None
    resets: bool = False

    def as_event_batch(self, producer: str, seq: int) -> EventBatch:
        """The kvblocks :class:`EventBatch` of ``producer`` numbered ``seq`` (a snapshot when it resets)."""
        return EventBatch(producer, seq, self.timestamp, self.events, self.resets)


def _wire() -> Any:
    """The structs and codecs (:mod:`kvblocks.interop._engine_structs`), imported on first use."""
    require_msgspec()
    from kvblocks.interop import _engine_structs

    return _engine_structs


# ---------------------------------------------------------------------- decoding


def _hash(raw: int | bytes) -> BlockHash:
    return raw & _U64 if type(raw) is int else raw


def _tier(medium: str | None) -> str:
    if medium is None:
        return "device"
    return MEDIUM_TO_TIER.get(medium, medium)


def _tokens(raw: list[Any] | None, n_hashes: int, block_size: int | None) -> tuple[int, ...] | None:
    """The token ids of a ``BlockStored``: None when not given, empty or pairs (SGLang's bigram pages)."""
    if not raw:
        return None
    flat = [t for t in raw if type(t) is int]
    if len(flat) != len(raw):
        if flat:
            raise EventDecodeError("BlockStored token_ids mix ints and pairs")
        return None
    if block_size is not None and len(flat) != block_size * n_hashes:
        raise EventDecodeError(
            f"BlockStored carries {len(flat)} token ids for {n_hashes} blocks of {block_size} tokens"
        )
    return tuple(flat)


def _text(raw: str | None) -> str | None:
    return raw or None


class EngineEventDecoder:
    """Decodes one engine stream's payloads; remembers each group's kind for the removals that follow.

    >>> import msgspec
    >>> stored = {"type": "BlockStored", "block_hashes": [-1], "parent_block_hash": None, "token_ids": [5, 6],
    ...           "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 1,
    ...           "kv_cache_spec_kind": "sliding_window"}
    >>> removed = {"type": "BlockRemoved", "block_hashes": [-1], "medium": "GPU", "group_idx": 1}
    >>> decoder = EngineEventDecoder("vllm")
    >>> decoder.decode(msgspec.msgpack.encode([1.5, [stored]])).events[0].block_hashes
    (18446744073709551615,)
    >>> decoder.decode(msgspec.msgpack.encode([2.0, [removed]])).events
    (BlockRemoved(block_hashes=(18446744073709551615,), tier='device', group=1, group_kind='sliding_window'),)
    """

    __slots__ = ("_kinds", "dialect")

    def __init__(self, dialect: Dialect = "vllm") -> None:
        self.dialect = _check_dialect(dialect)
        self._kinds: dict[int, str] = {}

    @property
    def group_kinds(self) -> dict[int, str]:
        """The group kinds learned so far (a copy)."""
        return dict(self._kinds)

    def decode(self, data: bytes | bytearray | memoryview) -> EngineBatch:
        """One payload -> :class:`EngineBatch`; raises :class:`EventDecodeError` and nothing else."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise EventDecodeError(f"an engine event payload must be bytes, got {type(data).__name__}")
        wire = _wire()
        try:
            return self._decode(wire, bytes(data))
        except EventDecodeError:
            raise
        except wire.DECODE_ERRORS as error:
            raise EventDecodeError(f"malformed {self.dialect} event batch: {_short(error)}") from None

    def _decode(self, wire: Any, data: bytes) -> EngineBatch:
        if not data:
            raise EventDecodeError(f"empty {self.dialect} event payload")
        if _is_map(data[0]):
            mb = wire.map_batch.decode(data)
            ts, raw_events = mb.ts, mb.events
            rank = mb.data_parallel_rank if mb.data_parallel_rank is not None else mb.attn_dp_rank
        else:
            ab = wire.array_batch.decode(data)
            ts, raw_events, rank = ab.ts, ab.events, ab.rank
        if not math.isfinite(ts):
            raise EventDecodeError(f"malformed {self.dialect} event batch: timestamp {ts!r}")
        kinds = dict(self._kinds)
        events: list[KVEvent] = []
        resets = False
        for k, raw in enumerate(raw_events):
            blob = bytes(raw)
            ev = (wire.map_event if blob and _is_map(blob[0]) else wire.array_event).decode(blob)
            if isinstance(ev, wire.MapStored | wire.ArrayStored):
                events.append(_stored(ev, kinds))
            elif isinstance(ev, wire.MapRemoved | wire.ArrayRemoved):
                events.append(_removed(ev, kinds))
            elif k == 0:
                resets = True  # a leading clear: the rest replaces the worker's view
            else:
                events.extend(_CLEAR_ALL)
        self._kinds = kinds
        return EngineBatch(float(ts), tuple(events), rank, resets)


def _is_map(first: int) -> bool:
    return 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)


def _short(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def _group(group_idx: int | None, kind: str | None, kinds: dict[int, str]) -> tuple[int | None, str | None]:
    if group_idx is None:
        return None, None
    if kind is None:
        return group_idx, kinds.get(group_idx)
    return group_idx, kind


def _stored(ev: Any, kinds: dict[int, str]) -> BlockStored:
    group_idx: int | None = getattr(ev, "group_idx", None)
    spec_kind: str | None = getattr(ev, "kv_cache_spec_kind", None)
    kind = None if spec_kind is None else SPEC_KIND_TO_GROUP_KIND.get(spec_kind)
    if group_idx is not None and kind is not None and (group_idx in kinds or len(kinds) < _MAX_GROUPS):
        kinds[group_idx] = kind
    group, group_kind = _group(group_idx, kind, kinds)
    block_size = ev.block_size or None  # 0: not known (what an encoder without it writes)
    hashes = tuple(_hash(h) for h in ev.block_hashes)
    parent = None if ev.parent_block_hash is None else _hash(ev.parent_block_hash)
    tokens = _tokens(ev.token_ids, len(hashes), block_size)
    return BlockStored(
        hashes, parent, _tier(ev.medium), tokens, group, group_kind, block_size, ev.lora_id, _text(ev.lora_name)
    )


def _removed(ev: Any, kinds: dict[int, str]) -> BlockRemoved:
    group, group_kind = _group(getattr(ev, "group_idx", None), None, kinds)
    return BlockRemoved(tuple(_hash(h) for h in ev.block_hashes), _tier(ev.medium), group, group_kind)


def decode_engine_batch(data: bytes | bytearray | memoryview, dialect: Dialect = "vllm") -> EngineBatch:
    """Decode one payload with a fresh :class:`EngineEventDecoder` (no group kinds remembered)."""
    return EngineEventDecoder(dialect).decode(data)


# ---------------------------------------------------------------------- encoding


def _wire_hash(h: BlockHash, dialect: Dialect, int_hashes: bool) -> int | bytes:
    if dialect == "sglang":
        value = sglang_int_hash(h)  # SGLang's int form: the digest's FIRST 8 bytes, written signed
        return value - (1 << 64) if value >= 1 << 63 else value
    if int_hashes or type(h) is not bytes or not h:
        return vllm_int_hash(h)  # an int's own form; raises InvalidBlockHashError for what is not a hash
    return h


def _wire_hashes(hashes: Sequence[BlockHash], dialect: Dialect, int_hashes: bool) -> list[int | bytes]:
    """``[_wire_hash(h, ...) for h in hashes]``; digests of one width (a multiple of 8 bytes, the usual case)
    are read in one ``struct.unpack`` of their concatenation, not one conversion per hash: a publisher thread
    converts every hash it sends, and holds the GIL meanwhile."""
    width = len(hashes[0]) if hashes and type(hashes[0]) is bytes else 0
    if (
        width % 8 == 0
        and width
        and (int_hashes or dialect == "sglang")
        and set(map(type, hashes)) == {bytes}
        and set(map(len, cast("Sequence[bytes]", hashes))) == {width}
    ):
        words = width // 8
        # SGLang: the first 8 bytes, signed ("q"); vLLM: the last 8, unsigned ("Q")
        signed = dialect == "sglang"
        values = struct.unpack(
            f">{len(hashes) * words}{'q' if signed else 'Q'}", b"".join(cast("Sequence[bytes]", hashes))
        )
        return list(values[0::words] if signed else values[words - 1 :: words])
    return [_wire_hash(h, dialect, int_hashes) for h in hashes]


def _medium(tier: str, dialect: Dialect) -> str:
    return _TIER_TO_MEDIUM[dialect].get(tier, tier)


def _gather(
    events: Iterable[KVEvent], dialect: Dialect
) -> tuple[list[BlockStored | BlockRemoved | None], list[BlockHash], list[list[int]]]:
    """Check ``events`` and keep those the dialect writes (None: an engine clear; a run of clears is one),
    with every hash of them (parents after their blocks) and each stored event's token ids as a list."""
    kept: list[BlockStored | BlockRemoved | None] = []
    hashes: list[BlockHash] = []
    tokens: list[list[int]] = []
    for event in events:
        if not isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared):
            raise InvalidArgumentError(f"not a KV event: {event!r}")
        if isinstance(event, AllBlocksCleared):
            if not kept or kept[-1] is not None:  # one engine clear clears every tier
                kept.append(None)
            continue
        if dialect == "sglang" and not is_prefix_event(event):  # the only events its group-less dialect carries
            continue
        kept.append(event)
        hashes.extend(event.block_hashes)
        if isinstance(event, BlockStored):
            if event.parent_hash is not None:
                hashes.append(event.parent_hash)
            ids = event.token_ids or ()
            if not are_token_ids(ids):
                raise InvalidTokenError(
                    f"cannot encode BlockStored: token ids must be ints in [0, 2**32), got {brief(ids)}"
                )
            tokens.append(ids.tolist() if type(ids) is array else list(ids))
    return kept, hashes, tokens


def _engine_events(events: Iterable[KVEvent], dialect: Dialect, int_hashes: bool, wire: Any) -> list[Any]:
    """The engine structs of ``events``, in order: every hash of the batch is converted at once
    (:func:`_wire_hashes`), then the structs take their share."""
    stored_cls, removed_cls, cleared_cls, _ = _OUT[dialect](wire)
    kept, hashes, tokens = _gather(events, dialect)
    values = iter(_wire_hashes(hashes, dialect, int_hashes))
    token_lists = iter(tokens)
    out: list[Any] = []
    for event in kept:
        if event is None:
            out.append(cleared_cls())
            continue
        wire_hashes = list(itertools.islice(values, len(event.block_hashes)))
        medium = _medium(event.tier, dialect)
        if isinstance(event, BlockRemoved):
            group = () if dialect == "sglang" else (event.group,)
            out.append(removed_cls(wire_hashes, medium, *group))
            continue
        parent = None if event.parent_hash is None else next(values)
        args = (wire_hashes, parent, next(token_lists), event.block_size or 0, event.lora_id, medium)
        if dialect == "vllm":
            kind = None if event.group_kind is None else _GROUP_KIND_TO_SPEC_KIND.get(event.group_kind)
            out.append(stored_cls(*args, event.lora_name, None, event.group, kind))
        else:
            out.append(stored_cls(*args, lora_name=event.lora_name))
    return out


_OUT = {
    "vllm": lambda w: (w.VllmStored, w.VllmRemoved, w.Cleared, w.VllmBatch),
    "sglang": lambda w: (w.SglangStored, w.SglangRemoved, w.Cleared, w.SglangBatch),
}


def _check_batch_args(timestamp: float, dp_rank: int | None) -> float:
    """A batch's timestamp (as a float) and data-parallel rank, checked for every encoder of the batch."""
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or not math.isfinite(timestamp):
        raise InvalidArgumentError(f"cannot encode batch: timestamp must be a finite number, got {timestamp!r}")
    if dp_rank is not None and (type(dp_rank) is not int or not 0 <= dp_rank <= MAX_INT):
        raise InvalidArgumentError(f"dp_rank must be None or an int in 0..{MAX_INT}, got {dp_rank!r}")
    return float(timestamp)


def encode_engine_events(
    events: Iterable[KVEvent],
    timestamp: float,
    dialect: Dialect = "vllm",
    *,
    int_hashes: bool = True,
    dp_rank: int | None = None,
    snapshot: bool = False,
) -> bytes:
    """:func:`encode_engine_batch` of the batch ``(timestamp, events)``.

    ``events`` may be a generator (:func:`kvblocks.events.codec.build_pending`): it is read once. The bytes are
    those msgspec writes for the whole batch of structs (tests compare them); the hashes of the batch are
    converted together: a publisher thread holds the GIL while it encodes.
    """
    dialect = _check_dialect(dialect)
    ts = _check_batch_args(timestamp, dp_rank)
    wire = _wire()
    if snapshot:
        events = itertools.chain((AllBlocksCleared("device"),), events)
    try:
        body = _engine_events(events, dialect, int_hashes, wire)
        payload: bytes = wire.encoder.encode(_OUT[dialect](wire)[3](ts, body, dp_rank))
    except (TypeError, OverflowError) as error:  # an int field beyond 64 bits
        raise InvalidArgumentError(f"cannot encode batch: {error}") from None
    return payload


def encode_engine_batch(
    batch: EventBatch,
    dialect: Dialect = "vllm",
    *,
    int_hashes: bool = True,
    dp_rank: int | None = None,
) -> bytes:
    """``batch`` as one payload of ``dialect``'s ``KVEventBatch`` (see the module docstring).

    ``batch.producer`` and ``batch.seq`` are not in the payload: the seq travels in its own ZMQ frame.
    Raises :class:`InvalidArgumentError` for a batch with no encoding (a bad hash, a non-finite time).
    """
    if not isinstance(batch, EventBatch):
        raise InvalidArgumentError(f"not an EventBatch: {type(batch).__name__}")
    return encode_engine_events(
        batch.events, batch.timestamp, dialect, int_hashes=int_hashes, dp_rank=dp_rank, snapshot=batch.snapshot
    )


def _check_kinds() -> None:  # pragma: no cover - a mismatch is a programming error caught at import
    if set(SPEC_KIND_TO_GROUP_KIND.values()) - set(EVENT_GROUP_KINDS):
        raise ImportError("SPEC_KIND_TO_GROUP_KIND names a group kind kvblocks does not know")


_check_kinds()
