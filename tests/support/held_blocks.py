"""Serving a manager through batched steps and reading what each running sequence holds per group (shared by
the hybrid memory test and its benchmark)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvblocks import KVCacheManager
from kvblocks.hybrid import PLACEHOLDER, HybridKVCacheManager


@dataclass(frozen=True)
class Held:
    """What one running sequence holds after a step: its committed tokens, slots, and blocks per group."""

    committed: int
    slots: int
    blocks: tuple[int, ...]  # non-PLACEHOLDER table entries per group (group 0: full attention)


def held_blocks(manager: KVCacheManager, seq_id: str) -> tuple[int, ...]:
    """Blocks ``seq_id`` holds in each group of ``manager``, read from its tables."""
    if isinstance(manager, HybridKVCacheManager):
        return tuple(
            sum(b != PLACEHOLDER for b in manager.group_block_table(seq_id, g)) for g in range(manager.num_groups)
        )
    return (len(manager.block_table(seq_id)),)


def in_use(manager: KVCacheManager) -> tuple[int, ...]:
    """Blocks in use (referenced) per group's pool."""
    if isinstance(manager, HybridKVCacheManager):
        return tuple(manager.group_pool(g).num_in_use for g in range(manager.num_groups))
    return (manager.pool.num_in_use,)


def prompts(lengths: list[int]) -> dict[str, list[int]]:
    """Prompts that share no block (distinct token ranges), so every held block is one sequence's own."""
    return {f"s{i}": list(range(i * 1_000_000, i * 1_000_000 + n)) for i, n in enumerate(lengths)}


def serve(
    manager: KVCacheManager, lengths: list[int], chunk: int, decode: int
) -> Iterator[tuple[dict[str, Held], tuple[int, ...]]]:
    """Chunked prefill of every prompt then ``decode`` tokens each, all through batched ``step`` calls.

    Yields after each step what every sequence holds, and the blocks in use per pool.
    """
    seqs = prompts(lengths)
    slots: dict[str, int] = {}
    committed = dict.fromkeys(seqs, 0)
    for seq_id, tokens in seqs.items():
        manager.add_sequence(seq_id, tokens)
        slots[seq_id] = min(chunk, len(tokens))
        if manager.allocate(seq_id, slots[seq_id]) is None:
            raise RuntimeError("pool too small")

    def snapshot() -> tuple[dict[str, Held], tuple[int, ...]]:
        held = {s: Held(committed[s], slots[s], held_blocks(manager, s)) for s in seqs}
        return held, in_use(manager)

    yield snapshot()
    while prefilling := [s for s in seqs if slots[s] < len(seqs[s])]:
        news = [min(chunk, len(seqs[s]) - slots[s]) for s in prefilling]
        if manager.step(prefilling, [slots[s] for s in prefilling], None, news):
            raise RuntimeError("pool too small")
        for s, new in zip(prefilling, news):
            committed[s], slots[s] = slots[s], slots[s] + new
        yield snapshot()
    ids = list(seqs)
    for token in range(decode):
        if manager.step(ids, [slots[s] for s in ids], [[token] for _ in ids]):
            raise RuntimeError("pool too small")
        for s in ids:
            committed[s], slots[s] = slots[s], slots[s] + 1
        yield snapshot()
