"""Block identity: chained hashes over the *full* blocks of a token sequence.

With block size 4::

    tokens   | 7 1 4 4 | 9 9 0 2 | 5 3 |
    blocks   | block 0 | block 1 | partial: never hashed, never cached
    hashes     h0 = H(root, block 0, extras 0)
                         h1 = H(h0, block 1, extras 1)

One hash names a whole prefix, so the same value serves as prefix-tree key,
storage key, event payload and router index key.

The machinery lives in one module per job: token packing and hash checks in :mod:`kvblocks.hashing.tokens`,
extra keys and their typed frames in :mod:`kvblocks.hashing.extras`, namespaces and schemes in
:mod:`kvblocks.hashing.schemes`, the hashers in :mod:`kvblocks.hashing.hasher`, and the JSON and 64-bit
integer forms of hashes in :mod:`kvblocks.hashing.encoding`. This module re-exports their names, so
``from kvblocks.hashing.core import ...`` keeps working.
"""

from kvblocks.hashing.encoding import digest_u64 as digest_u64
from kvblocks.hashing.encoding import (
    hash_from_json,
    hash_to_json,
    hashes_from_json,
    hashes_to_json,
    vllm_int_hash,
)
from kvblocks.hashing.extras import BlockExtras, MultimodalItem, blocks_overlapping
from kvblocks.hashing.extras import _Framer as _Framer
from kvblocks.hashing.hasher import BlockHasher, HashedTokens, PrecomputedHashes, block_hashes
from kvblocks.hashing.schemes import DEFAULT_SCHEME, HASH_SCHEMES, HashScheme, Namespace, get_scheme
from kvblocks.hashing.tokens import TOKEN_LIMIT as TOKEN_LIMIT
from kvblocks.hashing.tokens import BlockHash, pack_tokens, validate_block_hashes

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
