"""vLLM's prefix-cache block hashes, bit for bit (vLLM 0.33, ``vllm/v1/core/kv_cache_utils.py``).

vLLM names block ``i`` of a request ``H(serialize((parent, tuple(block_i_tokens), extra_keys_i)))``, where the
parent of block 0 is ``NONE_HASH = H(serialize(seed))``. Four schemes, one per ``--prefix-caching-hash-algo``:

=====================  =====================  ==========================================  ============
kvblocks scheme        vLLM name              serialize, H                                hash
=====================  =====================  ==========================================  ============
``vllm-sha256``        ``sha256`` (default)   ``pickle.dumps(x, protocol=5)``, SHA-256    32 bytes
``vllm-sha256-cbor``   ``sha256_cbor``        canonical CBOR, SHA-256                     32 bytes
``vllm-xxhash``        ``xxhash``             ``pickle.dumps(x, protocol=5)``, XXH3-128   16 bytes
``vllm-xxhash-cbor``   ``xxhash_cbor``        canonical CBOR, XXH3-128                    16 bytes
=====================  =====================  ==========================================  ============

A kvblocks router can then index an engine fleet from token ids alone, as llm-d does; the 64-bit form in
vLLM's KV events is :func:`~kvblocks.hashing.vllm_int_hash` of these hashes.

**The seed.** vLLM's seed is ``PYTHONHASHSEED`` when the engine has it set, else ``"vllm-none-hash"`` for the
SHA-256 schemes and *random per process* for the xxhash ones. Here the seed is the :class:`Namespace`'s salt
(a ``str``, equal to the engine's ``PYTHONHASHSEED``), else ``"vllm-none-hash"``. So: an xxhash engine is
reproducible only with ``PYTHONHASHSEED`` set, and its namespace salt must be that value. ``Namespace.model``
and the block size do not enter vLLM's hashes (two models hash alike); storage keys still separate them, as
they carry :meth:`Namespace.tag`.

**Extra keys.** :class:`BlockExtras` become vLLM's per-block tuple, in vLLM's order, or ``None`` when empty:
``("lora", lora, lora_path)`` on every block, ``("mm", digest, offset - block_start)`` for each multimodal
item the block overlaps, ``("cache_salt", cache_salt)`` on block 0. vLLM's values are ``str``, so a
``bytes`` digest, salt or namespace salt raises :class:`ConfigError` (no guess at a decoding), as do ``lora``
without ``lora_path`` (vLLM requires a path) and overlapping multimodal items (vLLM assumes none and then
skips some). Not reproduced: ``prompt_embeds`` requests and speculative decoding's hash lookahead.

**Pickle is identity-sensitive.** Pickle writes a repeated *object* as a back-reference, so vLLM's bytes
depend on which strings are one object. Keys are built as vLLM's engine core holds them: the tags
``"lora"``/``"mm"``/``"cache_salt"`` are shared constants, each value a freshly decoded string.

>>> from kvblocks.hashing import block_hashes, vllm_int_hash
>>> h = block_hashes(range(32), 16, scheme="vllm-sha256")
>>> [len(x) for x in h]
[32, 32]
>>> import hashlib, pickle
>>> none_hash = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
>>> h[0] == hashlib.sha256(pickle.dumps((none_hash, tuple(range(16)), None), protocol=5)).digest()
True

The encoders below write what ``pickle.dumps``/``cbor2.dumps(canonical=True)`` write for exactly these shapes,
the token ints of a whole prompt in one vectorised pass; blocks too large for one pickle frame fall back to
``pickle.dumps`` itself. The committed vectors (``tests/data/vllm_hash_vectors.json``) were made by vLLM's code.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from functools import lru_cache

import numpy as np
import xxhash

from kvblocks.errors import ConfigError, InvalidBlockHashError
from kvblocks.hashing.extras import BlockExtras, blocks_overlapping
from kvblocks.hashing.schemes import HashScheme, Namespace
from kvblocks.hashing.tokens import BlockHash

__all__ = ["DEFAULT_SEED", "VLLM_SCHEMES", "VllmScheme", "vllm_extra_keys"]

DEFAULT_SEED = "vllm-none-hash"
"""vLLM's ``DEFAULT_NONE_HASH_SEED``: the root seed of its SHA-256 schemes without ``PYTHONHASHSEED``."""

