"""Moving blocks within and between caches: batched, never one small copy per block per layer.

Every operation works on a cache's byte ``rows`` viewed as machine words:

* ids that form long contiguous runs are moved as slices, one copy per run per row tensor;
* scattered ids are moved with one ``index_select`` / ``index_copy_`` per row tensor -- one
  for the whole cache when it is block-major, one per layer tensor when it is layer-major.

A payload is a ``[k, bytes_per_block]`` uint8 tensor: block ``i``'s bytes in row ``i``, in the
plane order of :meth:`KVCacheSpec.planes` -- what storage writes and networks send.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from kvblocks.backends._torch import torch
from kvblocks.backends.cache import KVCache, payload_words
from kvblocks.errors import ConfigError, InvalidBlockIdError

__all__ = [
    "BlockIds",
    "block_ids",
    "contiguous_runs",
    "copy_between",
    "copy_pairs_batched",
    "copy_staged",
    "copy_within",
    "gather_into",
    "paired_runs",
    "scatter_from",
    "zero_blocks",
]

BlockIds = Sequence[int] | torch.Tensor

_INT_TYPE = {int}
_MIN_AVERAGE_RUN = 4  # slice copies win over one indexed copy once runs average this many blocks


class _Ids:
    """Validated block ids: as a Python list (for runs) and as an index tensor on the cache's device."""

    __slots__ = ("_device", "_runs", "_tensor", "values")

    def __init__(self, values: list[int], device: torch.device) -> None:
        self.values = values
        self._device = device
        self._runs: list[tuple[int, int, int]] | None = None
        self._tensor: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.values)

    def part(self, start: int, stop: int) -> _Ids:
        """The ids at positions ``start:stop`` (sharing the index tensor, if one was built)."""
        piece = _Ids(self.values[start:stop], self._device)
        if self._tensor is not None:
            piece._tensor = self._tensor[start:stop]
        return piece

    @property
    def runs(self) -> list[tuple[int, int, int]]:
        if self._runs is None:
            self._runs = contiguous_runs(self.values)
        return self._runs

    @property
    def sliced(self) -> bool:
        """Whether moving these ids run by run beats one indexed copy."""
        return _few_runs(self.values, range(len(self.values)))

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            # array -> frombuffer is a C loop and no copy: 3x faster than torch.tensor(list) for 1k ids
            index = torch.frombuffer(array("q", self.values), dtype=torch.long) if self.values else torch.empty(0)
            self._tensor = index.to(device=self._device, dtype=torch.long)
        return self._tensor


def block_ids(cache: KVCache, ids: BlockIds, *, what: str = "block ids", distinct: bool = False) -> _Ids:
    """Check ``ids`` against ``cache`` (ints in range; no repeats when ``distinct``) before anything moves."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise InvalidBlockIdError(
                f"{what} must be a 1-D integer tensor, got {ids.dtype} of shape {tuple(ids.shape)}"
            )
        values = [int(v) for v in ids.tolist()]
    else:
        values = list(ids)
        if not set(map(type, values)) <= _INT_TYPE:  # one C-level pass; the loop below only names the culprit
            for v in values:
                if isinstance(v, bool) or not isinstance(v, int):
                    raise InvalidBlockIdError(f"{what} must be ints, got {v!r}")
    if values and (min(values) < 0 or max(values) >= cache.num_blocks):
        bad = next(v for v in values if not 0 <= v < cache.num_blocks)
        raise InvalidBlockIdError(f"{what}: block {bad} is not in 0..{cache.num_blocks - 1}")
    if distinct and len(set(values)) != len(values):
        raise InvalidBlockIdError(f"{what} repeat a block: the result would depend on copy order")
    return _Ids(values, cache.device)


def contiguous_runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first id, position in ids, length)`` of each run of consecutive ids.

    >>> contiguous_runs([4, 5, 6, 9, 2, 3])
    [(4, 0, 3), (9, 3, 1), (2, 4, 2)]
    """
    return paired_runs(ids, range(len(ids)))  # positions always count up: only the ids can break a run


def _few_runs(src: Sequence[int], dst: Sequence[int]) -> bool:
    """Whether the id pairs form runs averaging at least ``_MIN_AVERAGE_RUN`` (stops counting early)."""
    allowed = len(src) // _MIN_AVERAGE_RUN
    breaks = 0
    for i in range(1, len(src)):
        if src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            breaks += 1
            if breaks >= allowed:
                return False
    return len(src) > 0 and breaks + 1 <= allowed


