"""Block identity: chained hashes over the *full* blocks of a token sequence.

With block size 4::

    tokens   | 7 1 4 4 | 9 9 0 2 | 5 3 |
    blocks   | block 0 | block 1 | partial: never hashed, never cached
    hashes     h0 = H(root, block 0, extras 0)
                         h1 = H(h0, block 1, extras 1)

One hash names a whole prefix, so the same value serves as prefix-tree key,
storage key, event payload and router index key.

Schemes (chosen by name):

``xxh3-128`` (default)
    ``H = xxh3_128(parent_digest || tokens as u32 LE || extra frames)``; hashes are
    16-byte ``bytes``.
``sha256``
    The same framing with SHA-256 (32-byte ``bytes``), for deployments where
    collisions must be infeasible even for an adversary choosing prompts.
``xxh3-64-1337``
    The XXH3-64 standard of NVIDIA Dynamo's KV router and Mooncake's indexer:
    ``local_i = xxh3_64(tokens as u32 LE, seed=1337)``, ``seq_0 = local_0``,
    ``seq_i = xxh3_64(seq_{i-1} as u64 LE || local_i as u64 LE, seed=1337)``;
    hashes are Python ``int``.
``vllm-sha256``, ``vllm-sha256-cbor``, ``vllm-xxhash``, ``vllm-xxhash-cbor``
    vLLM's own block hashes, bit for bit (:mod:`kvblocks.hashing.vllm`): its root and extra keys follow
    vLLM's rules, not the namespace framing and typed frames below.

The chain root comes from a :class:`Namespace` (scheme, block size, model id,
optional salt) through a framed encoding, never from ``hash()`` or
``PYTHONHASHSEED``: two processes with one namespace agree on every hash. (For
``xxh3-64-1337`` the default namespace has no root, so the output is the
standard's; any other namespace chains block 0 onto a namespace root.)

Extra keys (:class:`BlockExtras`) are *typed frames* -- ``tag (1 byte) || length
(u32 LE) || payload`` -- appended after the fixed-size token bytes. Because the
parent digest and the token bytes have a fixed length within one chain, the
frames can neither be confused with each other (a LoRA ``x`` is not a salt ``x``)
nor with parent digests (block 0 with extra digest ``d`` is not a later block
whose parent is ``d``).
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import repeat
from typing import cast

import numpy as np
import xxhash

from kvblocks.errors import (
    ConfigError,
    InvalidArgumentError,
    InvalidBlockHashError,
    InvalidTokenError,
    SequenceStateError,
)
from kvblocks.strict_json import brief

__all__ = [
    "DEFAULT_SCHEME",
    "HASH_SCHEMES",
    "BlockExtras",
    "BlockHash",
    "BlockHasher",
    "HashScheme",
    "HashedTokens",
    "MultimodalItem",
    "Namespace",
    "PrecomputedHashes",
    "block_hashes",
    "blocks_overlapping",
    "get_scheme",
    "hash_from_json",
    "hash_to_json",
    "hashes_from_json",
    "hashes_to_json",
    "pack_tokens",
    "validate_block_hashes",
    "vllm_int_hash",
]

BlockHash = bytes | int
"""A block's chained hash: ``bytes`` for xxh3-128 and sha256, ``int`` for xxh3-64-1337
(and for precomputed ids such as trace hash ids)."""

DEFAULT_SCHEME = "xxh3-128"
TOKEN_LIMIT = 1 << 32  # tokens are packed as u32

_BIG_ENDIAN = sys.byteorder == "big"
if array("I").itemsize != 4:  # pragma: no cover - every supported platform has 4-byte unsigned int
    raise ImportError("kvblocks needs array('I') to be 4 bytes wide")

# Frame tags. Never reuse a tag for another meaning: stored hashes depend on them.
_TAG_ROOT_SCHEME = 0x01
_TAG_ROOT_BLOCK_SIZE = 0x02
_TAG_ROOT_MODEL = 0x03
_TAG_ROOT_SALT = 0x04
_TAG_LORA = 0x10
_TAG_CACHE_SALT = 0x11
_TAG_MM_ITEM = 0x12
_TAG_LORA_PATH = 0x13  # framed only when set: hashes without a LoRA path are those of before the tag existed
_ROOT_MAGIC = b"kvblocks/root/v1"

_Framer = Callable[[int], bytes]


def _frame(tag: int, payload: bytes) -> bytes:
    return bytes((tag,)) + len(payload).to_bytes(4, "little") + payload


def _as_bytes(value: str | bytes, what: str) -> bytes:
    if isinstance(value, str):
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: no UTF-8 for it
            raise ConfigError(f"{what} is not valid UTF-8 text: {value!r:.60}") from None
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    raise ConfigError(f"{what} must be str or bytes, got {type(value).__name__}")


def _check_index(value: object, what: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{what} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise ConfigError(f"{what} must be >= {minimum}, got {value}")
    return int(value)


# --------------------------------------------------------------------------- tokens


def pack_tokens(token_ids: Iterable[int]) -> array[int]:
    """Copy ``token_ids`` into a fresh ``array('I')``, refusing anything that is not a u32.

    Accepts lists/tuples of ``int`` or numpy integers, numpy integer arrays and
    ``array`` objects; numpy integers pack exactly like Python ints. Raises
    :class:`InvalidTokenError` naming the first bad position.
    """
    if isinstance(token_ids, np.ndarray):
        return _pack_ndarray(token_ids)
    if isinstance(token_ids, (str, bytes, bytearray, memoryview)):
        raise InvalidTokenError(f"token ids must be a sequence of integers, got {type(token_ids).__name__}")
    if not isinstance(token_ids, (list, tuple, array, range)):
        try:  # an iterator can be read once: keep what it yields, to report a bad position
            token_ids = list(token_ids)
        except TypeError:
            raise InvalidTokenError(
                f"token ids must be a sequence of integers, got {type(token_ids).__name__}"
            ) from None
    try:
        return array("I", token_ids)
    except (OverflowError, TypeError):
        raise _bad_token(token_ids) from None


def _pack_ndarray(arr: np.ndarray) -> array[int]:
    if arr.ndim != 1:
        raise InvalidTokenError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise InvalidTokenError(f"token ids must have an integer dtype, got {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= TOKEN_LIMIT):
        raise _bad_token(arr.tolist())
    out = array("I")
    out.frombytes(arr.astype("=u4", copy=False).tobytes())
    return out


def _bad_token(tokens: Sequence[object]) -> InvalidTokenError:
    for index, tok in enumerate(tokens):
        if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
            return InvalidTokenError(f"token id at position {index} is not an integer: {tok!r}")
        if not 0 <= tok < TOKEN_LIMIT:
            return InvalidTokenError(f"token id at position {index} is out of range [0, 2**32): {tok}")
    return InvalidTokenError("token ids could not be packed as u32")  # pragma: no cover


def validate_block_hashes(hashes: Iterable[BlockHash], *, distinct: bool = True) -> list[BlockHash]:
    """Return ``hashes`` as a new list, refusing anything but distinct ints >= 0 or non-empty bytes.

    The hashes of one sequence are one chain, so none may repeat: a repeat would make
    the chain a cycle in the prefix tree. ``distinct=False`` lets repeats pass, for a reader that builds
    no tree from them (the router scores a prompt; a repeat just ends its chain there).
    """
    out = list(hashes)
    if not _plainly_valid(out):
        _check_each(out)
    if distinct and len(set(out)) != len(out):
        first_seen: dict[BlockHash, int] = {}
        for index, h in enumerate(out):
            if first_seen.setdefault(h, index) != index:
                raise InvalidBlockHashError(f"block hash at position {index} repeats an earlier one: not a chain")
    return out


def _plainly_valid(hashes: list[BlockHash]) -> bool:
    """All plain ints in ``[0, 2**64)`` or all non-empty ``bytes``: checked in C passes (a 2,048-block prompt's
    per-item check costs more than routing it). False: :func:`_check_each` decides (and names the position)."""
    kinds = set(map(type, hashes))
    if kinds == {int}:
        try:  # refuses negatives (and, harmlessly, wide ints: the per-item path takes them)
            array("Q", cast(list[int], hashes))
        except OverflowError:
            return False
        return True
    return kinds == {bytes} and all(hashes)


def _check_each(out: list[BlockHash]) -> None:
    """Refuse the first hash that is not an int >= 0 or non-empty bytes; numpy integers become ints."""
    for index, h in enumerate(out):
        if isinstance(h, bytes):
            if not h:
                raise InvalidBlockHashError(f"block hash at position {index} is empty bytes")
        elif isinstance(h, (int, np.integer)) and not isinstance(h, bool):
            if h < 0:
                raise InvalidBlockHashError(f"block hash at position {index} is negative: {h}")
            out[index] = int(h)
        else:
            raise InvalidBlockHashError(f"block hash at position {index} must be int or bytes, got {type(h).__name__}")


# --------------------------------------------------------------------------- extras


def blocks_overlapping(offset: int, length: int, block_size: int) -> range:
    """Blocks that the half-open token range ``[offset, offset + length)`` touches.

    With block size 4::

        offset 2 length 2  -> tokens 2,3       -> block 0
        offset 3 length 2  -> tokens 3,4       -> blocks 0, 1
        offset 4 length 4  -> tokens 4..7      -> block 1   (ends where block 2 starts: not in it)
        offset 0 length 12 -> tokens 0..11     -> blocks 0, 1, 2
    """
    if length <= 0:
        return range(0)
    return range(offset // block_size, (offset + length - 1) // block_size + 1)


@dataclass(frozen=True)
class MultimodalItem:
    """A multimodal input (image, audio clip...) occupying tokens ``[offset, offset + length)``.

    ``digest`` identifies the item's content (for example a hash of the image
    bytes); every block the item overlaps includes it in its hash.
    """

    digest: bytes | str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not _as_bytes(self.digest, "multimodal item digest"):
            raise ConfigError("multimodal item digest must not be empty")
        _check_index(self.offset, "multimodal item offset", minimum=0)
        _check_index(self.length, "multimodal item length", minimum=1)

    def frame(self) -> bytes:
        payload = (
            int(self.offset).to_bytes(8, "little")
            + int(self.length).to_bytes(8, "little")
            + _as_bytes(self.digest, "multimodal item digest")
        )
        return _frame(_TAG_MM_ITEM, payload)


@dataclass(frozen=True)
class BlockExtras:
    """Per-request keys that change a block's identity beyond its tokens.

    * ``lora``: the adapter's identity; framed into every block.
    * ``lora_path``: where the adapter was loaded from (optional; needs ``lora``). vLLM 0.33 keys LoRA blocks
      by name *and* path, so its schemes require it with ``lora``; kvblocks' schemes frame it into every block
      only when set.
    * ``cache_salt``: a per-request salt (tenant isolation); framed into block 0,
      which the chain carries to every later block.
    * ``mm_items``: multimodal items; each is framed into exactly the blocks it
      overlaps (:func:`blocks_overlapping`).
    """

    lora: str | None = None
    cache_salt: str | bytes | None = None
    mm_items: tuple[MultimodalItem, ...] = field(default=())
    lora_path: str | None = None

    def __post_init__(self) -> None:
        if self.lora is not None and (not isinstance(self.lora, str) or not _as_bytes(self.lora, "lora")):
            raise ConfigError(f"lora must be a non-empty str, got {self.lora!r}")
        if self.lora_path is not None:
            if not isinstance(self.lora_path, str) or not _as_bytes(self.lora_path, "lora_path"):
                raise ConfigError(f"lora_path must be a non-empty str, got {self.lora_path!r}")
            if self.lora is None:
                raise ConfigError("lora_path is given without lora: a path names an adapter only with its name")
        if self.cache_salt is not None and not _as_bytes(self.cache_salt, "cache_salt"):
            raise ConfigError("cache_salt must not be empty")
        items = tuple(self.mm_items)
        for item in items:
            if not isinstance(item, MultimodalItem):
                raise ConfigError(f"mm_items must hold MultimodalItem, got {type(item).__name__}")
        canonical = tuple(sorted(items, key=lambda it: (it.offset, it.length, _as_bytes(it.digest, ""))))
        object.__setattr__(self, "mm_items", canonical)

    @property
    def is_empty(self) -> bool:
        return self.lora is None and self.cache_salt is None and not self.mm_items

    def framer(self, block_size: int) -> _Framer | None:
        """A function from block index to that block's extra frames, or None when there are none."""
        if self.is_empty:
            return None
        return _build_framer(self, block_size)