_LORA, _MM, _SALT = "lora", "mm", "cache_salt"  # shared constants, as vLLM's literals are
_PICKLE_PROTOCOL = 5  # pickle.HIGHEST_PROTOCOL on every Python vLLM 0.33 runs on
_MAX_FRAME = 0xFFFF  # a pickle body up to this size is one frame (the pickler splits at 64 KiB boundaries)
_I64 = 1 << 63

ExtraKeys = tuple[tuple[str | int, ...], ...] | None
"""One block's extra keys, as vLLM's ``generate_block_hash_extra_keys`` returns them."""


def _fresh(text: str) -> str:
    """A distinct copy of ``text`` (where CPython makes one), as decoding a request gives the engine."""
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "surrogatepass")


def _need_str(value: object, what: str) -> str:
    if type(value) is not str:
        raise ConfigError(f"vLLM hash schemes take {what} as str (vLLM's type), got {type(value).__name__}")
    return value


# --------------------------------------------------------------------------- extra keys


class _Plan:
    """What vLLM keys a request's blocks with, checked once; :meth:`keys` builds one block's tuple."""

    __slots__ = ("block_size", "lora", "mm", "salt")

    def __init__(self, extras: BlockExtras, block_size: int) -> None:
        self.block_size = block_size
        self.lora: tuple[str, str] | None = None
        if extras.lora is not None:
            if extras.lora_path is None:
                raise ConfigError("vLLM 0.33 keys LoRA blocks by name and path: give BlockExtras(lora_path=...)")
            self.lora = (extras.lora, extras.lora_path)
        self.salt = None if extras.cache_salt is None else _need_str(extras.cache_salt, "cache_salt")
        self.mm: dict[int, list[tuple[str, int]]] = {}
        end = 0
        for item in extras.mm_items:  # sorted by offset
            digest = _need_str(item.digest, "a multimodal item's digest (vLLM's identifier)")
            if item.offset < end:
                raise ConfigError(f"multimodal items overlap at token {item.offset}: vLLM assumes they do not")
            if item.offset + item.length >= _I64:
                raise ConfigError(f"multimodal item offset {item.offset} is out of range")
            end = item.offset + item.length
            for index in blocks_overlapping(item.offset, item.length, block_size):
                self.mm.setdefault(index, []).append((digest, item.offset - index * block_size))

    def keys(self, index: int) -> ExtraKeys:
        """Block ``index``'s extra keys: lora, then multimodal items, then the salt on block 0."""
        keys: list[tuple[str | int, ...]] = []
        if self.lora is not None:
            keys.append((_LORA, _fresh(self.lora[0]), _fresh(self.lora[1])))
        keys.extend((_MM, _fresh(digest), relative) for digest, relative in self.mm.get(index, ()))
        if index == 0 and self.salt:
            keys.append((_SALT, _fresh(self.salt)))
        return tuple(keys) if keys else None


def vllm_extra_keys(extras: BlockExtras | None, block_size: int, num_blocks: int) -> list[ExtraKeys]:
    """The extra keys vLLM hashes into each of the first ``num_blocks`` blocks of a request with ``extras``.

    >>> from kvblocks.hashing import MultimodalItem
    >>> extras = BlockExtras(lora="sql", lora_path="/a/sql", cache_salt="t1", mm_items=(MultimodalItem("img", 6, 4),))
    >>> for keys in vllm_extra_keys(extras, 4, 3):
    ...     print(keys)
    (('lora', 'sql', '/a/sql'), ('cache_salt', 't1'))
    (('lora', 'sql', '/a/sql'), ('mm', 'img', 2))
    (('lora', 'sql', '/a/sql'), ('mm', 'img', -2))
    """
    if extras is None:
        return [None] * num_blocks
    plan = _Plan(extras, block_size)
    return [plan.keys(index) for index in range(num_blocks)]


class _VllmFramer:
    """A scheme's per-block extras: ``__call__`` gives a block's keys serialized, :meth:`keys` the tuple."""

    __slots__ = ("_cache", "_encode", "_plan")

    def __init__(self, plan: _Plan, encode: Callable[[ExtraKeys], bytes | None]) -> None:
        self._plan = plan
        self._encode = encode
        self._cache: dict[int, bytes | None] = {}

    def keys(self, index: int) -> ExtraKeys:
        return self._plan.keys(index)

    def segment(self, index: int) -> bytes | None:
        """Block ``index``'s serialized keys, or None where only a whole ``pickle.dumps`` can write them."""
        plan = self._plan
        if index != 0 and index not in plan.mm:
            index = -1  # every such block has the same keys (lora only, or none)
        try:
            return self._cache[index]
        except KeyError:
            out = self._cache[index] = self._encode(plan.keys(index))
            return out

    def __call__(self, index: int) -> bytes:
        return self.segment(index) or b""