def paired_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src first, dst first, length)`` of each stretch where both id lists count up by one.

    >>> paired_runs([4, 5, 6, 9], [0, 1, 2, 3])
    [(4, 0, 3), (9, 3, 1)]
    """
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(src) + 1):
        if i == len(src) or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs.append((src[start], dst[start], i - start))
            start = i
    return runs


def copy_between(
    src: KVCache, dst: KVCache, source: _Ids, target: _Ids, *, non_blocking: bool = False, any_runs: bool = False
) -> bool:
    """Copy run by run straight from ``src`` rows into ``dst`` rows, when that beats a staged payload.

    It does when both caches share an arrangement (so their row tensors match) and the ids
    pair up into long runs -- or into any runs at all with ``any_runs``, for callers whose
    per-copy cost is small next to a block (a DMA engine moving large blocks). Returns
    False, having copied nothing, otherwise.
    """
    if src.spec.block_major != dst.spec.block_major:
        return False
    if not any_runs and not _few_runs(source.values, target.values):
        return False
    runs = paired_runs(source.values, target.values)
    for src_rows, dst_rows in zip(src.rows, dst.rows):
        for s, d, n in runs:
            dst_rows[d : d + n].copy_(src_rows[s : s + n], non_blocking=non_blocking)
    return True


def copy_pairs_batched(src: KVCache, dst: KVCache, source: _Ids, target: _Ids) -> bool:
    """Copy ``source[i]`` -> ``target[i]`` block by block in one multi-tensor launch per row tensor.

    ``torch._foreach_copy_`` runs all the block copies of a list in a single kernel on
    accelerators: one pass over the bytes, no staging, no launch per block. Needs one
    arrangement on both sides and disjoint sets; returns False, having copied nothing, otherwise.
    """
    if src.spec.block_major != dst.spec.block_major:
        return False
    for src_rows, dst_rows in zip(src.rows, dst.rows):
        torch._foreach_copy_([dst_rows[d] for d in target.values], [src_rows[s] for s in source.values])
    return True


def check_payload(cache: KVCache, data: torch.Tensor, count: int) -> None:
    expected = (count, cache.spec.bytes_per_block)
    if data.dtype != torch.uint8 or tuple(data.shape) != expected:
        raise ConfigError(f"payload must be a uint8 tensor of shape {expected}, got {data.dtype} {tuple(data.shape)}")
    if data.stride(-1) != 1 or data.stride(0) != cache.spec.bytes_per_block:
        raise ConfigError("payload must be contiguous")
    if data.device == cache.device and data.numel():
        start, end = data.data_ptr(), data.data_ptr() + data.numel()
        own = cache.storage.data_ptr()
        if start < own + cache.nbytes and own < end:  # copies would read bytes they already overwrote
            raise ConfigError("payload overlaps the cache's own memory: copy it out first (or use copy_blocks)")


def gather_into(cache: KVCache, ids: _Ids, out: torch.Tensor) -> None:
    """Copy blocks ``ids`` of ``cache`` into payload ``out`` (same device), row ``i`` <- block ``ids[i]``."""
    for r, rows in enumerate(cache.rows):
        dst = payload_words(cache, out, r)
        if ids.sliced:
            for first, at, length in ids.runs:
                dst[at : at + length].copy_(rows[first : first + length])
        else:
            torch.index_select(rows, 0, ids.tensor, out=dst)


def scatter_from(cache: KVCache, ids: _Ids, data: torch.Tensor) -> None:
    """Copy payload ``data`` (same device) into blocks ``ids`` of ``cache``, block ``ids[i]`` <- row ``i``."""
    for r, rows in enumerate(cache.rows):
        src = payload_words(cache, data, r)
        if ids.sliced:
            for first, at, length in ids.runs:
                rows[first : first + length].copy_(src[at : at + length])
        else:
            rows.index_copy_(0, ids.tensor, src)


def copy_within(cache: KVCache, src: _Ids, dst: _Ids) -> None:
    """Copy blocks ``src[i]`` -> ``dst[i]`` inside one cache; overlapping sets are read before written."""
    staging = torch.empty((len(src), cache.spec.bytes_per_block), dtype=torch.uint8, device=cache.device)
    gather_into(cache, src, staging)
    scatter_from(cache, dst, staging)


def copy_staged(src: KVCache, dst: KVCache, source: _Ids, target: _Ids, scratch: torch.Tensor) -> bool:
    """Copy ``source[i]`` -> ``target[i]`` row tensor by row tensor through ``scratch`` (uint8), a chunk at a time.

    Each chunk is read with one ``index_select`` into the scratch and written with one
    ``index_copy_``; with a scratch of a few MiB the second pass reads from the CPU's cache,
    so both passes cost about one pass over memory. Needs both caches in one arrangement
    (returns False, having copied nothing, otherwise) and disjoint source and target blocks:
    a later chunk must not read a block an earlier chunk already overwrote.
    """
    if src.spec.block_major != dst.spec.block_major:
        return False
    for src_rows, dst_rows in zip(src.rows, dst.rows):
        words = src_rows.shape[1]
        per = max(1, scratch.numel() // (words * src_rows.element_size()))
        buffer = scratch[: per * words * src_rows.element_size()].view(src_rows.dtype).view(per, words)
        for start in range(0, len(source), per):
            stop = min(start + per, len(source))
            chunk = buffer[: stop - start]
            torch.index_select(src_rows, 0, source.part(start, stop).tensor, out=chunk)
            dst_rows.index_copy_(0, target.part(start, stop).tensor, chunk)
    return True


def zero_blocks(cache: KVCache, ids: _Ids) -> None:
    """Fill blocks ``ids`` with zero bytes (every layer, K, V and scales)."""
    for rows in cache.rows:
        if ids.sliced:
            for first, _, length in ids.runs:
                rows[first : first + length].zero_()
        else:
            rows.index_fill_(0, ids.tensor, 0)
