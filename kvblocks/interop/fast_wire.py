"""The engine wire's payload written straight from a sink's pending entries: the bytes of
:func:`kvblocks.interop.engine_wire.encode_engine_events`, without its intermediate objects.

The publisher thread of :class:`kvblocks.interop.zmq_events.ZmqEventPublisher` holds the GIL while it encodes,
and on a small machine every millisecond it holds it is taken from the engine's thread. The reference encoder
builds a ``KVEvent`` per entry, then an engine struct per event, a Python int per token id and hash, and lets
msgspec write the structs: ~5 us per event, ~14 ms per lifecycle of the publishing benchmark. This one
writes msgpack itself, in less than half that:

* a cache's entries (``partial(stored_event, tier, group, kind, block_size)`` with hashes, parent, token id
  bytes and LoRA name; ``partial(stored_range_event, ...)`` with a sequence's hashes, a block range, its
  token array and LoRA name; ``partial(removed_event, ...)``) are read without building an event;
* the bytes between the variable parts of an event are constant per (tier, group, kind, block size, LoRA id):
  written once and kept (:func:`_stored_template`);
* every hash and every token id of the batch is written in a few whole-batch C passes (strided byte copies:
  :func:`_pack_hashes`, :func:`_pack_tokens`), each value in the int form msgspec picks for it;
* anything else (an entry of another factory, an event of an unusual shape) is built and written by the
  reference encoder, one event at a time, and spliced in: msgspec writes a struct alone as it writes it
  inside the batch.

The output is byte for byte the reference's (``tests/interop/test_fast_wire.py`` compares them on random batches of
every kind of entry, both dialects, both hash forms). Bad input raises what the reference raises.
"""

from __future__ import annotations

import itertools
import struct
import sys
from array import array
from collections.abc import Sequence
from functools import partial
from typing import Any, cast

from kvblocks.errors import InvalidArgumentError, InvalidTokenError
from kvblocks.events.codec import (
    NO_ARG,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    PendingEvent,
    are_token_ids,
    is_prefix_event,
    pending_args,
    range_parts,
    removed_event,
    stored_event,
    stored_range_event,
)
from kvblocks.hashing import BlockHash
from kvblocks.interop import engine_wire
from kvblocks.interop.engine_wire import Dialect, _check_batch_args, _check_dialect, _wire_hashes
from kvblocks.strict_json import MAX_INT, brief

__all__ = ["encode_pending_events"]

_U64 = (1 << 64) - 1
_NIL = b"\xc0"
_TOKENS_ARE_U32 = array("I").itemsize == 4  # the token id bytes a cache records are an array('I')'s


# ---------------------------------------------------------------------- msgpack scalars, as msgspec writes them


def _int(value: int) -> bytes:
    """The smallest msgpack form of ``value`` (an int in ``0..2**64-1``: every int this module writes itself),
    as msgspec picks it: a positive fixint, else the narrowest of uint8/16/32/64."""
    if value < 0x80:
        return bytes((value,))
    for marker, fmt, bound in ((0xCC, ">B", 1 << 8), (0xCD, ">H", 1 << 16), (0xCE, ">I", 1 << 32)):
        if value < bound:
            return bytes((marker,)) + struct.pack(fmt, value)
    return b"\xcf" + struct.pack(">Q", value)


def _opt_int(value: int | None) -> bytes:
    return _NIL if value is None else _int(value)


def _str(text: str) -> bytes:
    data = text.encode()  # a lone surrogate raises UnicodeEncodeError, as msgspec does
    n = len(data)
    if n < 32:
        return bytes((0xA0 | n,)) + data
    if n < 1 << 8:
        return b"\xd9" + struct.pack(">B", n) + data
    if n < 1 << 16:
        return b"\xda" + struct.pack(">H", n) + data
    return b"\xdb" + struct.pack(">I", n) + data


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + struct.pack(">H", n)
    return b"\xdd" + struct.pack(">I", n)


_CACHED = 1024
_ARRAY_HEADERS = [_array_header(n) for n in range(_CACHED)]


def _header(n: int) -> bytes:
    return _ARRAY_HEADERS[n] if n < _CACHED else _array_header(n)