# --------------------------------------------------------------------------- blocks, vectorised
#
# Each block's serialized bytes, less the parent digest and the extra keys, are written for all blocks
# at once: every piece (a header, a token int, a closing) is a little-endian uint64 "slot" of which the
# low ``len`` bytes count; one boolean selection concatenates them all. Row i of the slot matrix is
# block i: its head (before the parent) and its tail (after it).

_LOW_BYTES = np.array([(1 << (8 * n)) - 1 for n in range(9)], dtype="<u8")  # n low bytes kept
_U64 = np.uint64

# pickle (protocol >= 2) writes an int 0 <= v < 2**32 as v < 256: K b0 | v < 2**16: M b0 b1 |
# v < 2**31: J b0..b3 (an i32) | else LONG1 05 b0..b3 00: slot = opcode word | v << shift.
_PICKLE_OP = np.array([0x4B, 0x4D, 0x4A, 0x8A | 0x05 << 8], dtype=_U64)
_PICKLE_SHIFT = np.array([8, 8, 8, 16], dtype=_U64)
_PICKLE_LEN = np.array([2, 3, 5, 7], dtype=np.intp)
# canonical CBOR writes an unsigned int in its shortest big-endian form: v < 24: v | v < 256: 18 b |
# v < 2**16: 19 b1 b0 | else 1a b3 b2 b1 b0: slot = opcode | (byteswapped v >> drop) << 8 (v alone below 24).
_CBOR_OP = np.array([0x00, 0x18, 0x19, 0x1A], dtype=_U64)
_CBOR_DROP = np.array([24, 24, 16, 0], dtype=_U64)
_CBOR_LIFT = np.array([0, 8, 8, 8], dtype=_U64)
_CBOR_LEN = np.array([1, 2, 3, 5], dtype=np.intp)


def _word(data: bytes) -> tuple[int, int]:
    """A slot holding ``data`` (at most 8 bytes), and its length."""
    return int.from_bytes(data, "little"), len(data)


def _slots(blocks: list[bytes], before: int, after: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The blocks' token ids as a (blocks, size) array, and empty slot words and lengths with ``before``
    columns ahead of the tokens and ``after`` behind them."""
    values = np.frombuffer(b"".join(blocks), dtype="<u4").reshape(len(blocks), -1)
    shape = (values.shape[0], before + values.shape[1] + after)
    return values, np.empty(shape, dtype=_U64), np.empty(shape, dtype=np.intp)


def _size_class(values: np.ndarray, *bounds: int) -> np.ndarray:
    """How many of ``bounds`` each value reaches (0..3)."""
    a, b, c = (np.greater_equal(values, bound).view(np.uint8) for bound in bounds)
    out: np.ndarray = a + b + c
    return out


def _pickle_tokens(values: np.ndarray, words: np.ndarray, lens: np.ndarray, before: int) -> None:
    cls = _size_class(values, 256, 1 << 16, 1 << 31)
    stop = before + values.shape[1]
    words[:, before:stop] = (values.astype(_U64) << np.take(_PICKLE_SHIFT, cls)) | np.take(_PICKLE_OP, cls)
    lens[:, before:stop] = np.take(_PICKLE_LEN, cls)


def _cbor_tokens(values: np.ndarray, words: np.ndarray, lens: np.ndarray, before: int) -> None:
    cls = _size_class(values, 24, 256, 1 << 16)
    swapped = values.astype(">u4").view("<u4").astype(_U64)
    stop = before + values.shape[1]
    words[:, before:stop] = ((swapped >> np.take(_CBOR_DROP, cls)) << np.take(_CBOR_LIFT, cls)) | np.take(_CBOR_OP, cls)
    lens[:, before:stop] = np.take(_CBOR_LEN, cls)


def _pack(words: np.ndarray, lens: np.ndarray, heads: int) -> tuple[bytes, list[int], list[int], list[int]]:
    """The slots' bytes in row order, and per row where it starts, where its ``heads`` slots end, and its end."""
    keep = np.take(_LOW_BYTES, lens).view(np.uint8).view(np.bool_).ravel()
    data = np.compress(keep, words.astype("<u8", copy=False).view(np.uint8).ravel()).tobytes()
    ends = np.cumsum(lens, axis=None).reshape(lens.shape)
    row_ends = ends[:, -1]
    starts = np.concatenate(([0], row_ends[:-1]))
    return data, starts.tolist(), ends[:, heads - 1].tolist(), row_ends.tolist()


# --------------------------------------------------------------------------- canonical CBOR of the keys


def _cbor_head(major: int, value: int) -> bytes:
    """A CBOR item head in its shortest form (canonical)."""
    if value < 24:
        return bytes((major << 5 | value,))
    for extra, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * width):
            return bytes((major << 5 | extra,)) + value.to_bytes(width, "big")
    raise ConfigError(f"{value} does not fit a CBOR head")


