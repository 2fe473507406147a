"""The per-step tensors a paged-attention kernel takes, on the cache's device, kept up to date incrementally.

After the manager's ``step`` (or ``allocate``), the engine names the sequences that run and how many new
tokens each computes; :meth:`StepMetadataBuilder.build` returns, for that batch::

    block size 4; "a" decodes (8 tokens computed, 1 new), "b" prefills a chunk (0 computed, 6 new)
    tables          a: [3, 7, 9]       b: [0, 5]
    block_table     [[3, 7, 9], [0, 5, -1]]          int32 (num_seqs, max_blocks), -1 past a table
    slot_mapping    [36,  0, 1, 2, 3, 20, 21]          int64, one per new token: block * 4 + offset
    positions       [8,   0, 1, 2, 3, 4, 5]            int64, each new token's place in its sequence
    seq_lens        [9, 6]                             int32, tokens in context once the step's are in
    query_start_loc [0, 1, 7]                          int32 (cu_seqlens_q), num_seqs + 1
    max_seq_len 9, max_query_len 6

A sequence's new tokens start at its committed line (``num_computed_tokens``): after ``step(ids, n, ...)``
that is ``n``, after an admission the hit. Tables use the manager's own ids, so a slot indexes the
cache's ``num_blocks * block_size`` slots.

Incremental: the builder keeps one host row per sequence (numpy), copies only the block ids appended
since the last build (or rewrites a row whose table shrank at its tail or was replaced by a new
admission), and assembles a batch with one vectorised gather per array and one host-to-device copy per
array (from pinned buffers on CUDA). Rows of sequences that left are reused. Between two builds a table
may grow, shrink at its tail or be replaced (a readmission) -- what ``step``/``allocate`` do; a tail shrunk
and grown back to the same length by two calls between builds is seen by its last block id changing.

Hybrid managers: one table and one slot mapping per attention group -- full attention (0) and each
local group, whose blocks may be larger. A sliding-window or chunked-local group's released positions
read :data:`~kvblocks.hybrid.PLACEHOLDER` (-1) in its table, as ``group_block_table`` shows them; the
window itself always holds valid ids. Recurrent and cross-attention groups have no per-token table.

This module imports torch; ``import kvblocks.attention`` does not (it loads this on first use).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvblocks.backends._torch import torch
from kvblocks.core.manager import KVCacheManager
from kvblocks.core.sequence import _Sequence
from kvblocks.errors import InvalidArgumentError, SequenceStateError

__all__ = ["PAD", "StepMetadata", "StepMetadataBuilder"]

PAD = -1
"""Block table entries past a sequence's table (and a window group's released positions)."""

_Rows = npt.NDArray[np.int32]


@dataclass(frozen=True, eq=False)
class StepMetadata:
    """One step's tensors, on the builder's device. Valid until the next :meth:`StepMetadataBuilder.build`.

    ``block_tables[i]`` and ``slot_mappings[i]`` belong to manager group ``groups[i]`` (``(0,)`` for a
    plain manager); ``block_table`` and ``slot_mapping`` are group 0's.
    """

    groups: tuple[int, ...]
    block_tables: tuple[torch.Tensor, ...]
    slot_mappings: tuple[torch.Tensor, ...]
    positions: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_seq_len: int
    max_query_len: int
    num_tokens: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def block_table(self) -> torch.Tensor:
        return self.block_tables[0]

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.slot_mappings[0]

    @property
    def cu_seqlens_q(self) -> torch.Tensor:
        """FlashAttention's name for :attr:`query_start_loc`."""
        return self.query_start_loc