@lru_cache(maxsize=256)
def _build_framer(extras: BlockExtras, block_size: int) -> _Framer:
    lora = _frame(_TAG_LORA, extras.lora.encode("utf-8")) if extras.lora is not None else b""
    if extras.lora_path is not None:
        lora += _frame(_TAG_LORA_PATH, extras.lora_path.encode("utf-8"))
    salt = _frame(_TAG_CACHE_SALT, _as_bytes(extras.cache_salt, "cache_salt")) if extras.cache_salt else b""
    per_block: dict[int, bytes] = {}
    for item in extras.mm_items:
        frame = item.frame()
        for index in blocks_overlapping(item.offset, item.length, block_size):
            per_block[index] = per_block.get(index, b"") + frame
    first = lora + salt
    get = per_block.get

    def frames(index: int) -> bytes:
        return (first if index == 0 else lora) + get(index, b"")

    return frames


# --------------------------------------------------------------------------- namespace


@dataclass(frozen=True)
class Namespace:
    """What a chain root is derived from, besides the scheme and the block size.

    ``model`` names the weights (two models never share a hash); ``salt`` isolates
    deployments that share a storage tier. A plain string ``s`` given where a
    namespace is expected means ``Namespace(model=s)``.
    """

    model: str = "default"
    salt: str | bytes | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"namespace model must be a non-empty str, got {self.model!r}")
        if self.salt is not None and not _as_bytes(self.salt, "namespace salt"):
            raise ConfigError("namespace salt must not be empty")

    @property
    def is_default(self) -> bool:
        return self.model == "default" and self.salt is None

    @classmethod
    def of(cls, value: str | Namespace) -> Namespace:
        if isinstance(value, Namespace):
            return value
        if isinstance(value, str):
            return _namespace_of_model(value)
        raise ConfigError(f"namespace must be str or Namespace, got {type(value).__name__}")

    def root_material(self, scheme: str, block_size: int) -> bytes:
        parts = [
            _ROOT_MAGIC,
            _frame(_TAG_ROOT_SCHEME, scheme.encode("ascii")),
            _frame(_TAG_ROOT_BLOCK_SIZE, block_size.to_bytes(4, "little")),
            _frame(_TAG_ROOT_MODEL, self.model.encode("utf-8")),
        ]
        if self.salt is not None:
            parts.append(_frame(_TAG_ROOT_SALT, _as_bytes(self.salt, "namespace salt")))
        return b"".join(parts)

    def tag(self, scheme: str, block_size: int) -> str:
        """16 hex digits naming the key space (this namespace, scheme and block size) without revealing a salt.

        Storage keys and prefill/decode handoffs carry it, so hashes are never read in another key space.
        """
        return f"{xxhash.xxh3_64_intdigest(self.root_material(scheme, block_size)):016x}"


