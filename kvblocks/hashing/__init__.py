"""Block identity: chained hashes over the full blocks of a token sequence.

kvblocks' own schemes and the machinery live in one module per job (:mod:`kvblocks.hashing.core` gives the
overview and names them); the engine schemes that reproduce vLLM's block hashes in :mod:`kvblocks.hashing.vllm`,
SGLang's in :mod:`kvblocks.hashing.sglang`. Every scheme is registered here, by name, in :data:`HASH_SCHEMES`.
"""

from kvblocks.hashing.encoding import hash_from_json, hash_to_json, hashes_from_json, hashes_to_json, vllm_int_hash
from kvblocks.hashing.extras import BlockExtras, MultimodalItem, blocks_overlapping
from kvblocks.hashing.hasher import BlockHasher, HashedTokens, PrecomputedHashes, block_hashes
from kvblocks.hashing.schemes import DEFAULT_SCHEME, HASH_SCHEMES, HashScheme, Namespace, get_scheme
from kvblocks.hashing.sglang import SGLANG_SCHEMES, SglangScheme, sglang_int_hash
from kvblocks.hashing.tokens import TOKEN_LIMIT, BlockHash, pack_tokens, validate_block_hashes
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