class _Group:
    """One attention group's host rows: ``rows[r]`` is the table of the sequence owning row ``r``, -1 padded."""

    __slots__ = ("block_size", "cleared", "copied", "last", "lengths", "local", "ratio", "rows")

    def __init__(self, block_size: int, ratio: int, local: Any, capacity: int, width: int) -> None:
        self.block_size = block_size
        self.ratio = ratio  # chain blocks per group block
        self.local = local  # the hybrid manager's local group state (tables, released), None for group 0
        self.rows: _Rows = np.full((capacity, width), PAD, dtype=np.int32)
        self.copied = [0] * capacity  # ids the row holds
        self.lengths = np.zeros(capacity, dtype=np.int64)  # the same, for the batch's widest table in one call
        self.last = [PAD] * capacity  # the last id copied: a changed tail shows there
        self.cleared: list[Any] = [()] * capacity  # the released positions rewritten as PAD (local groups)

    def grow_rows(self, capacity: int) -> None:
        rows = np.full((capacity, self.rows.shape[1]), PAD, dtype=np.int32)
        rows[: self.rows.shape[0]] = self.rows
        self.rows = rows
        lengths = np.zeros(capacity, dtype=np.int64)
        lengths[: self.lengths.shape[0]] = self.lengths
        self.lengths = lengths
        extra = capacity - len(self.copied)
        self.copied += [0] * extra
        self.last += [PAD] * extra
        self.cleared += [()] * extra

    def reset(self, row: int) -> None:
        self.rows[row, : self.copied[row]] = PAD
        self.copied[row] = 0
        self.cleared[row] = ()
        self.lengths[row] = 0
        self.last[row] = PAD

    def sync(self, row: int, table: list[int], released: Any) -> None:
        """Bring row ``row`` to ``table``: copy the appended ids, or rewrite it when its tail changed."""
        count = len(table)
        done = self.copied[row]
        rows = self.rows
        if count > rows.shape[1]:
            wider = np.full((rows.shape[0], max(count, 2 * rows.shape[1])), PAD, dtype=np.int32)
            wider[:, : rows.shape[1]] = rows
            self.rows = rows = wider
        if count > done and (done == 0 or table[done - 1] == self.last[row]):
            if count == done + 1:  # one id appended (a decoding sequence's new block): an item, not a slice
                rows[row, done] = table[done]
            else:
                rows[row, done:count] = table[done:count]
        elif count != done or (count and table[-1] != self.last[row]):
            rows[row, :count] = table
            rows[row, count:done] = PAD
            self.cleared[row] = released  # the table holds its own placeholders
        self.copied[row] = count
        self.lengths[row] = count
        self.last[row] = table[-1] if count else PAD
        if released != self.cleared[row]:  # the group's released positions (ranges), replaced when they grow
            for gone in released:
                rows[row, gone.start : gone.stop] = PAD
        self.cleared[row] = released


