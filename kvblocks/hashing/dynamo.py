"""NVIDIA Dynamo's KV-router block hashes, bit for bit, with LoRA adapters, cache namespaces and multimodal items.

Dynamo (``ai-dynamo-runtime`` 1.6.1, ``compute_block_hash_for_seq``) names a block by a *local* hash of its own
tokens, and its router chains them into *sequence* hashes::

    seed     = 1337 + xxh3_64(lora_name, seed=0) + xxh3_64(cache_namespace, seed=1)    (mod 2**64; an absent
                                                                                        or empty name adds 0)
    local_i  = xxh3_64(tokens_i as u32 LE || sorted mm hashes of block i as u64 LE, seed)
    seq_0    = local_0,   seq_i = xxh3_64(seq_{i-1} as u64 LE || local_i as u64 LE, seed=1337)

The ``dynamo-xxh3-64`` scheme is that chain; ``dynamo-xxh3-64-eagle`` is Dynamo's ``is_eagle`` form, whose
block ``i`` also covers the next block's first token (``local_i`` over tokens ``[i * bs, i * bs + bs + 1)``).
:class:`~kvblocks.hashing.BlockExtras` maps onto both: ``lora`` is the adapter name, ``cache_salt`` the cache
namespace, and each multimodal item's hash (:func:`mm_hash`) enters every block the item overlaps. Without
extras ``dynamo-xxh3-64`` equals ``xxh3-64-1337``.
Test vectors from Dynamo's own function: ``tests/data/dynamo_hash_vectors.json``
(``tools/vectors/make_dynamo_hash_vectors.py``).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import xxhash

from kvblocks.errors import ConfigError
from kvblocks.hashing.extras import BlockExtras, _as_bytes, blocks_overlapping

__all__ = ["DynamoBlockExtras", "dynamo_local_hashes", "dynamo_seed", "mm_hash"]

SEED = 1337
_M64 = (1 << 64) - 1
_U64 = struct.Struct("<Q")
_HEX = frozenset("0123456789abcdefABCDEF")


def dynamo_seed(lora_name: str | bytes | None = None, cache_namespace: str | bytes | None = None) -> int:
    """The XXH3 seed Dynamo hashes a request's blocks with: 1337, moved by the adapter and the namespace.

    >>> dynamo_seed() == 1337 and dynamo_seed("", "") == 1337
    True
    """
    seed = SEED
    if lora_name:
        seed += xxhash.xxh3_64_intdigest(_as_bytes(lora_name, "lora_name"), 0)
    if cache_namespace:
        seed += xxhash.xxh3_64_intdigest(_as_bytes(cache_namespace, "cache_namespace"), 1)
    return seed & _M64


def mm_hash(identifier: str | bytes) -> int:
    """A multimodal item's 64-bit hash as Dynamo takes it from an identifier: a 64-digit hex digest (vLLM's)
    gives its first 16 digits; anything else its XXH3-64.

    >>> mm_hash("ab" * 32) == 0xABABABABABABABAB
    True
    """
    if isinstance(identifier, str) and len(identifier) == 64 and all(c in _HEX for c in identifier):
        return int(identifier[:16], 16)
    return _x(identifier)


def _x(identifier: str | bytes) -> int:
    data = _as_bytes(identifier, "multimodal item digest")
    if not data:
        raise ConfigError("a multimodal identifier must not be empty")
    return xxhash.xxh3_64_intdigest(data)


def dynamo_local_hashes(
    tokens: Sequence[int],
    block_size: int,
    *,
    seed: int = SEED,
    block_mm_hashes: Sequence[Sequence[int] | None] = (),
    eagle: bool = False,
) -> list[int]:
    """Dynamo's ``compute_block_hash_for_seq``: one local hash per full block of ``tokens``, under ``seed``
    (:func:`dynamo_seed`), block ``i`` also hashing ``block_mm_hashes[i]`` (its items' hashes, any order).
    With ``eagle`` (its ``is_eagle``) block ``i`` covers tokens ``[i * bs, i * bs + bs + 1)``."""
    if block_size < 1:
        raise ConfigError(f"block_size must be >= 1, got {block_size}")
    h64 = xxhash.xxh3_64_intdigest
    reach = 1 if eagle else 0
    out = []
    for i in range(max(0, len(tokens) - reach) // block_size):
        data = struct.pack(f"<{block_size + reach}I", *tokens[i * block_size : (i + 1) * block_size + reach])
        mm = block_mm_hashes[i] if i < len(block_mm_hashes) else None
        if mm:
            data += b"".join(_U64.pack(h) for h in sorted(mm))
        out.append(h64(data, seed))
    return out


@dataclass(frozen=True)
class DynamoBlockExtras:
    """What :class:`~kvblocks.hashing.BlockExtras` adds to a block under ``dynamo-xxh3-64``: the seed, and per
    block the packed, sorted hashes of the multimodal items it overlaps."""

    seed: int
    mm_bytes: dict[int, bytes]

    def __call__(self, index: int) -> bytes:
        return self.mm_bytes.get(index, b"")


@lru_cache(maxsize=256)
def dynamo_extras(extras: BlockExtras, block_size: int) -> DynamoBlockExtras | None:
    """The seed and per-block multimodal bytes of ``extras`` (None: neither changes a hash). A LoRA path has no
    place in Dynamo's hash: refused with :class:`ConfigError`, not dropped."""
    if extras.lora_path is not None:
        raise ConfigError("dynamo-xxh3-64 keys LoRA blocks by the adapter's name only: give no lora_path")
    per_block: dict[int, list[int]] = {}
    for item in extras.mm_items:
        value = mm_hash(item.digest)
        for index in blocks_overlapping(item.offset, item.length, block_size):
            per_block.setdefault(index, []).append(value)
    seed = dynamo_seed(extras.lora, extras.cache_salt)
    if seed == SEED and not per_block:
        return None
    mm_bytes = {i: b"".join(_U64.pack(h) for h in sorted(hashes)) for i, hashes in per_block.items()}
    return DynamoBlockExtras(seed, mm_bytes)