def _cbor(value: object) -> bytes:
    """Canonical CBOR of ``None``, ints of 64 bits, str, bytes and (nested) tuples: what vLLM hashes."""
    if value is None:
        return b"\xf6"
    if type(value) is int:
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if type(value) is str:
        try:
            data = value.encode("utf-8")
        except UnicodeEncodeError:  # pragma: no cover - BlockExtras and Namespace refuse such text first
            raise ConfigError(f"{value!r:.60} is not valid UTF-8 text: CBOR cannot carry it") from None
        return _cbor_head(3, len(data)) + data
    if type(value) is bytes:
        return _cbor_head(2, len(value)) + value
    if type(value) is tuple:
        return _cbor_head(4, len(value)) + b"".join(map(_cbor, value))
    raise ConfigError(f"cannot CBOR-encode {type(value).__name__}")  # pragma: no cover - keys are built above


# --------------------------------------------------------------------------- schemes


class VllmScheme(HashScheme):
    """One of vLLM's block hash functions (see the module docstring); hashes are ``bytes``."""

    hash_type = bytes

    def __init__(self, name: str, vllm_name: str, digest: Callable[[bytes], bytes], width: int, cbor: bool):
        self.name = name
        self.vllm_name = vllm_name
        self.width = width
        self._digest = digest
        self._cbor = cbor

    def __repr__(self) -> str:
        return f"VllmScheme({self.name!r})"

    def serialize(self, value: object) -> bytes:
        """What vLLM hashes for ``value``: its pickle or canonical CBOR (of a seed str, or of the triple)."""
        if self._cbor:
            return _cbor(value)
        return pickle.dumps(value, protocol=_PICKLE_PROTOCOL)

    def hash_value(self, value: object) -> bytes:
        """vLLM's ``hash_fn(value)``: the hash of :meth:`serialize`."""
        return self._digest(self.serialize(value))

    def root(self, namespace: Namespace, block_size: int) -> bytes:
        seed = DEFAULT_SEED if namespace.salt is None else _need_str(namespace.salt, "the namespace salt (the seed)")
        return self.hash_value(seed)

    def make_framer(self, extras: BlockExtras, block_size: int) -> _VllmFramer | None:
        return _framer(self, extras, block_size)

    def _encode_keys(self, keys: ExtraKeys) -> bytes | None:
        if self._cbor:
            return _cbor(keys)
        if keys is None:
            return b"N"
        # The keys' opcodes inside the pickle of a triple: the memo already holds the parent and the tokens
        # tuple (2 entries) whatever they are, so a one-byte parent and token tuple (0,) give the same bytes.
        dumped = pickle.dumps((b"\x00", (0,), keys), protocol=_PICKLE_PROTOCOL)
        if len(dumped) > _MAX_FRAME // 2:  # leave room for the block's tokens; else pickle.dumps does it all
            return None
        return dumped[11 + 4 + 4 : -3]  # header, C 01 00 94, K 00 85 94 | keys | 87 94 2e

    def chain(
        self, blocks: list[bytes], parent: BlockHash | None, framer: Callable[[int], bytes] | None, first_index: int
    ) -> list[BlockHash]:
        if type(parent) is not bytes or len(parent) != self.width:
            raise InvalidBlockHashError(f"{self.name} chains onto a {self.width}-byte digest, got {parent!r:.60}")
        if framer is not None and not isinstance(framer, _VllmFramer):
            raise ConfigError(f"{self.name} needs its own per-block extras: build them with make_framer")
        if not blocks:
            return []
        if self._cbor:
            return self._chain_cbor(blocks, parent, framer, first_index)
        return self._chain_pickle(blocks, parent, framer, first_index)

    def _segments(self, framer: _VllmFramer | None, first_index: int, count: int) -> list[bytes | None] | None:
        return None if framer is None else [framer.segment(i) for i in range(first_index, first_index + count)]

    def _chain_cbor(
        self, blocks: list[bytes], parent: bytes, framer: _VllmFramer | None, first_index: int
    ) -> list[BlockHash]:
        # array(3) bytes(W) | parent | array(size) ints | keys (null inline when there are none)
        values, words, lens = _slots(blocks, 2, 1)
        words[:, 0], lens[:, 0] = _word(_cbor_head(4, 3) + _cbor_head(2, self.width))
        words[:, 1], lens[:, 1] = _word(_cbor_head(4, values.shape[1]))
        _cbor_tokens(values, words, lens, 2)
        segments = self._segments(framer, first_index, len(blocks))
        words[:, -1], lens[:, -1] = (0, 0) if segments else (0xF6, 1)
        data, starts, mids, ends = _pack(words, lens, 1)
        digest = self._digest
        out: list[BlockHash] = []
        d = parent
        for i in range(len(blocks)):
            if segments is None:
                d = digest(data[starts[i] : mids[i]] + d + data[mids[i] : ends[i]])
            else:
                d = digest(data[starts[i] : mids[i]] + d + data[mids[i] : ends[i]] + (segments[i] or b""))
            out.append(d)
        return out

    def _chain_pickle(
        self, blocks: list[bytes], parent: bytes, framer: _VllmFramer | None, first_index: int
    ) -> list[BlockHash]:
        # PROTO 5, FRAME len | SHORT_BINBYTES W | parent | MEMOIZE, MARK ints TUPLE (TUPLE1..3 below 4 ints),
        # MEMOIZE | keys (N inline when there are none) | TUPLE3 MEMOIZE STOP
        values, words, lens = _slots(blocks, 3, 1)
        size = values.shape[1]
        words[:, 1], lens[:, 1] = _word(bytes((0, 0, 0, 0x43, self.width)))  # frame length bytes 5..7, then C W
        words[:, 2], lens[:, 2] = _word(b"\x94(" if size > 3 else b"\x94")
        _pickle_tokens(values, words, lens, 3)
        closing = b"t\x94" if size > 3 else bytes((0x84 + size, 0x94))
        segments = self._segments(framer, first_index, len(blocks))
        words[:, -1], lens[:, -1] = _word(closing if segments else closing + b"N\x87\x94.")
        # the frame's length: all but its 11-byte header (slot 0 and 3 bytes of slot 1), with the parent
        body = lens[:, 1:].sum(axis=1) + (self.width - 3)
        if segments is not None:
            body += [len(k) + 3 if k is not None else _MAX_FRAME for k in segments]
        words[:, 0], lens[:, 0] = (0x80 | 0x05 << 8 | 0x95 << 16) | (np.minimum(body, _MAX_FRAME) << 24), 8
        data, starts, mids, ends = _pack(words, lens, 2)
        fits = (body <= _MAX_FRAME).tolist()
        digest = self._digest
        out: list[BlockHash] = []
        d = parent
        for i in range(len(blocks)):
            if not fits[i]:  # several pickle frames: let pickle frame it
                keys = None if framer is None else framer.keys(first_index + i)
                d = self.hash_value((d, tuple(values[i].tolist()), keys))
            elif segments is None:
                d = digest(data[starts[i] : mids[i]] + d + data[mids[i] : ends[i]])
            else:
                d = digest(data[starts[i] : mids[i]] + d + data[mids[i] : ends[i]] + segments[i] + b"\x87\x94.")  # type: ignore[operator]
            out.append(d)
        return out


@lru_cache(maxsize=256)
def _framer(scheme: VllmScheme, extras: BlockExtras, block_size: int) -> _VllmFramer | None:
    plan = _Plan(extras, block_size)
    if plan.lora is None and plan.salt is None and not plan.mm:
        return None
    framer = _VllmFramer(plan, scheme._encode_keys)
    for index in {0, -1, *plan.mm}:  # serialize now: a value CBOR cannot carry fails here, not mid-chain
        framer.segment(index)
    return framer


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


VLLM_SCHEMES: dict[str, VllmScheme] = {
    scheme.name: scheme
    for scheme in (
        VllmScheme("vllm-sha256", "sha256", _sha256, 32, cbor=False),
        VllmScheme("vllm-sha256-cbor", "sha256_cbor", _sha256, 32, cbor=True),
        VllmScheme("vllm-xxhash", "xxhash", xxhash.xxh3_128_digest, 16, cbor=False),
        VllmScheme("vllm-xxhash-cbor", "xxhash_cbor", xxhash.xxh3_128_digest, 16, cbor=True),
    )
}
"""vLLM's four block hash functions, by kvblocks scheme name (registered in ``HASH_SCHEMES``)."""
