"""What a stored block looks like: its key, and a fixed header in front of its payload.

One key per block -- scheme, namespace tag, format tag (:attr:`EntryFormat.tag`), block hash,
and the tensor-parallel rank where shards differ -- made of ``[a-z0-9.-]`` only, so a file or
Redis key is never built from caller-supplied text::

    xxh3-128.3f9c0a1b2c3d4e5f.91c2d3e4f5a6b7c8.b6a1f...e2      bytes hash of the default scheme
    xxh3-64-1337.0000000000000000.91c2d3e4f5a6b7c8.i1d2c3.r1   int hash, rank 1

The format tag keeps KV formats apart: a float16 and a bfloat16 deployment of one model (same
namespace, same hashes) never see each other's entries, so neither skips its own writes.

The value is a fixed 128-byte header, then the block's payload (``Backend.gather``'s bytes)::

    magic "KVBENTRY" | version (3) | ndim | scheme | dtype | shape (8 dims) | spec fingerprint
    | payload length | 20 zero bytes | xxh3-64 of the key it was written under
    | xxh3-64 checksum of the payload | payload ...

The zero bytes put the payload on a 64-byte boundary of the file, hence of the page cache: a read
straight into KV tensors (cache-line aligned) copies line to line. At 108 bytes the source sat 44
bytes off every destination line and the kernel's copy into a block's layer views took ~30% longer
(16 entries of 2 MiB: 3.2 ms against 2.5 ms at offsets 64, 128 and 4096).

A reader decodes against the format it expects, and the key it read: a different magic, version,
scheme, dtype, shape or spec, a short or long payload, a checksum that does not match, or a
sound entry written under another key (copied or renamed) makes the entry a miss with a reason --
never wrong KV. Since the key's format tag names the whole header prefix, no sound entry of another
version or spec is ever stored under a key of this format: such a header is damage, and the storage
tier removes it like any corrupt entry.
"""

from __future__ import annotations

import re
import struct
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property

import xxhash

from kvblocks.backends.spec import KVCacheSpec
from kvblocks.errors import ConfigError, InvalidArgumentError, InvalidBlockHashError
from kvblocks.hashing import BlockHash, Namespace

__all__ = [
    "FORMAT_VERSION",
    "HEADER",
    "EntryFormat",
    "StreamedChecksum",
    "block_key",
    "group_tag",
    "key_digest",
    "namespace_tag",
    "valid_key",
]

MAGIC = b"KVBENTRY"
FORMAT_VERSION = 3
"""1: no key digest (100-byte header); 2: the key's digest before the checksum (108 bytes); 3: padded
to 128 bytes, the payload cache-line aligned."""
HEADER = struct.Struct("<8sHH16s16s8IQQ20xQQ")
PAYLOAD_ALIGNMENT = 64
if HEADER.size % PAYLOAD_ALIGNMENT:  # pragma: no cover - a layout edit that forgot the padding
    raise ImportError(f"the entry header is {HEADER.size} bytes, not a multiple of {PAYLOAD_ALIGNMENT}")
_KEY = re.compile(r"[a-z0-9][a-z0-9.\-]{0,250}")
_TAG = re.compile(r"[0-9a-f]{16}")
_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend  # runs an iterator to its end in C
_UNBOUND = 0  # the key digest of an entry encoded without a key: never served under any key


def namespace_tag(namespace: str | Namespace, scheme: str, block_size: int) -> str:
    """16 hex digits naming a key space: the namespace, scheme and block size that produced the hashes."""
    return Namespace.of(namespace).tag(scheme, block_size)


def group_tag(tag: str, group: int, kind: str, block_size: int, span: int) -> str:
    """16 hex digits naming the key space of a hybrid manager's local group ``group`` under ``tag``.

    A local group's block and a full-attention block under the same chain hash hold different KV,
    so each local group stores under a tag of its own: its index, kind, block size and span.

    >>> group_tag("0123456789abcdef", 1, "sliding_window", 16, 4096) != "0123456789abcdef"
    True
    """
    material = f"kvblocks-group.{tag}.{group}.{kind}.{block_size}.{span}".encode()
    return f"{xxhash.xxh3_64_intdigest(material):016x}"