# --------------------------------------------------------------------------- schemes


class HashScheme:
    """A named way of chaining block hashes. Subclasses implement :meth:`root` and :meth:`chain`.

    The chain state is always the previous block's hash (or the root before block 0),
    so a sequence can be extended from its last hash alone.
    """

    name: str = ""
    hash_type: type = bytes

    def root(self, namespace: Namespace, block_size: int) -> BlockHash | None:
        raise NotImplementedError

    def make_framer(self, extras: BlockExtras, block_size: int) -> _Framer | None:
        """The per-block extra material :meth:`chain` appends for ``extras`` (None when there is none).

        kvblocks' schemes use typed frames (:meth:`BlockExtras.framer`); an engine's scheme builds what
        its engine hashes instead (vLLM: a tuple of extra keys per block), and may refuse extras it
        cannot express with :class:`ConfigError`.
        """
        return extras.framer(block_size)

    def chain(
        self, blocks: list[bytes], parent: BlockHash | None, framer: _Framer | None, first_index: int
    ) -> list[BlockHash]:
        """Hashes of ``blocks`` (u32 LE token bytes, one per block) chained onto ``parent``."""
        raise NotImplementedError


class _DigestChain(HashScheme):
    """``h_i = digest(h_{i-1} || tokens_i || frames_i)`` for a one-shot bytes digest."""

    def __init__(self, name: str, digest: Callable[[bytes], bytes]) -> None:
        self.name = name
        self._digest = digest

    def root(self, namespace: Namespace, block_size: int) -> bytes:
        return self._digest(namespace.root_material(self.name, block_size))

    def chain(
        self, blocks: list[bytes], parent: BlockHash | None, framer: _Framer | None, first_index: int
    ) -> list[BlockHash]:
        digest = self._digest
        out: list[BlockHash] = []
        append = out.append
        if not isinstance(parent, bytes):
            raise InvalidBlockHashError(f"{self.name} chains onto a bytes digest, got {type(parent).__name__}")
        d: bytes = parent
        if framer is None:
            for blk in blocks:
                d = digest(d + blk)
                append(d)
        else:
            for index, blk in enumerate(blocks, first_index):
                d = digest(d + blk + framer(index))
                append(d)
        return out


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