class _Staging:
    """Host buffers a step is assembled in (pinned on CUDA), grown on demand, and their numpy views."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.tensors: dict[str, torch.Tensor] = {}
        self.arrays: dict[str, npt.NDArray[Any]] = {}

    def get(self, name: str, size: int, dtype: torch.dtype) -> tuple[torch.Tensor, npt.NDArray[Any]]:
        tensor = self.tensors.get(name)
        if tensor is None or tensor.numel() < size:
            capacity = max(size, 64, 0 if tensor is None else 2 * tensor.numel())
            tensor = torch.empty(capacity, dtype=dtype, pin_memory=self.pin)
            self.tensors[name] = tensor
            self.arrays[name] = tensor.numpy()
        return tensor, self.arrays[name]


class StepMetadataBuilder:
    """Builds :class:`StepMetadata` for ``manager`` (a :class:`KVCacheManager` or a hybrid one) on ``device``.

    >>> from kvblocks import KVCacheManager
    >>> m = KVCacheManager(num_blocks=8, block_size=4)
    >>> m.add_sequence("a", list(range(6)))
    >>> _ = m.allocate("a", 6)
    >>> meta = StepMetadataBuilder(m).build(["a"], [6])
    >>> meta.block_table.tolist(), meta.slot_mapping.tolist(), meta.query_start_loc.tolist()
    ([[0, 1]], [0, 1, 2, 3, 4, 5], [0, 6])
    """

    _ROWS = 64  # rows (sequences) and table width to start with; both double when needed
    _WIDTH = 16

    def __init__(self, manager: KVCacheManager, device: str | torch.device = "cpu") -> None:
        if not isinstance(manager, KVCacheManager):
            raise InvalidArgumentError(f"manager must be a KVCacheManager, got {type(manager).__name__}")
        self._manager = manager
        self._device = torch.device(device)
        locals_ = list(getattr(manager, "_locals", ()))  # a hybrid manager's local groups (1, 2, ...)
        self._groups = (0, *range(1, 1 + len(locals_)))
        capacity, width = self._ROWS, self._WIDTH
        self._full = _Group(manager.block_size, 1, None, capacity, width)
        self._locals = [_Group(g.block_size, g.ratio, g, capacity, width) for g in locals_]
        self._all = [self._full, *self._locals]
        self._row_of: dict[Hashable, int] = {}
        self._owner: list[list[int] | None] = [None] * capacity  # row -> the table it mirrors
        self._free_rows = list(range(capacity - 1, -1, -1))
        self._staging = _Staging(pin=self._device.type == "cuda")
        self._copied: Any = None  # the CUDA event of the last build's copies: staging is reused after it

    @property
    def groups(self) -> tuple[int, ...]:
        """The manager groups the metadata covers, in the order of its tables: 0, then the local groups."""
        return self._groups

    @property
    def device(self) -> torch.device:
        return self._device

    def build(self, seq_ids: Sequence[Hashable], num_new_tokens: Sequence[int]) -> StepMetadata:
        """The tensors for one step: ``seq_ids[i]`` computes ``num_new_tokens[i]`` tokens after its committed line.

        Raises (changing nothing the caller sees) for an unknown or unadmitted sequence, a sequence named
        twice, or a query longer than the slots the manager allocated past the committed line.
        """
        count = len(seq_ids)
        if len(num_new_tokens) != count:
            raise InvalidArgumentError(f"num_new_tokens has {len(num_new_tokens)} entries for {count} sequences")
        rows, starts, queries = _collect_rows(self, seq_ids, num_new_tokens)
        if len(set(rows)) != count:
            raise InvalidArgumentError("a sequence appears twice in one step")
        if self._copied is not None:
            self._copied.synchronize()  # the staging buffers are free again
        return self._assemble(rows, starts, queries)

    # ------------------------------------------------------------------ per sequence (the hot loop: _collect_rows)

    def _refuse(self, seq_id: Hashable) -> None:
        self._manager._get(seq_id)  # raises the precise error for an unknown sequence
        raise SequenceStateError(f"sequence {seq_id!r} is not admitted: it has no block table to run on")

    def _assign(self, seq_id: Hashable, s: _Sequence, row: int | None) -> int:
        """A row for ``seq_id``'s current table (its old row, reset, when it was admitted again), filled."""
        if row is None:
            if not self._free_rows:
                self._reclaim()
            row = self._free_rows.pop()
            self._row_of[seq_id] = row
        for group in self._all:
            group.reset(row)
        self._owner[row] = s.table
        self._full.sync(row, s.table, ())  # type: ignore[arg-type]
        return row

    def _reclaim(self) -> None:
        """Free the rows of sequences that left (or whose table was replaced); grow when none did."""
        seqs = self._manager._seqs
        for seq_id, row in list(self._row_of.items()):
            s = seqs.get(seq_id)
            if s is None or s.table is not self._owner[row]:
                del self._row_of[seq_id]
                self._owner[row] = None
                self._free_rows.append(row)
        if not self._free_rows:
            capacity = len(self._owner)
            for group in self._all:
                group.grow_rows(2 * capacity)
            self._owner += [None] * capacity
            self._free_rows = list(range(2 * capacity - 1, capacity - 1, -1))

    # ------------------------------------------------------------------ the batch (vectorised)

    def _assemble(self, rows: list[int], starts: list[int], queries: list[int]) -> StepMetadata:
        count = len(rows)
        total = sum(queries)
        staging = self._staging
        row_index = np.array(rows, dtype=np.intp)
        start_arr = np.array(starts, dtype=np.int64)
        seq_lens_t, seq_lens = staging.get("seq_lens", count, torch.int32)
        query_t, query_loc = staging.get("query_start_loc", count + 1, torch.int32)
        positions_t, positions = staging.get("positions", total, torch.int64)
        query_arr = np.array(queries, dtype=np.int64)
        np.add(start_arr, query_arr, out=seq_lens[:count], casting="unsafe")
        query_loc[0] = 0
        np.cumsum(query_arr, out=query_loc[1 : count + 1], dtype=np.int32)
        if total == count:  # decode: one token each, at its start
            token_rows = row_index
            positions[:total] = start_arr
        else:
            owner = np.repeat(np.arange(count), query_arr)
            token_rows = row_index[owner]
            np.subtract(np.arange(total), np.repeat(query_loc[:count] - start_arr, query_arr), out=positions[:total])
        token_pos = positions[:total]
        tables = []
        slots = []
        for number, group in enumerate(self._all):
            width = int(group.lengths[row_index].max()) if count else 0
            table_t, table = staging.get(f"table{number}", count * width, torch.int32)
            np.take(
                group.rows[:, :width], row_index, axis=0, out=table[: count * width].reshape(count, width), mode="clip"
            )
            slot_t, slot = staging.get(f"slots{number}", total, torch.int64)
            size = group.block_size
            blocks = group.rows[token_rows, token_pos // size]
            np.multiply(blocks, size, out=slot[:total], dtype=np.int64)
            slot[:total] += token_pos % size
            tables.append(self._send(table_t[: count * width].view(count, width)))
            slots.append(self._send(slot_t[:total]))
        out = StepMetadata(
            groups=self._groups,
            block_tables=tuple(tables),
            slot_mappings=tuple(slots),
            positions=self._send(positions_t[:total]),
            seq_lens=self._send(seq_lens_t[:count]),
            query_start_loc=self._send(query_t[: count + 1]),
            max_seq_len=int(seq_lens[:count].max()) if count else 0,
            max_query_len=int(query_arr.max()) if total != count else min(count, 1),
            num_tokens=total,
        )
        if self._device.type == "cuda":
            self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._copied.record()
        return out

    def _send(self, host: torch.Tensor) -> torch.Tensor:
        """One host-to-device copy (none on the CPU: the staging buffer is returned, valid until the next build)."""
        if self._device.type == "cpu":
            return host
        return host.to(self._device, non_blocking=True)


def _collect_rows(
    builder: StepMetadataBuilder, seq_ids: Sequence[Hashable], num_new_tokens: Sequence[int]
) -> tuple[list[int], list[int], list[int]]:
    """Per sequence (the hot loop, typed in the compiled build: step_metadata.pxd): its row, brought up to date
    with its tables, its committed line and its query length."""
    seqs = builder._manager._seqs
    row_of = builder._row_of
    owner = builder._owner
    full = builder._full
    copied = full.copied
    last = full.last
    locals_ = [(g, g.local.tables, g.local.released, g.copied, g.last, g.cleared) for g in builder._locals]
    rows: list[int] = []
    starts: list[int] = []
    queries: list[int] = []
    for seq_id, query in zip(seq_ids, num_new_tokens, strict=True):
        s = seqs.get(seq_id)
        if s is None or s.table is None:
            builder._refuse(seq_id)
        table: list[int] = s.table  # type: ignore[union-attr,assignment]
        if type(query) is not int or query < 1:
            query = _query_length(seq_id, query)
        start = s.num_committed  # type: ignore[union-attr]
        if start + query > s.num_covered + s.lookahead:  # type: ignore[union-attr]
            raise InvalidArgumentError(
                f"sequence {seq_id!r}: {query} new tokens after the {start} computed need "
                f"{start + query} slots; the manager allocated {s.num_covered + s.lookahead}"  # type: ignore[union-attr]
            )
        row = row_of.get(seq_id)
        if row is None or owner[row] is not table:
            row = builder._assign(seq_id, s, row)  # type: ignore[arg-type]
        elif len(table) != copied[row] or table[-1] != last[row]:
            full.sync(row, table, ())
        if locals_:
            key = id(s)
            for group, tables, released, done, ends, cleared in locals_:
                local_table = tables[key]
                gone = released[key]
                if len(local_table) != done[row] or local_table[-1] != ends[row] or gone is not cleared[row]:
                    group.sync(row, local_table, gone)
        rows.append(row)
        starts.append(start)
        queries.append(query)
    return rows, starts, queries


def _query_length(seq_id: Hashable, query: object) -> int:
    if isinstance(query, bool) or not isinstance(query, (int, np.integer)):
        raise InvalidArgumentError(f"sequence {seq_id!r}: num_new_tokens must be an int, got {type(query).__name__}")
    if query < 1:
        raise InvalidArgumentError(f"sequence {seq_id!r}: num_new_tokens must be >= 1, got {query}")
    return int(query)
