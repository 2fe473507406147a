"""Hash schemes (chosen by name) and the :class:`Namespace` a chain root is derived from.

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
``dynamo-xxh3-64``
    The same chain with Dynamo's extras, bit for bit (:mod:`kvblocks.hashing.dynamo`): a LoRA adapter and a
    cache namespace (``BlockExtras.cache_salt``) move the local hashes' seed; multimodal items append their
    64-bit hashes to the blocks they overlap. Equal to ``xxh3-64-1337`` without extras.
``dynamo-xxh3-64-eagle``
    Dynamo's hashes for an EAGLE fleet (its ``is_eagle``): block ``i``'s local hash covers its tokens and the
    first token of the next block, ``[i * bs, i * bs + bs + 1)``, so a block has a hash only once that token
    exists (``(n - 1) // bs`` hashes for ``n`` tokens). For routing: a cache manager refuses it.
``vllm-sha256``, ``vllm-sha256-cbor``, ``vllm-xxhash``, ``vllm-xxhash-cbor``
    vLLM's own block hashes, bit for bit (:mod:`kvblocks.hashing.vllm`): its root and extra keys follow
    vLLM's rules, not the namespace framing and typed frames (:mod:`kvblocks.hashing.extras`).

The chain root comes from a :class:`Namespace` (scheme, block size, model id,
optional salt) through a framed encoding, never from ``hash()`` or
``PYTHONHASHSEED``: two processes with one namespace agree on every hash. (For
``xxh3-64-1337`` the default namespace has no root, so the output is the
standard's; any other namespace chains block 0 onto a namespace root.)
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from itertools import repeat

import xxhash

from kvblocks.errors import ConfigError, InvalidBlockHashError
from kvblocks.hashing.dynamo import DynamoBlockExtras, dynamo_extras
from kvblocks.hashing.extras import (
    _ROOT_MAGIC,
    _TAG_ROOT_BLOCK_SIZE,
    _TAG_ROOT_MODEL,
    _TAG_ROOT_SALT,
    _TAG_ROOT_SCHEME,
    BlockExtras,
    _as_bytes,
    _frame,
    _Framer,
)
from kvblocks.hashing.tokens import BlockHash

__all__ = ["DEFAULT_SCHEME", "HASH_SCHEMES", "HashScheme", "Namespace", "get_scheme"]

DEFAULT_SCHEME = "xxh3-128"


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


@lru_cache(maxsize=256)
def _namespace_of_model(model: str) -> Namespace:
    return Namespace(model=model)


class HashScheme:
    """A named way of chaining block hashes. Subclasses implement :meth:`root` and :meth:`chain`.

    The chain state is always the previous block's hash (or the root before block 0),
    so a sequence can be extended from its last hash alone.
    """

    name: str = ""
    hash_type: type = bytes
    lookahead: int = 0
    """Tokens past its block that a block's hash also covers: a block is hashed once they exist (0: when full)."""

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

    one_block: Callable[[BlockHash | None, bytes], BlockHash] | None = None
    """``chain([block], parent, None, i)[0]``, as one call (None: the scheme has no such shortcut): a decoding
    sequence hashes one block at a time, without extras."""


class _DigestChain(HashScheme):
    """``h_i = digest(h_{i-1} || tokens_i || frames_i)`` for a one-shot bytes digest."""

    def __init__(self, name: str, digest: Callable[[bytes], bytes]) -> None:
        self.name = name
        self._digest = digest
        self.one_block = self._one_block

    def _one_block(self, parent: BlockHash | None, block: bytes) -> BlockHash:
        if not isinstance(parent, bytes):
            raise InvalidBlockHashError(f"{self.name} chains onto a bytes digest, got {type(parent).__name__}")
        return self._digest(parent + block)

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

    def __init__(self) -> None:
        self.one_block = self._one_block

    def _one_block(self, parent: BlockHash | None, block: bytes) -> BlockHash:
        h64 = xxhash.xxh3_64_intdigest
        local = h64(block, self.SEED)
        return local if parent is None else h64(_PAIR_U64.pack(parent, local), self.SEED)

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


class _DynamoXxh3x64(_Xxh3x64Standard):
    """Dynamo's chain with its extras (:mod:`kvblocks.hashing.dynamo`): a request's LoRA adapter and cache
    namespace move the local hashes' seed, multimodal items append their 64-bit hashes to the blocks they
    overlap. Without extras, the ``xxh3-64-1337`` chain."""

    name = "dynamo-xxh3-64"

    def make_framer(self, extras: BlockExtras, block_size: int) -> _Framer | None:
        return dynamo_extras(extras, block_size)

    def chain(
        self, blocks: list[bytes], parent: BlockHash | None, framer: _Framer | None, first_index: int
    ) -> list[BlockHash]:
        if framer is None:
            return super().chain(blocks, parent, None, first_index)
        if not isinstance(framer, DynamoBlockExtras):
            raise ConfigError(f"{self.name} needs its own per-block extras: build them with make_framer")
        h64 = xxhash.xxh3_64_intdigest
        seed, mm = framer.seed, framer.mm_bytes
        pack = _PAIR_U64.pack
        out: list[BlockHash] = []
        prev = parent
        for index, blk in enumerate(blocks, first_index):
            extra = mm.get(index)
            local = h64(blk if extra is None else blk + extra, seed)
            prev = local if prev is None else h64(pack(prev, local), self.SEED)
            out.append(prev)
        return out


class _DynamoEagle(_DynamoXxh3x64):
    """Dynamo's chain for EAGLE fleets: each block's local hash also covers the next block's first token
    (``lookahead`` 1; the hasher hands :meth:`chain` ``block_size + 1`` tokens per block)."""

    name = "dynamo-xxh3-64-eagle"
    lookahead = 1


_PAIR_U64 = struct.Struct("<QQ")

HASH_SCHEMES: dict[str, HashScheme] = {
    "xxh3-128": _DigestChain("xxh3-128", xxhash.xxh3_128_digest),
    "sha256": _DigestChain("sha256", _sha256),
    "xxh3-64-1337": _Xxh3x64Standard(),
    "dynamo-xxh3-64": _DynamoXxh3x64(),
    "dynamo-xxh3-64-eagle": _DynamoEagle(),
}


def get_scheme(name: str) -> HashScheme:
    try:
        return HASH_SCHEMES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown hash scheme {name!r}; known: {', '.join(sorted(HASH_SCHEMES))}") from None
