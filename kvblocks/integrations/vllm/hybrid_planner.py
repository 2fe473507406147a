"""The connector's scheduler side for vLLM's hybrid memory allocator (HMA): several KV cache groups.

Each group has its own block table, its own storage index (:mod:`~kvblocks.integrations.vllm.groups`) and its
own rule for what a hit needs (:mod:`kvblocks.core.groups.hits`, the rules kvblocks' own hybrid manager uses).
A hit at token ``h`` is the largest one every group serves; a group serves it when the blocks it needs for ``h``
are in vLLM's local cache (below the local hit) or known stored::

    block size 32, sliding window 64, local hit 0, a 300-token prompt (at most 9 blocks loadable)
    block                 0   1   2   3   4   5   6   7   8
    full group stored     ✓   ✓   ✓   ✓   ✓   ✓   ✓   ✗   -     -> serves h <= 7 * 32
    window group stored   ✓   ✓   ✗   ✗   ✓   ✓   ✓   ✓   -     -> h = 7 * 32 needs blocks 5, 6 only: served
    hit: 224 tokens; the full group loads blocks 0..6, the window group blocks 5 and 6

Loads are asynchronous in vLLM's sense (``get_num_new_matched_tokens`` answers ``load_kv_async=True``): vLLM
reports load failures of hybrid models per request, never per block (its block ids are unique only within a
group), and a request waiting for its load runs no forward pass. So nothing reads a loaded block before its
load's outcome is known: a load that fails frees the request's blocks uncached and vLLM recomputes it from
the start, and no block computed over a failed load can exist to be saved. The planner never offers that
request a stored hit again, and forgets the hashes whose blocks did not arrive (the workers name them): the
sound blocks it loaded, a shared prefix among them, stay hits for the other requests.

Saves: every block a step fills, in every group, once (a later prompt may end its hit anywhere, and a window
needs the blocks before that end). A windowed group's block id is trusted only where the request certainly
holds it -- the blocks the step writes, or the whole table when vLLM handed it over this step -- because vLLM
frees blocks that left the window without telling the connector; a null block (id 0) is never saved.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import cast

from kvblocks.core.groups.hits import GroupHitRule, longest_common_hit, needed_blocks
from kvblocks.errors import ConfigError, InvalidArgumentError
from kvblocks.hashing import BlockHash
from kvblocks.integrations.vllm.planner import (
    BlockRun,
    Scheduled,
    StepPlan,
    StorageIndex,
    check_settings,
    load_range,
    match_range,
)

__all__ = ["NULL_BLOCK", "HybridPlanner"]

NULL_BLOCK = 0
"""vLLM's null block id: the placeholder in a windowed group's table for a block the window no longer holds."""


class _Tracked:
    """One request the planner follows, from its match to its end."""

    __slots__ = ("end", "hashes", "load_failed", "matched_from", "num_saved", "tables")

    def __init__(self, hashes: Sequence[BlockHash], groups: int) -> None:
        self.hashes = hashes  # the request's own list: it grows as tokens are generated
        self.tables: list[list[int]] = [[] for _ in range(groups)]
        self.num_saved = 0  # blocks [0, num_saved) are stored, being saved, or were skipped as stored
        self.matched_from: int | None = None  # the num_computed_tokens of the last answered match
        self.end = 0
        self.load_failed = False  # a load of it failed: it is never offered a stored hit again


class HybridPlanner:
    """The scheduler side's state for a deployment of several groups (see the module docstring). Not thread-safe.

    ``rules[g]`` and ``indexes[g]`` are group ``g``'s hit rule and storage index; every rule's block size is
    ``block_size`` (the size vLLM hashes blocks at).
    """

    def __init__(
        self,
        rules: Sequence[GroupHitRule],
        indexes: Sequence[StorageIndex],
        block_size: int,
        *,
        lookup_timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        recent_saves: int = 1 << 16,
    ) -> None:
        check_settings(block_size, lookup_timeout_s, recent_saves)
        if not rules or len(rules) != len(indexes):
            raise ConfigError(f"{len(rules)} group rules but {len(indexes)} storage indexes (one each, at least one)")
        for number, rule in enumerate(rules):
            if not isinstance(rule, GroupHitRule) or rule.block_size != block_size:
                raise ConfigError(f"group {number}: a GroupHitRule with blocks of {block_size} tokens, got {rule!r}")
        self.rules = tuple(rules)
        self.indexes = tuple(indexes)
        self.block_size = block_size
        self.lookup_timeout_s = float(lookup_timeout_s)
        self._clock = clock
        self._recent_saves = recent_saves
        self._windowed = tuple(rule.kind != "full" for rule in rules)
        self._requests: dict[Hashable, _Tracked] = {}
        self._probes: dict[Hashable, tuple[list[tuple[int, int]], float]] = {}  # request -> ([(group, id)], deadline)
        self._loads: list[BlockRun] = []
        self._failed: list[str] = []  # requests whose load vLLM awaits but none was planned
        self._planned: OrderedDict[tuple[int, BlockHash], None] = OrderedDict()
        self._step = 0
        self._undelivered: tuple[tuple[BlockRun, ...], tuple[str, ...]] = ((), ())

    def __len__(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ match

    def match(self, request_id: str, hashes: Sequence[BlockHash], num_tokens: int, num_computed: int) -> int | None:
        """Tokens past ``num_computed`` every group can load, or None: ask again (a probe is out)."""
        size = self.block_size
        first, limit = match_range(request_id, hashes, num_tokens, num_computed, size)
        tracked = self._requests.get(request_id)
        if tracked is None:
            tracked = self._requests[request_id] = _Tracked(hashes, len(self.rules))
        tracked.hashes = hashes
        if first >= limit or tracked.load_failed:
            return self._answer(request_id, tracked, num_computed, num_computed)
        hit = self._hit(hashes, first, limit)
        if hit < limit * size:
            pending = self._probes.get(request_id)
            if pending is None:
                probes = []
                for number, index in enumerate(self.indexes):
                    run = index.known_run(hashes, first, limit)
                    if first + run < limit and (probe := index.probe(hashes[first + run : limit])) is not None:
                        probes.append((number, probe))
                if probes:
                    self._probes[request_id] = (probes, self._clock() + self.lookup_timeout_s)
                    return None
            elif self._clock() < pending[1] and not all(self.indexes[g].is_answered(p) for g, p in pending[0]):
                return None
            else:
                hit = self._hit(hashes, first, limit)
        return self._answer(request_id, tracked, num_computed, hit)

    def _hit(self, hashes: Sequence[BlockHash], first: int, limit: int) -> int:
        """The largest hit (tokens) at or below ``limit`` blocks every group serves, blocks below ``first`` local."""

        def cached(index: StorageIndex) -> Callable[[int], bool]:
            is_known = index.is_known
            return lambda position: position < first or is_known(hashes[position])

        answers = [cached(index) for index in self.indexes]
        return longest_common_hit(self.rules, limit * self.block_size, answers, self.block_size)

    def _answer(self, request_id: Hashable, tracked: _Tracked, num_computed: int, hit: int) -> int:
        self._probes.pop(request_id, None)
        tracked.matched_from = num_computed
        return max(0, hit - num_computed)

    def allocated(self, request_id: str, tables: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        """vLLM allocated ``tables`` (the request's block table per group) with ``num_external_tokens`` to load:
        each group's load is the blocks its rule needs for the hit, past the local hit."""
        tracked = self._requests.get(request_id)
        if num_external_tokens == 0 or tracked is None:
            return
        loaded = load_range(request_id, tracked.matched_from, num_external_tokens, self.block_size)
        if len(tables) != len(self.rules):
            raise InvalidArgumentError(
                f"request {request_id!r}: {len(tables)} block tables for {len(self.rules)} groups"
            )
        hit = loaded.stop * self.block_size
        first, stop = loaded.start, loaded.stop
        if stop > len(tracked.hashes):
            raise InvalidArgumentError(
                f"request {request_id!r}: blocks up to {stop - 1} to load, {len(tracked.hashes)} hashed"
            )
        runs = []
        for number, (rule, table) in enumerate(zip(self.rules, tables, strict=True)):
            needed = needed_blocks(rule, hit)
            positions = range(max(first, needed.start), min(stop, needed.stop))
            if positions.stop > len(table):
                raise InvalidArgumentError(
                    f"request {request_id!r}: group {number} needs blocks up to {positions.stop - 1}, "
                    f"{len(table)} allocated"
                )
            ids = tuple(int(table[p]) for p in positions)
            if NULL_BLOCK in ids:
                raise InvalidArgumentError(f"request {request_id!r}: group {number} has a null block where a load goes")
            if ids:
                runs.append(BlockRun(request_id, tuple(tracked.hashes[p] for p in positions), ids, group=number))
        tracked.tables = [list(table) for table in tables]
        if not runs:  # nothing to move (vLLM still waits for the outcome)
            runs = [BlockRun(request_id, (), ())]
        self._loads.extend(runs)
        tracked.num_saved = max(tracked.num_saved, stop)  # loaded blocks are stored already

    def fail(self, request_id: str) -> None:
        """vLLM waits for a load of ``request_id`` that was never planned (a plan that went wrong): the worker
        reports it failed, so vLLM recomputes the request."""
        self._failed.append(request_id)
        tracked = self._requests.get(request_id)
        if tracked is not None:
            tracked.load_failed = True

    # ------------------------------------------------------------------ steps

    def plan_step(self, scheduled: Sequence[Scheduled], preempted: Iterable[str] = ()) -> StepPlan:
        """The plan of the step vLLM just scheduled: the loads allocated since the last plan, and the saves of
        the blocks its forward pass fills, per group (``Scheduled.block_ids`` / ``new_block_ids`` hold one
        sequence of ids per group)."""
        for request_id in preempted:
            self.preempted(request_id)
        self._step += 1
        loads, self._loads = tuple(self._loads), []
        failed, self._failed = tuple(self._failed), []
        self._undelivered = (loads, failed)
        saves: list[BlockRun] = []
        size = self.block_size
        for request in scheduled:
            tracked = self._requests.get(request.request_id)
            if tracked is None:
                continue  # never matched: nothing of it is saved
            entered = request.block_ids is not None
            if entered:
                tracked.tables = [list(table) for table in cast(Sequence[Sequence[int]], request.block_ids)]
            elif request.new_block_ids:
                for table, fresh in zip(
                    tracked.tables, cast(Sequence[Sequence[int]], request.new_block_ids), strict=True
                ):
                    table.extend(fresh)
            end = tracked.end = request.num_computed + request.num_new
            full = min((end - request.num_drafts) // size, len(tracked.hashes), *map(len, tracked.tables))
            if full > tracked.num_saved:
                saves.extend(self._saves(request, tracked, full, entered))
        self._undelivered = ((), ())
        return StepPlan(loads, tuple(saves), step=self._step, oldest_pending=self._step + 1, failed_requests=failed)

    def _saves(self, request: Scheduled, tracked: _Tracked, full: int, entered: bool) -> list[BlockRun]:
        """Each group's blocks of ``request`` to save after this step (up to ``full``)."""
        planned = self._planned
        written = request.num_computed // self.block_size
        runs = []
        for number, (index, table) in enumerate(zip(self.indexes, tracked.tables, strict=True)):
            start = tracked.num_saved
            if self._windowed[number] and not entered:
                start = max(start, written)  # below, vLLM may have freed the block
            picked = [
                (h, b)
                for p in range(start, full)
                if (b := table[p]) != NULL_BLOCK
                and (number, h := tracked.hashes[p]) not in planned
                and not index.is_known(h)
            ]
            if picked:
                for h, _ in picked:
                    planned[(number, h)] = None
                runs.append(
                    BlockRun(request.request_id, tuple(h for h, _ in picked), tuple(b for _, b in picked), group=number)
                )
        while len(planned) > self._recent_saves:
            planned.popitem(last=False)
        tracked.num_saved = full
        return runs

    def salvage(self) -> StepPlan:
        """The plan to send when :meth:`plan_step` raised: the step's loads and failures, no saves (vLLM awaits
        every planned load's outcome, so none may be lost)."""
        loads, failed = self._undelivered
        self._undelivered = ((), ())
        if not loads and not failed:
            loads, self._loads = tuple(self._loads), []
            failed, self._failed = tuple(self._failed), []
        self._step += 1
        return StepPlan(loads, (), step=self._step, oldest_pending=self._step + 1, failed_requests=failed)

    # ------------------------------------------------------------------ outcomes

    def loads_done(self, failed: Iterable[str], lost: Iterable[tuple[int, BlockHash]] = ()) -> None:
        """The outcome of finished loads: the requests in ``failed`` (vLLM's ``failed_recving``) did not arrive
        sound, and start over without a stored hit; ``lost`` (the workers' report) are the (group, hash) whose
        blocks did not arrive: they leave their group's index (a later probe may learn them again)."""
        by_group: dict[int, list[BlockHash]] = {}
        for group, h in lost:
            self._planned.pop((group, h), None)
            by_group.setdefault(group, []).append(h)
        for group, hashes in by_group.items():
            if 0 <= group < len(self.indexes):
                self.indexes[group].forget(hashes)
        for request_id in failed:
            tracked = self._requests.get(request_id)
            if tracked is None:
                continue
            tracked.load_failed = True
            tracked.tables = [[] for _ in self.rules]
            tracked.num_saved = 0
            tracked.end = 0

    def preempted(self, request_id: str) -> None:
        """vLLM took the request's blocks back: its tables are gone (what it saved stays saved)."""
        tracked = self._requests.get(request_id)
        if tracked is not None:
            tracked.tables = [[] for _ in self.rules]
            tracked.end = 0
        self._probes.pop(request_id, None)

    def finished(self, request_id: str) -> None:
        """The request ended (finished or aborted): forget it."""
        self._requests.pop(request_id, None)
        self._probes.pop(request_id, None)
        self._loads = [run for run in self._loads if run.request_id != request_id]  # its blocks are freed
