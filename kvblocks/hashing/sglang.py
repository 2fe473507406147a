"""SGLang's KV-event block hashes, bit for bit (SGLang 0.5.23, ``sglang/srt/mem_cache``).

SGLang's radix cache names page ``i`` of a prefix by a SHA-256 chain over the page's tokens as u32
little-endian (``get_hash_str``, a C++ extension)::

    h_0 = sha256(tokens_0)            h_i = sha256(h_{i-1} || tokens_i)

and its KV events carry ``hash_str_to_int64``: the digest's first 8 bytes, big-endian, as a *signed*
int64. kvblocks' wire codec (:mod:`kvblocks.interop.engine_wire`) reads a signed hash as the same 8 bytes
unsigned, which is :func:`sglang_int_hash` of the digest -- so a router configured with
``hash_scheme="sglang-sha256", hash_form="sglang-int64"`` indexes an SGLang fleet from token ids.

Extras: a LoRA adapter does not enter SGLang's event hashes (it publishes ``lora_name`` beside them), so
``BlockExtras.lora`` changes nothing here. A request's ``cache_salt`` and multimodal items do change
SGLang's hashes by rules not reproduced here: they raise :class:`ConfigError`, as does a namespace salt
(SGLang's chain has no root). ``Namespace.model`` and the block size do not enter the hashes.

>>> from kvblocks.hashing import block_hashes
>>> h = block_hashes(range(1000, 1012), 4, scheme="sglang-sha256")
>>> [int.from_bytes(d[:8], "big", signed=True) for d in h]  # as SGLang 0.5.23's events carry them
[2113097436205950712, 3163135733697444377, -8025336983078401202]
"""

from __future__ import annotations

import hashlib

from kvblocks.errors import ConfigError, InvalidBlockHashError
from kvblocks.hashing.encoding import digest_u64
from kvblocks.hashing.extras import BlockExtras, _Framer
from kvblocks.hashing.schemes import HashScheme, Namespace
from kvblocks.hashing.tokens import BlockHash

__all__ = ["SGLANG_SCHEMES", "SglangScheme", "sglang_int_hash"]


class SglangScheme(HashScheme):
    """SGLang's page hash chain: SHA-256 of the previous digest and the page's u32 LE tokens, no root."""

    name = "sglang-sha256"
    hash_type = bytes

    def root(self, namespace: Namespace, block_size: int) -> None:
        if namespace.salt is not None:
            raise ConfigError("SGLang's page hashes have no root: a namespace salt cannot be expressed")
        return None

    def make_framer(self, extras: BlockExtras, block_size: int) -> _Framer | None:
        if extras.cache_salt is not None or extras.mm_items:
            raise ConfigError("sglang-sha256 does not reproduce SGLang's salted or multimodal page hashes")
        return None  # a LoRA leaves SGLang's event hashes as they are

    def chain(
        self, blocks: list[bytes], parent: BlockHash | None, framer: _Framer | None, first_index: int
    ) -> list[BlockHash]:
        if parent is not None and type(parent) is not bytes:
            raise InvalidBlockHashError(f"sglang-sha256 chains onto a bytes digest, got {type(parent).__name__}")
        sha256 = hashlib.sha256
        out: list[BlockHash] = []
        digest = parent
        for block in blocks:
            digest = sha256(block).digest() if digest is None else sha256(digest + block).digest()
            out.append(digest)
        return out


def sglang_int_hash(h: BlockHash) -> int:
    """The 64-bit form of an SGLang page hash in its events, read unsigned: the digest's first 8 bytes,
    big-endian (SGLang writes them signed; kvblocks' codec reads the same bits unsigned). An int is
    itself, masked to 64 bits.

    >>> sglang_int_hash(bytes(range(32))) == int.from_bytes(bytes(range(8)), "big")
    True
    """
    return digest_u64(h, first=True)


SGLANG_SCHEMES: dict[str, HashScheme] = {"sglang-sha256": SglangScheme()}
"""SGLang's page hash, by kvblocks scheme name (registered in ``HASH_SCHEMES``)."""
