"""The connector's scheduler side, without vLLM: which blocks a request may load, and which to save.

vLLM's scheduler asks a connector three things per request, and this module answers them from plain
values (hashes, token counts, block ids), so every rule is tested without an engine:

* **match** (``get_num_new_matched_tokens``): how many tokens past the local prefix hit are stored.
  Only the storage index is read (no I/O on the scheduler's thread). When the index does not know a
  block, a probe asks the store off-thread and the answer is "ask again" (``None``) until it lands or
  its deadline passes; then the leading run of whole blocks the index knows is the answer::

      block      0    1    2    3    4    5        (block_size 4, a 22-token prompt)
      local hit  ████                               num_computed = 4
      stored          ✓    ✓    ✗    ✓              -> 2 blocks, 8 tokens (block 4 is past a miss)
      limit                          │               the last token is always computed, so at most
                                                     (22 - 1) // 4 = 5 blocks can ever be loaded

* **allocated** (``update_state_after_alloc``): the blocks vLLM gave for the matched tokens become a load.
  A load the workers report failed (``update_connector_output``'s invalid block ids, :meth:`load_failed`)
  makes the index forget those hashes -- the store does not hold them usable -- and the blocks vLLM
  recomputes in their place are saved again.
* **step** (``build_connector_meta``): each scheduled request's blocks that this step's forward pass
  fills are saved -- only whole blocks whose tokens are all real (drafts excluded), each once, and
  never one the index already knows is stored (a loaded block, one saved before) or one planned for
  saving lately (requests sharing a prefix fill the same blocks in the same step).

What crosses to the workers is a :class:`StepPlan`: runs of (hash, block id) to load before the
forward pass and to save after it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvblocks.errors import ConfigError, InvalidArgumentError
from kvblocks.hashing import BlockHash

__all__ = ["BlockRun", "StepPlan", "StorageIndex", "TransferPlanner"]


class StorageIndex(Protocol):
    """What the planner reads: :class:`kvblocks.tiers.storage_tier.StorageTier` has these."""

    def known_run(self, hashes: Sequence[BlockHash], start: int, stop: int) -> int: ...

    def is_known(self, block_hash: BlockHash) -> bool: ...

    def probe(self, hashes: Sequence[BlockHash]) -> int | None: ...

    def is_answered(self, request_id: int) -> bool: ...

    def forget(self, hashes: Sequence[BlockHash]) -> None: ...


@dataclass(frozen=True)
class BlockRun:
    """Blocks of one request to move: ``hashes[i]`` is the content of vLLM block ``block_ids[i]``."""

    request_id: str
    hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class StepPlan:
    """One step's transfers: loads before the forward pass, saves after it; ``failed`` are block ids vLLM
    expects loaded that no load will fill (the worker reports them as load errors, so vLLM recomputes)."""

    loads: tuple[BlockRun, ...] = ()
    saves: tuple[BlockRun, ...] = ()
    failed: tuple[int, ...] = ()


class _Tracked:
    """One request the planner follows, from its match to its end."""

    __slots__ = ("block_ids", "hashes", "matched_from", "num_saved")

    def __init__(self, hashes: Sequence[BlockHash]) -> None:
        self.hashes = hashes  # the request's own list: it grows as tokens are generated
        self.block_ids: list[int] = []
        self.num_saved = 0  # blocks [0, num_saved) are stored, being saved, or were skipped as stored
        self.matched_from: int | None = None  # the num_computed_tokens of the last answered match


class TransferPlanner:
    """The scheduler side's state (see the module docstring). Not thread-safe: the scheduler's thread only."""

    def __init__(
        self,
        index: StorageIndex,
        block_size: int,
        *,
        lookup_timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        recent_saves: int = 1 << 16,
    ) -> None:
        """``recent_saves``: how many planned saves are remembered to plan none of them twice (the oldest are
        forgotten first; the index knows a save only once it has landed)."""
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block_size must be an int >= 1, got {block_size!r}")
        if isinstance(lookup_timeout_s, bool) or not isinstance(lookup_timeout_s, int | float) or lookup_timeout_s < 0:
            raise ConfigError(f"lookup_timeout_s must be a number >= 0, got {lookup_timeout_s!r}")
        self.index = index
        self.block_size = block_size
        self.lookup_timeout_s = float(lookup_timeout_s)
        self._clock = clock
        self._requests: dict[Hashable, _Tracked] = {}
        self._probes: dict[Hashable, tuple[int, float]] = {}  # request -> (probe id, deadline)
        self._loads: list[BlockRun] = []
        self._failed: list[int] = []
        self._planned: OrderedDict[BlockHash, None] = OrderedDict()  # hashes lately planned for saving
        self._loading: dict[int, tuple[Hashable, int]] = {}  # block id -> (request, position) of its last load
        if isinstance(recent_saves, bool) or not isinstance(recent_saves, int) or recent_saves < 0:
            raise ConfigError(f"recent_saves must be an int >= 0, got {recent_saves!r}")
        self._recent_saves = recent_saves

    def __len__(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ match

    def match(self, request_id: str, hashes: Sequence[BlockHash], num_tokens: int, num_computed: int) -> int | None:
        """Tokens past ``num_computed`` that can be loaded, or None: ask again (a probe is out).

        ``hashes`` are the request's chained block hashes (the planner keeps the list: vLLM extends it
        as tokens are generated); ``num_tokens`` the tokens it holds; ``num_computed`` its local hit.
        """
        size = self.block_size
        if num_computed % size or num_computed < 0 or num_tokens < 0:
            raise InvalidArgumentError(
                f"request {request_id!r}: {num_computed} computed of {num_tokens} tokens is not whole blocks"
            )
        first = num_computed // size
        limit = min(len(hashes), max(0, num_tokens - 1) // size)
        tracked = self._requests.get(request_id)
        if tracked is None:
            tracked = self._requests[request_id] = _Tracked(hashes)
        tracked.hashes = hashes
        if first >= limit:
            return self._answer(request_id, tracked, num_computed, 0)
        index = self.index
        run = index.known_run(hashes, first, limit)
        if first + run < limit:
            pending = self._probes.get(request_id)
            if pending is None:
                probe = index.probe(hashes[first + run : limit])
                if probe is not None:
                    self._probes[request_id] = (probe, self._clock() + self.lookup_timeout_s)
                    return None
            elif not index.is_answered(pending[0]) and self._clock() < pending[1]:
                return None
            else:
                run = index.known_run(hashes, first, limit)
        return self._answer(request_id, tracked, num_computed, run)

    def _answer(self, request_id: Hashable, tracked: _Tracked, num_computed: int, run: int) -> int:
        self._probes.pop(request_id, None)
        tracked.matched_from = num_computed
        return run * self.block_size

    def allocated(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (the request's whole table) with ``num_external_tokens`` to load."""
        tracked = self._requests.get(request_id)
        if num_external_tokens == 0 or tracked is None:
            return
        size = self.block_size
        start = tracked.matched_from
        if start is None or num_external_tokens % size or num_external_tokens < 0:
            raise InvalidArgumentError(
                f"request {request_id!r}: {num_external_tokens} external tokens were never matched in whole blocks"
            )
        first, stop = start // size, (start + num_external_tokens) // size
        if stop > len(block_ids) or stop > len(tracked.hashes):
            raise InvalidArgumentError(
                f"request {request_id!r}: blocks {first}..{stop - 1} to load, but {len(block_ids)} allocated"
            )
        run = BlockRun(request_id, tuple(tracked.hashes[first:stop]), tuple(int(b) for b in block_ids[first:stop]))
        self._loads.append(run)
        for position, block in enumerate(run.block_ids, first):
            self._loading[block] = (request_id, position)
        tracked.num_saved = max(tracked.num_saved, stop)  # loaded blocks are stored already

    # ------------------------------------------------------------------ steps

    def scheduled(
        self,
        request_id: str,
        num_computed: int,
        num_new_tokens: int,
        *,
        block_ids: Sequence[int] | None = None,
        new_block_ids: Sequence[int] = (),
        hashes: Sequence[BlockHash] | None = None,
    ) -> BlockRun | None:
        """The request runs ``num_new_tokens`` real tokens (drafts left out) after ``num_computed`` this
        step; return the blocks to save after it. ``block_ids`` replaces its table (a new or resumed
        request), ``new_block_ids`` extends it; ``hashes`` introduces a request the planner never matched."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            if hashes is None:
                return None
            tracked = self._requests[request_id] = _Tracked(hashes)
        if block_ids is not None:
            tracked.block_ids = [int(b) for b in block_ids]
        tracked.block_ids.extend(int(b) for b in new_block_ids)
        full = min(len(tracked.hashes), (num_computed + num_new_tokens) // self.block_size, len(tracked.block_ids))
        start = tracked.num_saved
        if full <= start:
            return None
        tracked.num_saved = full
        is_known = self.index.is_known
        planned = self._planned
        picked = [
            (h, tracked.block_ids[i])
            for i, h in enumerate(tracked.hashes[start:full], start)
            if h not in planned and not is_known(h)
        ]
        if not picked:
            return None
        for h, _ in picked:
            planned[h] = None
        while len(planned) > self._recent_saves:
            planned.popitem(last=False)
        return BlockRun(request_id, tuple(h for h, _ in picked), tuple(b for _, b in picked))

    def load_failed(self, block_ids: Iterable[int]) -> int:
        """The workers could not load ``block_ids`` (vLLM recomputes them): the index forgets their hashes and
        each request saves its recomputed blocks again from the first that failed. Returns how many of the
        ids were loads of this planner's."""
        forgotten: list[BlockHash] = []
        for block in block_ids:
            entry = self._loading.pop(block, None)
            if entry is None:
                continue
            request_id, position = entry
            tracked = self._requests.get(request_id)
            if tracked is None or position >= len(tracked.hashes):
                continue
            forgotten.append(tracked.hashes[position])
            tracked.num_saved = min(tracked.num_saved, position)
        for h in forgotten:
            self._planned.pop(h, None)
        if forgotten:
            self.index.forget(forgotten)
        return len(forgotten)

    def fail(self, block_ids: Sequence[int]) -> None:
        """vLLM expects ``block_ids`` loaded but no load was planned (a plan that went wrong): they are
        reported as load errors, so vLLM recomputes them rather than reading whatever they hold."""
        self._failed.extend(int(b) for b in block_ids)

    def take_loads(self) -> tuple[tuple[BlockRun, ...], tuple[int, ...]]:
        """The loads planned since the last call (they run before this step's forward pass), and the
        block ids to report as failed loads (:meth:`fail`)."""
        loads, self._loads = tuple(self._loads), []
        failed, self._failed = tuple(self._failed), []
        return loads, failed

    def preempted(self, request_id: str) -> None:
        """vLLM took the request's blocks back: its table is gone (what it saved stays saved)."""
        tracked = self._requests.get(request_id)
        if tracked is not None:
            tracked.block_ids = []
        self._probes.pop(request_id, None)

    def finished(self, request_id: str) -> None:
        """The request ended (finished or aborted): forget it."""
        self._requests.pop(request_id, None)
        self._probes.pop(request_id, None)
        self._loads = [run for run in self._loads if run.request_id != request_id]
