"""A small KV spec's entry format, a payload of its size, and well-formed keys, shared by the storage tests."""

from __future__ import annotations

from kvblocks.backends import KVCacheSpec
from kvblocks.tiers import EntryFormat

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", block_size=4)
FORMAT = EntryFormat.for_spec(SPEC, "xxh3-128")
PAYLOAD = bytes(range(256)) * (SPEC.bytes_per_block // 256)


def keys(*names: str) -> list[str]:
    return [f"xxh3-128.{'0' * 16}.b{name}" for name in names]
