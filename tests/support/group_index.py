"""The per-group hash -> block indexes of a hybrid manager, and vLLM's lookup mock that hides entries of them
(shared by the vLLM hybrid and Mamba scenario tests)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from kvblocks.hashing import BlockHash
from kvblocks.hybrid import HybridKVCacheManager


def index_of(m: HybridKVCacheManager, group: int) -> dict[BlockHash, int]:
    """Group ``group``'s hash -> block map (checkpoint for a recurrent group): what vLLM's tests pop from."""
    if group == 0:
        return m.tree._block_of
    if m.group_kinds[group] == "recurrent":
        return m._groups.recurrent(group).index._block_of
    return m._locals[group - 1].index._block_of


@contextmanager
def evicted(m: HybridKVCacheManager, entries: Sequence[tuple[int, BlockHash]]) -> Iterator[None]:
    """vLLM's ``_test_partial_request_hit`` mock: hide (group, hash) entries around pure lookups."""
    saved = [(index_of(m, g), h, index_of(m, g).pop(h)) for g, h in entries]
    try:
        yield
    finally:
        for index, h, block in saved:
            index[h] = block
        m.check_integrity()
