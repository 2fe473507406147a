"""A sequence's state in the manager, its block-table view, its hashed content and the count-argument check."""

from __future__ import annotations

import operator
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import SupportsIndex, cast, overload

from kvblocks.errors import IntegrityError, InvalidArgumentError
from kvblocks.hashing import BlockExtras, BlockHash, BlockHasher, HashedTokens, PrecomputedHashes

__all__ = ["BlockTable", "hashed_content"]

_FREED_MEMORY = 8192  # how many freed ids are remembered to tell a double free from an unknown id
_NEVER = sys.maxsize


class BlockTable(Sequence[int]):
    """A read-only view of a sequence's block ids, position ``i`` holding tokens ``[i*B, (i+1)*B)``.

    The view follows the table while the sequence is admitted (later allocations
    show up in it) and stops changing when the sequence is freed or preempted.
    ``num_cached_tokens`` is the hit the admission took (all tiers): the engine computes
    from there, whatever an earlier ``lookup`` said.
    """

    __slots__ = ("_ids", "num_cached_tokens")

    def __init__(self, ids: list[int], num_cached_tokens: int = 0) -> None:
        self._ids = ids
        self.num_cached_tokens = num_cached_tokens

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._ids[index]

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockTable):
            return self._ids == other._ids
        if isinstance(other, (list, tuple)):
            return self._ids == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BlockTable({self._ids!r})"


class _Sequence:
    """Everything the manager keeps about one sequence. ``table is None`` means not admitted."""

    __slots__ = (
        "content",
        "lookahead",
        "lora_id",
        "lora_name",
        "num_committed",
        "num_covered",
        "pins",
        "preempted",
        "skip_read",
        "step_commit",
        "step_cover",
        "step_lookahead",
        "step_mark",
        "step_tokens",
        "table",
        "view",
        "watch",
    )

    def __init__(self, content: HashedTokens | PrecomputedHashes, skip_read: bool = False) -> None:
        self.content = content
        self.lora_name: str | None = None  # the adapter its blocks are computed with (their events name it)
        self.lora_id: int | None = None  # and the engine's id for it (their events carry it)
        self.table: list[int] | None = None
        self.view: BlockTable | None = None
        self.pins: dict[int, int] | None = None  # position -> tree node pinned instead of a private duplicate
        self.num_covered = 0  # tokens the table has slots for (lookahead slots not included)
        self.lookahead = 0  # draft-token slots after num_covered; the table has ceil((covered + lookahead) / B)
        self.num_committed = 0  # tokens whose KV is written (cached prefix included)
        self.preempted = False
        self.skip_read = skip_read  # never take a hit (prompt logprobs need every token computed); still writes
        self.watch = _NEVER  # a commit reaching this many tokens must reach the groups beside full attention
        # the batched step's plan for this sequence, written by its checking pass and read by its applying pass
        # (kvblocks/core/step.py); step_mark is the number of the last step that planned it (0: none)
        self.step_mark = 0
        self.step_commit = self.step_cover = self.step_lookahead = 0
        self.step_tokens: array[int] | int | None = None

    def blocks(self) -> list[int]:
        """The table of an admitted sequence (its callers checked it is admitted)."""
        table = self.table
        if table is None:
            raise IntegrityError("a sequence that is not admitted has no table")
        return table

    def clear_table(self) -> None:
        """The sequence left its blocks (freed or preempted): not admitted any more."""
        self.table = None
        self.view = None
        self.pins = None
        self.num_covered = self.num_committed = self.lookahead = 0
        self.watch = _NEVER


def _count_arg(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{what} must be an int, got bool")
    try:
        number = operator.index(cast("SupportsIndex", value))
    except TypeError:
        raise InvalidArgumentError(f"{what} must be an int, got {type(value).__name__}") from None
    if number < 0:
        raise InvalidArgumentError(f"{what} must be >= 0, got {number}")
    return number


def hashed_content(
    hasher: BlockHasher,
    token_ids: Iterable[int] | None,
    extras: BlockExtras | None,
    block_hashes: Iterable[BlockHash] | None,
    num_tokens: int | None,
) -> HashedTokens | PrecomputedHashes:
    """A prompt's hashed content, from its token ids (and extras) or from its block hashes (one per full block,
    as a router or trace has them; ``num_tokens`` is then the prompt length)."""
    if extras is not None and not isinstance(extras, BlockExtras):
        raise InvalidArgumentError(f"extras must be a BlockExtras, got {type(extras).__name__}")
    if block_hashes is not None:
        if token_ids is not None or extras is not None:
            raise InvalidArgumentError("give either token_ids (and extras) or block_hashes, not both")
        if num_tokens is None:
            raise InvalidArgumentError("block_hashes needs num_tokens, the prompt length")
        return PrecomputedHashes(block_hashes, num_tokens, hasher.block_size)
    if token_ids is None:
        raise InvalidArgumentError("a prompt needs token_ids or block_hashes")
    if num_tokens is not None:
        raise InvalidArgumentError("num_tokens is only for sequences given by block_hashes")
    return HashedTokens(hasher, token_ids, extras)
