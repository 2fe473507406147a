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
from kvblocks.hashing.core import BlockExtras, BlockHash, HashScheme, Namespace, blocks_overlapping

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


# --------------------------------------------------------------------------- token ints, vectorised


_Table = tuple[np.ndarray, np.ndarray, np.ndarray]


def _token_table(opcodes: list[int], widths: list[list[int]], columns: int) -> _Table:
    """Per size class: its opcode, a mask of the columns it keeps, and its encoded length."""
    ops = np.array(opcodes, dtype=np.uint8)
    masks = np.zeros((len(widths), columns), dtype=bool)
    for cls, cols in enumerate(widths):
        masks[cls, cols] = True
    return ops, masks, masks.sum(axis=1).astype(np.int64)


# pickle (protocol >= 2) writes an int v with 0 <= v < 2**32 as
#   v < 256: K b0 | v < 2**16: M b0 b1 | v < 2**31: J b0..b3 (signed i32) | else LONG1: 8a 05 b0..b3 00
# Columns: [opcode, 05, b0, b1, b2, b3, 00]; each class keeps its own.
_PICKLE_INTS = _token_table([0x4B, 0x4D, 0x4A, 0x8A], [[0, 2], [0, 2, 3], [0, 2, 3, 4, 5], list(range(7))], 7)
# canonical CBOR writes an unsigned int big-endian in its shortest form:
#   v < 24: v | v < 256: 18 b | v < 2**16: 19 b b | else 1a b b b b. Columns: [opcode, B3, B2, B1, B0].
_CBOR_INTS = _token_table([0x00, 0x18, 0x19, 0x1A], [[4], [0, 4], [0, 3, 4], list(range(5))], 5)


def _pickle_ints(values: np.ndarray) -> tuple[bytes, np.ndarray]:
    """``values``' pickle opcodes concatenated, and each one's length."""
    ops, masks, lengths = _PICKLE_INTS
    cls = (values >= 256).astype(np.int8) + (values >= 1 << 16) + (values >= 1 << 31)
    table = np.zeros((values.size, 7), dtype=np.uint8)
    table[:, 0] = ops[cls]
    table[:, 1] = 5
    table[:, 2:6] = values.astype("<u4").view(np.uint8).reshape(-1, 4)
    return table[masks[cls]].tobytes(), lengths[cls]


def _cbor_ints(values: np.ndarray) -> tuple[bytes, np.ndarray]:
    """``values``' canonical CBOR items concatenated, and each one's length."""
    ops, masks, lengths = _CBOR_INTS
    cls = (values >= 24).astype(np.int8) + (values >= 256) + (values >= 1 << 16)
    table = np.empty((values.size, 5), dtype=np.uint8)
    table[:, 0] = ops[cls]
    table[:, 1:] = values.astype(">u4").view(np.uint8).reshape(-1, 4)
    return table[masks[cls]].tobytes(), lengths[cls]


def _split(blocks: list[bytes], encode: Callable[[np.ndarray], tuple[bytes, np.ndarray]]) -> tuple[bytes, list[int]]:
    """Encode every token of ``blocks`` (u32 LE each) at once; block ``i`` is ``out[ends[i]:ends[i + 1]]``."""
    values = np.frombuffer(b"".join(blocks), dtype="<u4")
    data, lengths = encode(values)
    ends = np.zeros(len(blocks) + 1, dtype=np.int64)
    np.cumsum(lengths.reshape(len(blocks), -1).sum(axis=1), out=ends[1:])
    return data, ends.tolist()


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

    def _chain_cbor(
        self, blocks: list[bytes], parent: bytes, framer: _VllmFramer | None, first_index: int
    ) -> list[BlockHash]:
        data, ends = _split(blocks, _cbor_ints)
        head = _cbor_head(4, 3) + _cbor_head(2, self.width)
        array = _cbor_head(4, len(blocks[0]) // 4)
        digest = self._digest
        out: list[BlockHash] = []
        d = parent
        for i in range(len(blocks)):
            keys = b"\xf6" if framer is None else framer(first_index + i)
            d = digest(head + d + array + data[ends[i] : ends[i + 1]] + keys)
            out.append(d)
        return out

    def _chain_pickle(
        self, blocks: list[bytes], parent: bytes, framer: _VllmFramer | None, first_index: int
    ) -> list[BlockHash]:
        data, ends = _split(blocks, _pickle_ints)
        size = len(blocks[0]) // 4
        # SHORT_BINBYTES parent MEMOIZE | MARK ints TUPLE (TUPLE1..3 below 4) MEMOIZE | keys | TUPLE3 MEMOIZE STOP
        opening, closing = (b"\x94(", b"t\x94") if size > 3 else (b"\x94", bytes((0x84 + size, 0x94)))
        parent_op = bytes((0x43, self.width))
        fixed = len(parent_op) + self.width + len(opening) + len(closing) + 3
        digest = self._digest
        out: list[BlockHash] = []
        d = parent
        for i in range(len(blocks)):
            keys = b"N" if framer is None else framer.segment(first_index + i)
            body = _MAX_FRAME + 1 if keys is None else len(keys) + ends[i + 1] - ends[i] + fixed
            if keys is not None and body <= _MAX_FRAME:
                tail = opening + data[ends[i] : ends[i + 1]] + closing + keys + b"\x87\x94."
                d = digest(b"\x80\x05\x95" + body.to_bytes(8, "little") + parent_op + d + tail)
            else:  # several pickle frames: let pickle frame it
                block_keys = None if framer is None else framer.keys(first_index + i)
                tokens = tuple(np.frombuffer(blocks[i], dtype="<u4").tolist())
                d = self.hash_value((d, tokens, block_keys))
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