class _Xxh3x64Standard(HashScheme):
    """The Dynamo/Mooncake XXH3-64 (seed 1337) sequence-hash standard."""

    name = "xxh3-64-1337"
    hash_type = int
    SEED = 1337

    def root(self, namespace: Namespace, block_size: int) -> int | None:
        if namespace.is_default:
            return None
        return xxhash.xxh3_64_intdigest(namespace.root_material(self.name, block_size), self.SEED)

    def chain(
        self, blocks: list[bytes], parent: BlockHash | None, framer: _Framer | None, first_index: int
    ) -> list[BlockHash]:
        h64 = xxhash.xxh3_64_intdigest
        seed = self.SEED
        if framer is None:
            local = list(map(h64, blocks, repeat(seed, len(blocks))))
        else:
            local = [h64(blk + framer(i), seed) for i, blk in enumerate(blocks, first_index)]
        pack = _PAIR_U64.pack
        out: list[BlockHash] = []
        append = out.append
        prev = parent
        for loc in local:
            prev = loc if prev is None else h64(pack(prev, loc), seed)
            append(prev)
        return out


_PAIR_U64 = struct.Struct("<QQ")

HASH_SCHEMES: dict[str, HashScheme] = {
    "xxh3-128": _DigestChain("xxh3-128", xxhash.xxh3_128_digest),
    "sha256": _DigestChain("sha256", _sha256),
    "xxh3-64-1337": _Xxh3x64Standard(),
}


