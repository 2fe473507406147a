"""Block identity: chained hashes over the full blocks of a token sequence.

kvblocks' own schemes and the machinery live in :mod:`kvblocks.hashing.core`; the engine schemes that
reproduce vLLM's block hashes in :mod:`kvblocks.hashing.vllm`, SGLang's in :mod:`kvblocks.hashing.sglang`.
Every scheme is registered here, by name, in :data:`HASH_SCHEMES`.
"""

from kvblocks.hashing.core import (
    DEFAULT_SCHEME,
    HASH_SCHEMES,
    TOKEN_LIMIT,
    BlockExtras,
    BlockHash,
    BlockHasher,
    HashedTokens,
    HashScheme,
    MultimodalItem,
    Namespace,
    PrecomputedHashes,
    block_hashes,
    blocks_overlapping,
    get_scheme,
    hash_from_json,
    hash_to_json,
    hashes_from_json,
    hashes_to_json,
    pack_tokens,
    validate_block_hashes,
    vllm_int_hash,
)
from kvblocks.hashing.sglang import SGLANG_SCHEMES, SglangScheme, sglang_int_hash
from kvblocks.hashing.vllm import VLLM_SCHEMES, VllmScheme, vllm_extra_keys

HASH_SCHEMES.update(VLLM_SCHEMES)
HASH_SCHEMES.update(SGLANG_SCHEMES)

__all__ = [
    "DEFAULT_SCHEME",
    "HASH_SCHEMES",
    "TOKEN_LIMIT",
    "VLLM_SCHEMES",
    "BlockExtras",
    "BlockHash",
    "BlockHasher",
    "HashScheme",
    "HashedTokens",
    "MultimodalItem",
    "Namespace",
    "PrecomputedHashes",
    "SGLANG_SCHEMES",
    "SglangScheme",
    "VllmScheme",
    "block_hashes",
    "blocks_overlapping",
    "get_scheme",
    "hash_from_json",
    "hash_to_json",
    "hashes_from_json",
    "hashes_to_json",
    "pack_tokens",
    "sglang_int_hash",
    "validate_block_hashes",
    "vllm_extra_keys",
    "vllm_int_hash",
]