def _map(n: int, fields: int) -> bytes:
    """A struct's map header: msgspec sizes it by the struct's field count (its tag included), not by the
    fields written: a fixmap for up to 15, else a map16 (vLLM's ``BlockStored`` has 17)."""
    return bytes((0x80 | n,)) if fields < 16 else b"\xde" + struct.pack(">H", n)


# ---------------------------------------------------------------------- many ints at once
#
# A batch's hashes and token ids are written in a few whole-batch passes, each a C loop that holds the GIL:
# strided byte copies (``out[1::3] = ids[1::4]``) and ``bytes.count`` / ``find``. Not numpy: each numpy call
# on a large array releases the GIL, and every release hands it to the engine's thread and forces it back
# (measured: the same encoding through numpy cost the engine's thread more than msgspec's slower path).


def _encoder() -> Any:
    return engine_wire._wire().encoder


def _strip_header(data: bytes, count: int) -> bytes:
    """msgspec's encoding of a sequence of ``count`` values, without its array header."""
    return data[len(_header(count)) :]


def _cut(data: bytes, ends: list[int]) -> list[bytes]:
    """``data`` cut at ``ends`` (offsets, the first 0)."""
    return [data[a:b] for a, b in zip(ends, ends[1:])]  # noqa: RUF007  - itertools.pairwise is slower here