def block_key(tag: str, scheme: str, block_hash: BlockHash, rank: int | None = None, *, format_tag: str) -> str:
    """The storage key of one block (see the module docstring for the shape).

    ``format_tag`` is :attr:`EntryFormat.tag` of the entries' format: different KV formats get
    different keys, so one never finds (or skips writing over) the other's entries.
    """
    if not isinstance(format_tag, str) or not _TAG.fullmatch(format_tag):
        raise InvalidArgumentError(f"format_tag must be 16 lowercase hex digits (EntryFormat.tag), got {format_tag!r}")
    if isinstance(block_hash, bytes) and block_hash:
        digest = "b" + block_hash.hex()
    elif isinstance(block_hash, int) and not isinstance(block_hash, bool) and block_hash >= 0:
        digest = f"i{block_hash:x}"
    else:
        raise InvalidBlockHashError(f"a block hash must be non-empty bytes or an int >= 0, got {block_hash!r}")
    key = f"{scheme}.{tag}.{format_tag}.{digest}"
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise InvalidArgumentError(f"rank must be an int >= 0, got {rank!r}")
        key += f".r{rank}"
    return valid_key(key)


def valid_key(key: str) -> str:
    """``key`` itself, if it is a well-formed storage key; raises otherwise (a path can never sneak in)."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise InvalidArgumentError(f"{key!r} is not a storage key (lowercase letters, digits, '.' and '-')")
    return key


def key_digest(key: str) -> int:
    """The xxh3-64 of ``key`` that an entry's header carries: which key the entry was written under."""
    return xxhash.xxh3_64_intdigest(valid_key(key).encode("ascii"))


def _fixed(text: str, what: str) -> bytes:
    raw = text.encode("ascii")
    if len(raw) > 16:
        raise ConfigError(f"{what} {text!r} does not fit the 16-byte header field")
    return raw.ljust(16, b"\0")


def _byte_view(data: object) -> memoryview | None:
    """``data`` as a flat view of bytes, or None for a value no backend should have returned."""
    try:
        view = memoryview(data)  # type: ignore[arg-type]
        if not view.c_contiguous:
            view = memoryview(view.tobytes())
        return view.cast("B")
    except (TypeError, ValueError):
        return None


class StreamedChecksum:
    """The checksum of an entry's payload taken run by run while a read lands, e.g. as
    ``FileStorage.get_into``'s ``on_read``: each part is hashed while it is still in the CPU's cache.

    The first part fed after :meth:`start` is the entry's header and is skipped; the rest are the
    payload. :meth:`EntryFormat.check_read` takes it in place of hashing the payload again, and calls
    a payload fed short a truncated one. One per thread, reused entry after entry.
    """

    __slots__ = ("_digest", "_header_pending", "payload_bytes")

    def __init__(self) -> None:
        self._digest = xxhash.xxh3_64()
        self._header_pending = True
        self.payload_bytes = 0

    def start(self) -> StreamedChecksum:
        """Forget the last entry: the next part fed is a header. Returns itself."""
        self._digest.reset()
        self._header_pending = True
        self.payload_bytes = 0
        return self

    def __call__(self, parts: Sequence[memoryview]) -> None:
        """Feed the next ``parts`` of the entry, in order (the header first)."""
        if self._header_pending and parts:
            self._header_pending = False
            parts = parts[1:]
        _consume(map(self._digest.update, parts))  # no Python frame per part
        self.payload_bytes += sum(map(len, parts))

    def intdigest(self) -> int:
        """The xxh3-64 of the payload fed so far."""
        return self._digest.intdigest()