def get_scheme(name: str) -> HashScheme:
    try:
        return HASH_SCHEMES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown hash scheme {name!r}; known: {', '.join(sorted(HASH_SCHEMES))}") from None


# --------------------------------------------------------------------------- hashers

_SMALL_RUN = 8  # below this many blocks, slicing beats numpy's per-call overhead


class BlockHasher:
    """Chained block hashing bound to one scheme, namespace and block size.

    >>> hasher = BlockHasher(4, scheme="xxh3-64-1337")
    >>> len(hasher.hash_tokens(range(10)))  # 2 full blocks; the last 2 tokens are a partial block
    2
    """

    __slots__ = ("_block_dtype", "block_size", "namespace", "root", "scheme")

    def __init__(self, block_size: int, scheme: str = DEFAULT_SCHEME, namespace: str | Namespace = "default"):
        self.block_size = _check_index(block_size, "block_size", minimum=1)
        self.scheme = get_scheme(scheme)
        self.namespace = Namespace.of(namespace)
        self.root = self.scheme.root(self.namespace, self.block_size)
        self._block_dtype = np.dtype(f"V{4 * self.block_size}")

    def hash_packed(
        self,
        tokens: array[int],
        start_block: int,
        stop_block: int,
        parent: BlockHash | None,
        framer: _Framer | None = None,
    ) -> list[BlockHash]:
        """Hashes of blocks ``start_block..stop_block-1`` of ``tokens``, chained onto ``parent``."""
        count = stop_block - start_block
        if count <= 0:
            return []
        width = self.block_size
        if _BIG_ENDIAN:  # pragma: no cover - exercised only on big-endian hosts
            tokens = array("I", tokens[start_block * width : stop_block * width])
            tokens.byteswap()
            start_block, stop_block = 0, count
        if count < _SMALL_RUN:
            blocks = [tokens[i * width : (i + 1) * width].tobytes() for i in range(start_block, stop_block)]
        else:
            blocks = np.frombuffer(
                tokens, dtype=self._block_dtype, count=count, offset=start_block * 4 * width
            ).tolist()
        return self.scheme.chain(blocks, parent, framer, start_block)

    def hash_tokens(self, token_ids: Iterable[int], extras: BlockExtras | None = None) -> list[BlockHash]:
        """Chained hashes of every full block of ``token_ids``."""
        tokens = pack_tokens(token_ids)
        framer = self.scheme.make_framer(extras, self.block_size) if extras is not None else None
        return self.hash_packed(tokens, 0, len(tokens) // self.block_size, self.root, framer)


class HashedTokens:
    """A sequence's private copy of its token ids and the hashes of its full blocks.

    Extending is incremental: only blocks completed by the new tokens are hashed,
    and hashing a prompt in one call or piecewise gives identical hashes. The
    caller's token list is copied, so later changes to it have no effect here.
    """

    __slots__ = ("_framer", "_hasher", "_tokens", "hashes", "num_tokens")

    def __init__(self, hasher: BlockHasher, token_ids: Iterable[int] = (), extras: BlockExtras | None = None):
        self._hasher = hasher
        self._framer = hasher.scheme.make_framer(extras, hasher.block_size) if extras is not None else None
        self._tokens = pack_tokens(token_ids)  # a fresh array: the caller's list is never referenced
        self.hashes: list[BlockHash] = []
        """Chained hashes of the full blocks so far (read-only for callers)."""
        self.num_tokens = 0
        self._hash_new_blocks()

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    def extend(self, token_ids: Iterable[int]) -> int:
        """Append tokens; return how many new full blocks were hashed."""
        packed = pack_tokens(token_ids)
        return self.extend_packed(packed)

    def extend_packed(self, packed: array[int]) -> int:
        self._tokens.extend(packed)
        return self._hash_new_blocks()

    def truncate(self, num_tokens: int) -> None:
        """Forget the tokens from ``num_tokens`` on (an append the caller took back), and their blocks' hashes.

        Both are replaced by shorter copies, never cut in place: apart from that, they only grow, so an
        event recorded earlier may still read its part of them (``PrefixTree.insert(..., stable=True)``)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise InvalidArgumentError(f"cannot truncate {self.num_tokens} tokens to {num_tokens}")
        self._tokens = self._tokens[:num_tokens]
        self.hashes = self.hashes[: num_tokens // self._hasher.block_size]
        self.num_tokens = num_tokens

    def _hash_new_blocks(self) -> int:
        tokens = self._tokens
        self.num_tokens = len(tokens)
        hashes = self.hashes
        done = len(hashes)
        full = self.num_tokens // self._hasher.block_size
        if full == done:
            return 0
        parent = hashes[-1] if done else self._hasher.root
        hashes.extend(self._hasher.hash_packed(tokens, done, full, parent, self._framer))
        return full - done


class PrecomputedHashes:
    """The stand-in for :class:`HashedTokens` when the caller has hashes but no tokens.

    Routers and trace replays know block hashes (and the prompt length), not token ids.
    ``hashes`` must hold exactly one hash per full block: ``num_tokens // block_size``.
    """

    __slots__ = ("hashes", "num_tokens")

    def __init__(self, hashes: Iterable[BlockHash], num_tokens: int, block_size: int):
        self.hashes = validate_block_hashes(hashes)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
            raise InvalidBlockHashError(f"num_tokens must be an integer >= 0, got {num_tokens!r}")
        self.num_tokens = int(num_tokens)
        if len(self.hashes) != self.num_tokens // block_size:
            raise InvalidBlockHashError(
                f"{len(self.hashes)} block hashes given for {self.num_tokens} tokens; block size "
                f"{block_size} needs exactly {self.num_tokens // block_size} (one per full block)"
            )

    @property
    def token_ids(self) -> None:
        return None

    def extend(self, token_ids: Iterable[int]) -> int:
        raise SequenceStateError("sequence was registered by block hashes; token ids cannot be appended")

    def extend_packed(self, packed: array[int]) -> int:
        return self.extend(packed)


def block_hashes(
    token_ids: Iterable[int],
    block_size: int,
    *,
    scheme: str = DEFAULT_SCHEME,
    namespace: str | Namespace = "default",
    extras: BlockExtras | None = None,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids``, in order.

    >>> len(block_hashes(list(range(40)), 16))  # 2 full blocks, 8 tokens left over
    2
    >>> block_hashes([1, 2, 3], 16)  # no full block, no hash
    []
    """
    if type(block_size) is not int:  # before the cache, where 2.0 and True would pass for 2 and 1
        block_size = _check_index(block_size, "block_size", minimum=1)
    try:
        hasher = _hasher(block_size, scheme, namespace)
    except TypeError:  # an unhashable argument reached the cache
        hasher = BlockHasher(block_size, scheme, namespace)
    return hasher.hash_tokens(token_ids, extras)


@lru_cache(maxsize=64)
def _hasher(block_size: int, scheme: str, namespace: str | Namespace) -> BlockHasher:
    return BlockHasher(block_size, scheme, namespace)


@lru_cache(maxsize=256)
def _namespace_of_model(model: str) -> Namespace:
    return Namespace(model=model)


# --------------------------------------------------------------------------- JSON form of block hashes


def hash_to_json(h: object) -> int | str:
    """An int hash as itself, a bytes hash as hex."""
    if type(h) is int and h >= 0:
        return h
    if type(h) is bytes and h:
        return h.hex()
    raise InvalidBlockHashError(f"cannot encode block hash {h!r}: not an int >= 0 or non-empty bytes")


def hashes_to_json(hashes: Sequence[BlockHash]) -> str | list[int | str]:
    """``"W:HEX"`` for bytes hashes of one width W (all of a chain are); else a list of ints / hex strings.

    >>> hashes_to_json([b"\\x01\\x02", b"\\x03\\x04"]), hashes_to_json([7, 8])
    ('2:01020304', [7, 8])
    """
    if hashes and type(hashes[0]) is bytes:
        width = len(hashes[0])
        if width and all(type(h) is bytes and len(h) == width for h in hashes):
            return f"{width}:{b''.join(hashes).hex()}"  # type: ignore[arg-type]
    return [hash_to_json(h) for h in hashes]


_MAX_WIDTH_DIGITS = 6
"""A packed width has at most this many digits: ``int()`` of thousands of digits raises a bare ValueError."""


def _strict_fromhex(text: str) -> bytes | None:
    """The bytes ``text`` spells in hex, or None: unlike ``bytes.fromhex``, whitespace is refused too."""
    try:
        data = bytes.fromhex(text)
    except ValueError:
        return None
    return data if 2 * len(data) == len(text) else None


def hash_from_json(raw: object) -> BlockHash:
    """The inverse of :func:`hash_to_json`; anything else raises :class:`InvalidBlockHashError`."""
    if type(raw) is int and raw >= 0:
        return raw
    if type(raw) is str and raw:
        h = _strict_fromhex(raw)
        if h is not None:
            return h
    raise InvalidBlockHashError(f"malformed block hash {brief(raw)}")


def hashes_from_json(raw: object) -> tuple[BlockHash, ...]:
    """The inverse of :func:`hashes_to_json`; anything else (of any type, size or depth: the input
    may come from outside the process) raises :class:`InvalidBlockHashError`."""
    if type(raw) is list:
        return tuple(hash_from_json(h) for h in raw)
    if type(raw) is str:
        width, _, hexed = raw.partition(":")
        digits = width.isascii() and width.isdigit() and len(width) <= _MAX_WIDTH_DIGITS
        w = int(width) if digits else 0
        packed = _strict_fromhex(hexed) if w > 0 and hexed.isascii() and len(hexed) % (2 * w) == 0 else None
        if packed is not None:
            return tuple(packed[k : k + w] for k in range(0, len(packed), w))
    raise InvalidBlockHashError(f"malformed block hashes {brief(raw)}")


# --------------------------------------------------------------------------- vLLM's 64-bit event form


_U64 = (1 << 64) - 1


def vllm_int_hash(h: BlockHash) -> int:
    """The 64-bit integer form of a block hash that vLLM's KV events carry (its default,
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the digest's last 8 bytes, big-endian. An int stays
    itself (masked to 64 bits), so applying it twice changes nothing.

    >>> vllm_int_hash(bytes(range(16)))
    579005069656919567
    >>> vllm_int_hash(vllm_int_hash(bytes(range(16))))
    579005069656919567
    """
    return digest_u64(h, first=False)


def digest_u64(h: BlockHash, *, first: bool) -> int:
    """8 bytes of a digest as an unsigned big-endian int: its ``first`` 8, else its last 8 -- the 64-bit form
    engines put in their events (vLLM: the last, SGLang: the first). An int stays itself, masked to 64 bits."""
    if type(h) is bytes and h:
        return int.from_bytes(h[:8] if first else h[-8:], "big")
    if type(h) is int and h >= 0:
        return h & _U64
    raise InvalidBlockHashError(f"cannot convert block hash {brief(h)}: not an int >= 0 or non-empty bytes")