def _no_zero_word(data: bytes, start: int, step: int) -> bool:
    """Whether no ``step``-byte record of ``data`` has 4 zero bytes at ``start`` (a value below ``2**32``)."""
    if data[start::step].count(0) == 0:  # the usual answer, from one byte of each
        return True
    words = 0
    for k in range(4):
        words |= int.from_bytes(data[start + k :: step], "big")
    return words.to_bytes(len(data) // step, "big").count(0) == 0


def _pack_hashes(hashes: list[BlockHash], counts: list[int], dialect: Dialect, int_hashes: bool) -> list[bytes]:
    """Every hash in its wire form (:func:`~kvblocks.interop.engine_wire._wire_hash`), one piece per group of
    ``counts`` hashes, without array headers (a count of -1: one hash, a parent).

    vLLM's int form of digests of one width is copied from the digests' bytes: each hash is ``cf`` and the
    digest's last 8 bytes, when none is below ``2**32`` (all but one in four billion). Anything else goes
    through the reference's conversion (:func:`~kvblocks.interop.engine_wire._wire_hashes`) and msgspec.
    """
    n = len(hashes)
    first = hashes[0] if n else None
    width = len(first) if type(first) is bytes else 0
    if (
        width
        and width % 8 == 0
        and int_hashes
        and dialect == "vllm"
        and list(map(type, hashes)).count(bytes) == n
        and list(map(len, hashes)).count(width) == n  # type: ignore[arg-type]
    ):
        joined = b"".join(hashes)  # type: ignore[arg-type]
        low = width - 8  # the last 8 bytes, big-endian: the int
        if _no_zero_word(joined, low, width):
            out = bytearray(9 * n)
            out[0::9] = b"\xcf" * n
            for k in range(8):
                out[1 + k :: 9] = joined[low + k :: width]
            return _cut(bytes(out), [0, *itertools.accumulate(9 if c < 0 else 9 * c for c in counts)])
    values = _wire_hashes(hashes, dialect, int_hashes)  # raises what the reference raises
    encode = _encoder().encode
    pieces: list[bytes] = []
    at = 0
    for count in counts:
        if count < 0:
            pieces.append(encode(values[at]))
            at += 1
        else:
            pieces.append(_strip_header(encode(values[at : at + count]), count))
            at += count
    return pieces


_SPARSE = 16  # token ids below 256, at most one in this many for the uint16 path
_BYTE_FORMS = [bytes((k,)) if k < 0x80 else bytes((0xCC, k)) for k in range(256)]  # ids below 256


def _pack_tokens(chunks: list[bytes]) -> list[bytes]:
    """Each stored event's token ids (the native bytes of an ``array('I')``) in their msgpack forms, one piece
    per event, without array headers.

    A vocabulary below 65536 makes nearly every id a uint16, ``cd`` and 2 big-endian bytes: those are
    written for all ids by three strided copies of their bytes; the few below 256 are then written in their
    own forms (``cc`` and a byte, or the byte itself) in their places. Other batches go through msgspec.
    """
    data = b"".join(chunks)
    n = len(data) >> 2
    if not n:
        return [b""] * len(chunks)
    ends = [0, *itertools.accumulate(len(c) >> 2 for c in chunks)]
    if sys.byteorder == "little" and data[2::4].count(0) == n and data[3::4].count(0) == n:  # all < 65536
        high = data[1::4]
        small = high.count(0)  # ids below 256
        if small * _SPARSE <= n:
            out = bytearray(3 * n)
            out[0::3] = b"\xcd" * n
            out[1::3] = high
            out[2::3] = data[0::4]
            if not small:
                return _cut(bytes(out), [3 * e for e in ends])
            return _splice(bytes(out), data[0::4], high, ends)
    encode = _encoder().encode
    return [_strip_header(encode(memoryview(c).cast("I").tolist()), len(c) >> 2) for c in chunks]


def _splice(uniform: bytes, low: bytes, high: bytes, ends: list[int]) -> list[bytes]:
    """Cut ``uniform`` (every id as a uint16, 3 bytes) at the chunks' ``ends`` (in ids), each id below 256
    (a zero ``high`` byte) written in its own form (:data:`_BYTE_FORMS`) instead."""
    pieces: list[bytes] = []
    odd = high.find(0)
    for at, end in zip(ends, ends[1:]):  # noqa: RUF007
        if odd < 0 or odd >= end:  # no small id in this chunk: one slice
            pieces.append(uniform[3 * at : 3 * end])
            continue
        parts: list[bytes] = []
        start = at
        while 0 <= odd < end:
            parts.append(uniform[3 * start : 3 * odd])
            parts.append(_BYTE_FORMS[low[odd]])
            start = odd + 1
            odd = high.find(0, start)
        parts.append(uniform[3 * start : 3 * end])
        pieces.append(b"".join(parts))
    return pieces


# ---------------------------------------------------------------------- the constant parts of an event


_STORED_FIELDS = {"vllm": 17, "sglang": 10}  # the engine structs' field counts, tag included
_TYPE = _str("type")
_STORED_HEAD = _TYPE + _str("BlockStored") + _str("block_hashes")
_REMOVED_HEAD = _TYPE + _str("BlockRemoved") + _str("block_hashes")
_PARENT = _str("parent_block_hash")
_TOKENS = _str("token_ids")
_CLEARED = b"\x81" + _TYPE + _str("AllBlocksCleared")
_TOKENS_HEADERS = [_TOKENS + header for header in _ARRAY_HEADERS]
_K_BLOCK_SIZE, _K_LORA_ID, _K_MEDIUM, _K_LORA_NAME = map(_str, ("block_size", "lora_id", "medium", "lora_name"))
_K_GROUP, _K_KIND = _str("group_idx"), _str("kv_cache_spec_kind")

_Template = tuple[bytes, bytes, bytes, bytes, bytes]
"""A stored event's constant parts: the head up to its hashes (without / with a LoRA name: SGLang's map size
counts it), the bytes after the token ids up to the LoRA name's value, those after it, and both joined
around a nil LoRA name (the usual case: one piece)."""

_templates: dict[tuple[Any, ...], Any] = {}
_MAX_TEMPLATES = 4096  # a cache has a few (tier, group) pairs; past this bound the cache starts over


def _is_int(value: object, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def _stored_template(
    dialect: Dialect, tier: str, group: int | None, kind: str | None, size: int | None, lora_id: int | None
) -> _Template | None:
    """The constant parts of a stored event with these tags; None: an unusual value the reference writes."""
    if not (
        type(tier) is str
        and (group is None or _is_int(group, 0, MAX_INT))
        and (kind is None or type(kind) is str)
        and (size is None or _is_int(size, 0, MAX_INT))
        and (lora_id is None or _is_int(lora_id, 0, _U64))
    ):
        return None
    medium = _str(engine_wire._medium(tier, dialect))
    middle = _K_BLOCK_SIZE + _int(size or 0) + _K_LORA_ID + _opt_int(lora_id) + _K_MEDIUM + medium
    if dialect == "sglang":  # 7 fields and the LoRA name when there is one (nil is omitted)
        heads = [_map(7 + extra, _STORED_FIELDS[dialect]) + _STORED_HEAD for extra in (0, 1)]
        return heads[0], heads[1], middle + _K_LORA_NAME, b"", middle
    spec = None if kind is None else engine_wire._GROUP_KIND_TO_SPEC_KIND.get(kind)
    tail = (b"" if group is None else _K_GROUP + _int(group)) + (b"" if spec is None else _K_KIND + _str(spec))
    head = _map(8 + (group is not None) + (spec is not None), _STORED_FIELDS[dialect]) + _STORED_HEAD
    middle += _K_LORA_NAME
    return head, head, middle, tail, middle + _NIL + tail


def _removed_template(dialect: Dialect, tier: str, group: int | None) -> tuple[bytes, bytes] | None:
    """A removed event's head (up to its hashes) and the bytes after them."""
    if type(tier) is not str or not (group is None or _is_int(group, 0, MAX_INT)):
        return None
    after = _K_MEDIUM + _str(engine_wire._medium(tier, dialect))
    if dialect == "sglang" or group is None:
        return _map(3, 6) + _REMOVED_HEAD, after
    return _map(4, 6) + _REMOVED_HEAD, after + _K_GROUP + _int(group)


# ---------------------------------------------------------------------- the batch

_STORED, _REMOVED, _STORED_RANGE = 1, 2, 3
_PARENT_NIL = _PARENT + _NIL
_SEQUENCES = (list, tuple)

# What the factory of an entry is, per dialect: (_STORED, skip, *stored template), (_STORED_RANGE, skip,
# *stored template, block size), (_REMOVED, skip, *removed template), or False (entries the reference
# writes). Keyed by the factory object itself: a cache's partial is made once and its tags never change.
_specs: dict[str, dict[object, Any]] = {"vllm": {}, "sglang": {}}


def _is_prefix(group: object, kind: object) -> bool:
    """:func:`~kvblocks.events.codec.is_prefix_event` of an event with these tags."""
    return kind == "full" or (kind is None and group in (None, 0))


def _spec_of(dialect: Dialect, factory: object) -> Any:
    """The spec of ``factory`` (see ``_specs``), made and kept."""
    specs = _specs[dialect]
    if len(specs) >= _MAX_TEMPLATES:
        specs.clear()
    spec: Any = False
    if type(factory) is partial and not factory.keywords:
        tags = factory.args
        if factory.func in (stored_event, stored_range_event) and len(tags) == 4:
            template = _stored_template(dialect, *tags, None)
            if template is not None:
                skip = dialect == "sglang" and not _is_prefix(tags[1], tags[2])
                if factory.func is stored_event:
                    spec = (_STORED, skip, *template)
                else:
                    spec = (_STORED_RANGE, skip, *template, tags[3])
        elif factory.func is removed_event and len(tags) == 3:
            removed = _removed_template(dialect, *tags[:2])
            if removed is not None:
                spec = (_REMOVED, dialect == "sglang" and not _is_prefix(tags[1], tags[2]), *removed)
    specs[factory] = spec
    return spec


def _event_spec(dialect: Dialect, event: object) -> Any:
    """The spec of a built ``BlockStored`` / ``BlockRemoved`` of a usual shape (else False), by its tags and
    their types (``1`` and ``True`` are equal keys, not equal bytes)."""
    if type(event) is BlockStored:
        tags: tuple[Any, ...] = (event.tier, event.group, event.group_kind, event.block_size, event.lora_id)
    elif type(event) is BlockRemoved:
        tags = (event.tier, event.group, event.group_kind)
    else:
        return False
    key = (dialect, tags, tuple(map(type, tags)))
    try:
        return _templates[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable tag
        return False
    if len(_templates) >= _MAX_TEMPLATES:
        _templates.clear()
    skip = dialect == "sglang" and not _is_prefix(tags[1], tags[2])
    if len(tags) == 5:
        template: Any = _stored_template(dialect, *tags)
        spec = False if template is None else (_STORED, skip, *template)
    else:
        template = _removed_template(dialect, *tags[:2])
        spec = False if template is None else (_REMOVED, skip, *template)
    _templates[key] = spec
    return spec


def _event_tokens(ids: object) -> bytes | None:
    """A built event's token ids as an ``array('I')``'s bytes (checked); None: a form left to the reference."""
    if ids is None:
        return b""
    if type(ids) is array and ids.typecode == "I" and _TOKENS_ARE_U32:
        return ids.tobytes()
    if type(ids) in _SEQUENCES and _TOKENS_ARE_U32:
        seq = cast("Sequence[int]", ids)
        if not are_token_ids(seq):
            raise InvalidTokenError(
                f"cannot encode BlockStored: token ids must be ints in [0, 2**32), got {brief(seq)}"
            )
        return array("I", seq).tobytes()
    return None


class _Payload:
    """One payload being written: the events' bytes in order, with holes for their hashes and token ids,
    which are written for the whole batch at once and then put in the holes."""

    __slots__ = (
        "cleared",
        "dialect",
        "events",
        "hash_counts",
        "hash_holes",
        "hashes",
        "int_hashes",
        "out",
        "token_holes",
        "tokens",
    )

    def __init__(self, dialect: Dialect, int_hashes: bool) -> None:
        self.dialect = dialect
        self.int_hashes = int_hashes
        self.out: list[bytes | None] = []
        self.hashes: list[BlockHash] = []
        self.hash_counts: list[int] = []  # per hole: that many hashes in an array, or -1: one parent
        self.hash_holes: list[int] = []
        self.tokens: list[bytes] = []
        self.token_holes: list[int] = []
        self.cleared = False  # the last event written is an engine clear (a run of clears is one)
        self.events = 0

    def add(self, entries: Sequence[PendingEvent]) -> None:
        """Plan the events of ``entries``; a cache's usual entries inline, others through :meth:`other`."""
        specs = _specs[self.dialect]
        out, hashes, counts, hash_holes = self.out, self.hashes, self.hash_counts, self.hash_holes
        for entry in entries:
            factory = entry[2]
            try:
                spec: Any = specs.get(factory)
            except TypeError:  # an unhashable factory: never a cache's
                spec = False
            if spec is None:
                spec = False if factory is None else _spec_of(self.dialect, factory)
            if not spec or len(entry) != 8:
                self.other(entry)
                continue
            block_hashes = entry[3]
            if spec[0] == _STORED_RANGE:
                self.stored_range(spec, entry)
                continue
            if spec[0] == _REMOVED:
                if type(block_hashes) not in _SEQUENCES or entry[4] is not NO_ARG or entry[5] is not NO_ARG:
                    self.other(entry)
                elif not spec[1]:
                    n = len(block_hashes)
                    out.append(spec[2] + _header(n))
                    hash_holes.append(len(out))
                    out.append(None)
                    out.append(spec[3])
                    hashes.extend(block_hashes)
                    counts.append(n)
                    self.cleared = False
                    self.events += 1
                continue
            parent, ids, lora = entry[4], entry[5], entry[6]
            if (
                entry[7] is not NO_ARG
                or type(block_hashes) not in _SEQUENCES
                or not (lora is None or type(lora) is str)
                or not (ids is None or (type(ids) is bytes and not len(ids) & 3))
            ):
                self.other(entry)
            elif not spec[1]:
                self.stored(spec, block_hashes, parent, ids or b"", lora)

    def stored_range(self, spec: Any, entry: PendingEvent) -> None:
        """A ``stored_range_event`` entry: its parts sliced from the sequence's hashes and tokens here."""
        chain, start, stop, tokens, lora = entry[3:]
        if not (
            type(chain) in _SEQUENCES
            and type(start) is int
            and type(stop) is int
            and 0 <= start <= stop <= len(chain)
            and (tokens is None or (type(tokens) is array and tokens.typecode == "I"))
            and (lora is None or type(lora) is str)
        ):
            self.other(entry)
        elif not spec[1]:
            hashes, parent, ids = range_parts(chain, start, stop, tokens, spec[7])
            self.stored(spec, hashes, parent, b"" if ids is None else ids.tobytes(), lora)  # type: ignore[attr-defined]

    def stored(self, spec: Any, block_hashes: Sequence[BlockHash], parent: object, ids: bytes, lora: object) -> None:
        out = self.out
        n, nt = len(block_hashes), len(ids) >> 2
        head, head_lora, middle, tail, middle_nil_tail = spec[2:7]
        out.append((head if lora is None else head_lora) + _header(n))  # SGLang's map counts a LoRA name
        self.hash_holes.append(len(out))
        out.append(None)
        self.hashes.extend(block_hashes)
        self.hash_counts.append(n)
        if parent is None:
            out.append(_PARENT_NIL)
        else:
            out.append(_PARENT)
            self.hash_holes.append(len(out))
            out.append(None)
            self.hashes.append(parent)  # type: ignore[arg-type]
            self.hash_counts.append(-1)
        out.append(_TOKENS_HEADERS[nt] if nt < _CACHED else _TOKENS + _header(nt))
        self.token_holes.append(len(out))
        out.append(None)
        self.tokens.append(ids)
        out.append(middle_nil_tail if lora is None else middle + _str(lora) + tail)  # type: ignore[arg-type]
        self.cleared = False
        self.events += 1

    def other(self, entry: PendingEvent) -> None:
        """An entry the inline path does not read: its event built, then planned like a cache's (a usual
        shape) or written by the reference encoder."""
        factory = entry[2]
        event = entry[3] if factory is None else factory(*pending_args(entry))
        if type(event) is AllBlocksCleared:
            if not self.cleared:
                self.out.append(_CLEARED)
                self.cleared = True
                self.events += 1
            return
        spec = _event_spec(self.dialect, event)
        if spec and type(event.block_hashes) in _SEQUENCES:
            if spec[1]:
                return  # not in SGLang's dialect
            ids = _event_tokens(event.token_ids) if spec[0] == _STORED else b""
            if ids is not None:
                if spec[0] == _STORED:
                    self.stored(spec, event.block_hashes, event.parent_hash, ids, event.lora_name)
                else:
                    self.removed(spec, event.block_hashes)
                return
        self.reference(event)

    def removed(self, spec: Any, block_hashes: Sequence[BlockHash]) -> None:
        out = self.out
        n = len(block_hashes)
        out.append(spec[2] + _header(n))
        self.hash_holes.append(len(out))
        out.append(None)
        out.append(spec[3])
        self.hashes.extend(block_hashes)
        self.hash_counts.append(n)
        self.cleared = False
        self.events += 1

    def reference(self, event: object) -> None:
        """``event`` written alone by the reference encoder (its checks and errors included)."""
        if not isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared):
            raise InvalidArgumentError(f"not a KV event: {event!r}")
        if self.dialect == "sglang" and not is_prefix_event(event):
            return
        wire = engine_wire._wire()
        (written,) = engine_wire._engine_events((event,), self.dialect, self.int_hashes, wire)
        try:
            self.out.append(wire.encoder.encode(written))
        except (TypeError, OverflowError) as error:
            raise InvalidArgumentError(f"cannot encode batch: {error}") from None
        self.cleared = False
        self.events += 1

    def body(self) -> tuple[int, list[bytes]]:
        """The number of events written and their bytes (the holes filled)."""
        out = self.out
        hashes = _pack_hashes(self.hashes, self.hash_counts, self.dialect, self.int_hashes)
        for hole, piece in zip(self.hash_holes, hashes, strict=True):
            out[hole] = piece
        for hole, piece in zip(self.token_holes, _pack_tokens(self.tokens), strict=True):
            out[hole] = piece
        return self.events, out  # type: ignore[return-value]


def encode_pending_events(
    entries: Sequence[PendingEvent],
    timestamp: float,
    dialect: Dialect = "vllm",
    *,
    int_hashes: bool = True,
    dp_rank: int | None = None,
) -> bytes:
    """The payload of the events of ``entries`` (:data:`~kvblocks.events.codec.PendingEvent`, as a sink holds
    them): ``encode_engine_events(build_pending(entries), timestamp, ...)``'s bytes, written without building
    the events a cache recorded (see the module docstring). Raises what that raises."""
    dialect = _check_dialect(dialect)
    ts = _check_batch_args(timestamp, dp_rank)
    payload = _Payload(dialect, bool(int_hashes))
    payload.add(entries)
    count, body = payload.body()
    head = b"\x93\xcb" + struct.pack(">d", ts) + _array_header(count)
    return b"".join((head, *body, _opt_int(dp_rank)))