@dataclass(frozen=True)
class EntryFormat:
    """The header every entry of one cache spec and hash scheme carries, and its codec."""

    scheme: str
    dtype: str
    shape: tuple[int, ...]
    fingerprint: int
    payload_length: int

    @classmethod
    def for_spec(cls, spec: KVCacheSpec, scheme: str) -> EntryFormat:
        planes = 2 if spec.has_values else 1
        shape = (spec.num_layers, planes, *spec.block_shape)
        description = repr(sorted((k, v) for k, v in asdict(spec).items() if k != "block_major")).encode()
        return cls(scheme, spec.dtype, shape, xxhash.xxh3_64_intdigest(description), spec.bytes_per_block)

    def __post_init__(self) -> None:
        if len(self.shape) > 8:
            raise ConfigError(f"an entry shape has at most 8 dimensions, got {self.shape}")
        _ = self._prefix  # validates the text fields

    @cached_property
    def tag(self) -> str:
        """16 hex digits naming this format (every header field but the key and checksum) in keys.

        Two formats share keys only if their headers agree: a dtype, shape, spec or scheme change
        (or a format version bump) moves to a key space of its own.
        """
        material = b"kvblocks-format." + self._prefix
        return f"{xxhash.xxh3_64_intdigest(material):016x}"

    @cached_property
    def _prefix(self) -> bytes:
        """The header up to the key digest: the same for every entry of this format."""
        dims = list(self.shape) + [0] * (8 - len(self.shape))
        return HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            len(self.shape),
            _fixed(self.scheme, "scheme"),
            _fixed(self.dtype, "dtype"),
            *dims,
            self.fingerprint,
            self.payload_length,
            0,
            0,
        )[:-16]

    def encode(self, payload: bytes | bytearray | memoryview, key: str | None = None) -> bytes:
        """Header + payload, bound to ``key`` (the key it will be stored under).

        The payload must have exactly this format's length. An entry encoded without a key is
        never served by :meth:`decode` with a key: only tools that inspect values leave it out.
        """
        view = memoryview(payload).cast("B")
        if len(view) != self.payload_length:
            raise ConfigError(f"payload is {len(view)} bytes, the format says {self.payload_length}")
        bound = _UNBOUND if key is None else key_digest(key)
        checksum = xxhash.xxh3_64_intdigest(view)
        # one copy of the payload (a join of views), not two (tobytes, then a concatenation)
        return b"".join((self._prefix, bound.to_bytes(8, "little"), checksum.to_bytes(8, "little"), view))

    @property
    def entry_length(self) -> int:
        """Bytes of a whole entry of this format: the header and the payload."""
        return HEADER.size + self.payload_length

    def encode_into(self, entry: bytearray | memoryview, key: str | None = None) -> None:
        """Write the header of ``entry`` in place, its payload already at ``entry[HEADER.size:]``.

        ``entry`` then holds exactly what :meth:`encode` of that payload returns, built without a copy:
        a caller fills the payload straight from its source (the KV tensors) into a reused buffer.
        """
        view = memoryview(entry).cast("B")
        if len(view) != self.entry_length:
            raise ConfigError(f"an entry buffer is {len(view)} bytes, the format says {self.entry_length}")
        bound = _UNBOUND if key is None else key_digest(key)
        checksum = xxhash.xxh3_64_intdigest(view[HEADER.size :])
        prefix = self._prefix
        view[: len(prefix)] = prefix
        view[len(prefix) : HEADER.size] = bound.to_bytes(8, "little") + checksum.to_bytes(8, "little")

    def check_read(
        self,
        header: bytes | bytearray | memoryview,
        length: int | None,
        payload: Sequence[object],
        key: str | None,
        streamed: StreamedChecksum | None = None,
    ) -> str:
        """Why an entry read in parts is not a sound entry of this format under ``key`` ("" when it is):
        the checks of :meth:`decode` (which reads its entry as one part), in the same order.

        For a read straight into place (``FileStorage.get_into``): ``length`` is the stored entry's size
        (None: absent), ``header`` its first ``min(length, HEADER.size)`` bytes, ``payload`` the buffers its
        payload went into, in order (looked at only when the length is right). The checksum is streamed
        over the buffers (xxh3's ``update`` per part equals the one-shot digest), or is ``streamed``'s,
        taken while the read landed -- then the payload must have been fed to it whole.
        """
        if length is None:
            return "absent"
        head = bytes(header[: min(length, HEADER.size)])
        if len(head) >= 10 and head[:8] == MAGIC and int.from_bytes(head[8:10], "little") != FORMAT_VERSION:
            return "other format version"  # checked first: the length checks below assume this version's header
        if length < HEADER.size:
            return "truncated header"
        prefix = self._prefix
        if head[: len(prefix)] != prefix:
            return "bad magic" if head[:8] != MAGIC else "other scheme, dtype, shape or spec"
        if length != self.entry_length:
            return "truncated payload" if length < self.entry_length else "overlong payload"
        if streamed is None:
            digest = xxhash.xxh3_64()
            for part in payload:
                digest.update(part)  # type: ignore[arg-type]
            checksum = digest.intdigest()
        elif streamed.payload_bytes != self.payload_length:
            return "truncated payload"  # the file ended early (changed since its length was read)
        else:
            checksum = streamed.intdigest()
        if checksum != int.from_bytes(head[HEADER.size - 8 :], "little"):
            return "checksum mismatch"
        if key is not None and int.from_bytes(head[len(prefix) : HEADER.size - 8], "little") != key_digest(key):
            return "written under another key"
        return ""

    def decode(
        self, data: bytes | bytearray | memoryview | None, key: str | None = None
    ) -> tuple[memoryview | None, str]:
        """``(payload, "")`` for a sound entry of this format written under ``key``, else ``(None, why)``.

        Never raises for ``data``: the value comes from a shared store anyone may have written. The
        header is compared whole with the one this format writes, never parsed, so no field of a
        damaged header (a shape, a dtype, a length) is ever used. A value that is not a byte
        string, or not contiguous, is the miss ``"not a byte string"``; a sound entry whose header
        names another key is ``"written under another key"``. ``key=None`` (inspection only)
        accepts an entry written under any key.
        """
        if data is None:
            return None, "absent"
        view = _byte_view(data)
        if view is None:
            return None, "not a byte string"
        payload = view[HEADER.size :]
        reason = self.check_read(view, len(view), (payload,), key)
        return (None, reason) if reason else (payload, "")
