"""Cross-attention groups (encoder-decoder models: Whisper, Llama 3.2 Vision): encoder K/V per sequence.

A cross-attention layer attends to the K and V of the sequence's encoder outputs, not to its own
tokens. Those depend on the request's encoder input (audio, image), not on the decoder's token
prefix, so they are never prefix-cached: the hash chain says nothing about them. A sequence's
table in such a group holds ``ceil(E / block_size)`` blocks for its ``E`` encoder tokens, taken at
admission (all or nothing, with every other group) and returned to the fresh queue when the
sequence is freed or preempted; the engine runs the encoder for every admission::

    E = 10 encoder tokens, block size 4
    cross table        [ 7 | 2 | 5 ]      tokens 0-3, 4-7, 8-9 of the encoder output; never findable

The manager learns ``E`` from :meth:`~kvblocks.core.manager.KVCacheManager.set_encoder_tokens`
before the admission (0 by default: a text-only request to a vision model holds no cross blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvblocks.core.groups.protocol import Ask, GroupCopies
from kvblocks.core.pool import BlockPool
from kvblocks.errors import ConfigError, IntegrityError

__all__ = ["CrossAttentionGroup"]


@dataclass(frozen=True)
class CrossAttentionGroup:
    """One cross-attention layer group: its pool size and block size (None: the manager's)."""

    num_blocks: int
    block_size: int | None = None

    def __post_init__(self) -> None:
        for what in ("num_blocks", "block_size"):
            value = getattr(self, what)
            if what == "block_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"a cross-attention group's {what} must be a positive int, got {value!r}")


class _Cross:
    """A cross-attention group's pool and the tables of admitted sequences (blocks are never cached)."""

    __slots__ = ("block_size", "number", "pool", "tables")

    def __init__(self, group: CrossAttentionGroup, number: int, block_size: int) -> None:
        self.number = number
        self.block_size = group.block_size or block_size
        self.pool = BlockPool(group.num_blocks)
        self.tables: dict[int, list[int]] = {}  # id(_Sequence) -> table

    def blocks_for(self, encoder_tokens: int) -> int:
        return -(-encoder_tokens // self.block_size)

    def admission(self, ask: Ask, remote: Sequence[int] | None) -> tuple[int, Any] | None:
        """The group's part of an admission (see :class:`~kvblocks.core.groups.protocol.GroupManager`): the
        blocks the sequence's encoder tokens lack (a hit needs nothing here)."""
        return self.blocks_for(ask.encoder) - self.pool.num_free, ask.encoder

    def take_admission(self, key: int, ask: Ask, prepared: Any) -> GroupCopies | None:
        """Take the sequence's blocks (the caller checked there is room: every free block is fresh here)."""
        self.tables[key] = self.pool.take_fresh(self.blocks_for(prepared))
        return None

    def release(self, key: int) -> None:
        self.pool._release_valid(reversed(self.tables.pop(key)))

    def check_integrity(self, live: dict[int, int]) -> None:
        """``live``: id(_Sequence) -> encoder tokens of every admitted sequence."""
        number = self.number
        pool = self.pool
        pool.check_integrity()
        if set(self.tables) != set(live):
            raise IntegrityError(f"group {number} has tables for other sequences than the admitted ones")
        expected = [0] * pool.num_blocks
        for key, table in self.tables.items():
            if len(table) != self.blocks_for(live[key]):
                raise IntegrityError(f"group {number}: a table of {len(table)} blocks for {live[key]} encoder tokens")
            for block in table:
                expected[block] += 1
        for block in range(pool.num_blocks):
            if pool.ref_count(block) != expected[block] or pool.is_cached(block):
                raise IntegrityError(f"group {number}: block {block} is cached or has wrong references")
