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
* **step** (``build_connector_meta``, :meth:`TransferPlanner.plan_step`): the step's loads, and each
  scheduled request's blocks that this step's forward pass fills, to save -- only whole blocks whose
  tokens are all real (drafts excluded), each once, never one the index already knows is stored (a
  loaded block, one saved before) or one planned for saving lately (requests sharing a prefix fill the
  same blocks in the same step), and never one whose context holds a failed load
  (:mod:`~kvblocks.integrations.vllm.provenance`): a save that depends on loads whose outcome is not
  known yet carries them as its guard, and the worker drops it if one failed.
* **outcome** (``update_connector_output``, :meth:`TransferPlanner.confirm`): the worker reports which
  loads failed and which saves it dropped. Failed hashes leave the index (the store does not hold them
  usable), the blocks computed over them are bad until vLLM recomputes them, and the recomputed blocks
  are saved then.

What crosses to the workers is a :class:`StepPlan`: runs of (hash, block id) to load before the
forward pass and to save after it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvblocks.errors import ConfigError, InvalidArgumentError
from kvblocks.hashing import BlockHash
from kvblocks.integrations.vllm.provenance import BAD, BlockProvenance, Root, merge_roots

__all__ = [
    "BlockRun",
    "Scheduled",
    "StepPlan",
    "StorageIndex",
    "TransferPlanner",
    "check_settings",
    "load_range",
    "match_range",
]

EXPIRE_STEPS = 64
"""Steps a load's outcome may stay unreported before the planner takes it for failed (a lost report must
cost misses, never wrong KV)."""


class StorageIndex(Protocol):
    """What the planner reads: :class:`kvblocks.tiers.storage_tier.StorageTier` has these."""

    def known_run(self, hashes: Sequence[BlockHash], start: int, stop: int) -> int: ...

    def is_known(self, block_hash: BlockHash) -> bool: ...

    def probe(self, hashes: Sequence[BlockHash]) -> int | None: ...

    def is_answered(self, request_id: int) -> bool: ...

    def forget(self, hashes: Sequence[BlockHash]) -> None: ...


@dataclass(frozen=True)
class BlockRun:
    """Blocks of one request to move: ``hashes[i]`` is the content of vLLM block ``block_ids[i]``.

    A save's ``guards[i]`` (when given) are the loads block ``i``'s context depends on whose outcome the
    scheduler did not know when it planned the save; the worker saves block ``i`` only if none failed.
    ``group`` is the KV cache group whose blocks (and storage) the run moves (vLLM's hybrid allocator).
    """

    request_id: str
    hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]
    guards: tuple[frozenset[Root], ...] = ()
    group: int = 0


@dataclass(frozen=True)
class StepPlan:
    """One step's transfers: loads before the forward pass, saves after it; ``failed`` are block ids vLLM
    expects loaded that no load will fill (the worker reports them as load errors, so vLLM recomputes).

    ``step`` numbers the plan (loads are named by it, see :data:`~kvblocks.integrations.vllm.provenance.Root`);
    the worker may forget the outcomes of steps before ``oldest_pending``: no guard names them any more.
    ``failed_requests`` (hybrid models, whose loads vLLM tracks per request) are requests awaiting a load that
    none will run: the worker reports them failed.
    """

    loads: tuple[BlockRun, ...] = ()
    saves: tuple[BlockRun, ...] = ()
    failed: tuple[int, ...] = ()
    step: int = 0
    oldest_pending: int = 0
    failed_requests: tuple[str, ...] = ()


class Scheduled(NamedTuple):
    """One request in a step, as vLLM's scheduler output has it (plain values; a tuple: one is made per running
    request per step)."""

    request_id: str
    num_computed: int
    """Tokens whose KV exists before this step (local and external hits included)."""
    num_new: int
    """Tokens this step's forward pass computes, speculative drafts included."""
    num_drafts: int = 0
    """Of ``num_new``, the drafts: their KV is written, but they may be rejected, so never saved."""
    block_ids: Sequence[int] | None = None
    """The request's whole block table, for a new or resumed request (else None)."""
    new_block_ids: Sequence[int] = ()
    """Blocks appended to a running request's table this step."""


def check_settings(block_size: int, lookup_timeout_s: float, recent_saves: int) -> None:
    """A planner's settings, each checked (:class:`ConfigError`); shared by every scheduler-side planner."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block_size must be an int >= 1, got {block_size!r}")
    if isinstance(lookup_timeout_s, bool) or not isinstance(lookup_timeout_s, int | float) or lookup_timeout_s < 0:
        raise ConfigError(f"lookup_timeout_s must be a number >= 0, got {lookup_timeout_s!r}")
    if isinstance(recent_saves, bool) or not isinstance(recent_saves, int) or recent_saves < 0:
        raise ConfigError(f"recent_saves must be an int >= 0, got {recent_saves!r}")


def match_range(
    request_id: Hashable, hashes: Sequence[BlockHash], num_tokens: int, num_computed: int, block_size: int
) -> tuple[int, int]:
    """The blocks a match may offer, ``[first, limit)``: past the local hit, and never the block holding the
    prompt's last token (see the module docstring). Refuses a local hit that is not whole blocks."""
    if num_computed % block_size or num_computed < 0 or num_tokens < 0:
        raise InvalidArgumentError(
            f"request {request_id!r}: {num_computed} computed of {num_tokens} tokens is not whole blocks"
        )
    return num_computed // block_size, min(len(hashes), max(0, num_tokens - 1) // block_size)


def load_range(request_id: Hashable, matched_from: int | None, num_external_tokens: int, block_size: int) -> range:
    """The blocks vLLM allocated ``num_external_tokens`` for, after a match answered from ``matched_from``
    tokens; refuses tokens that were never matched, or not in whole blocks."""
    if matched_from is None or num_external_tokens % block_size or num_external_tokens < 0:
        raise InvalidArgumentError(
            f"request {request_id!r}: {num_external_tokens} external tokens were never matched in whole blocks"
        )
    return range(matched_from // block_size, (matched_from + num_external_tokens) // block_size)


class _Tracked:
    """One request the planner follows, from its match to its end."""

    __slots__ = ("block_ids", "clean_at", "context", "end", "hashes", "matched_from", "num_saved")

    def __init__(self, hashes: Sequence[BlockHash]) -> None:
        self.hashes = hashes  # the request's own list: it grows as tokens are generated
        self.block_ids: list[int] = []
        self.num_saved = 0  # blocks [0, num_saved) are stored, being saved, or were skipped as stored
        self.matched_from: int | None = None  # the num_computed_tokens of the last answered match
        self.end = 0  # tokens computed once the last scheduled step ran
        self.context: _Context | None = None  # the provenance of its table's leading blocks, as last scanned
        self.clean_at = -1  # the provenance epoch at which its context was last found clean (-1: not clean)


class _Context:
    """The provenance of a request's leading blocks ``[0, stop)`` as scanned at provenance epoch ``epoch``:
    ``marks`` are (position, roots) of its blocks that are not clean, in position order."""

    __slots__ = ("epoch", "marks", "roots", "stop")

    def __init__(self, epoch: int, stop: int, marks: list[tuple[int, frozenset[Root]]]) -> None:
        self.epoch = epoch
        self.stop = stop
        self.marks = marks
        self.roots: frozenset[Root] = merge_roots(roots for _, roots in marks) if marks else frozenset()
        """The roots of the blocks ``[0, stop)`` together (empty: all clean)."""

    def roots_through(self, position: int) -> frozenset[Root]:
        """The roots of the blocks at positions ``<= position`` together."""
        if not self.marks or self.marks[-1][0] <= position:
            return self.roots
        return merge_roots(roots for at, roots in self.marks if at <= position)


class _Work:
    """One scheduled request's place in a step: the blocks its forward pass reads and writes."""

    __slots__ = ("entered", "read_stop", "request", "tracked", "write_start", "write_stop")

    def __init__(self, request: Scheduled, tracked: _Tracked, block_size: int, entered: bool) -> None:
        computed = request.num_computed
        end = computed + request.num_new
        self.request = request
        self.tracked = tracked
        self.entered = entered  # new or resumed this step: its table came from vLLM's prefix cache now
        self.write_start = computed // block_size
        self.write_stop = min(len(tracked.block_ids), -(-end // block_size))
        self.read_stop = self.write_start + (1 if computed % block_size else 0)  # a part-filled block is read


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
        check_settings(block_size, lookup_timeout_s, recent_saves)
        self.index = index
        self.block_size = block_size
        self.lookup_timeout_s = float(lookup_timeout_s)
        self._clock = clock
        self._recent_saves = recent_saves
        self._requests: dict[Hashable, _Tracked] = {}
        self._probes: dict[Hashable, tuple[int, float]] = {}  # request -> (probe id, deadline)
        self._loads: list[BlockRun] = []
        self._failed: list[int] = []
        self._planned: OrderedDict[BlockHash, None] = OrderedDict()  # hashes lately planned for saving
        self._loading: dict[int, tuple[Hashable, int]] = {}  # block id -> (request, position) of its last load
        self.provenance = BlockProvenance()
        self._step = 0
        self._undelivered: tuple[tuple[BlockRun, ...], tuple[int, ...]] = ((), ())
        self._pending: OrderedDict[int, tuple[tuple[int, ...], ...]] = OrderedDict()  # step -> its load runs

    def __len__(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ match

    def match(self, request_id: str, hashes: Sequence[BlockHash], num_tokens: int, num_computed: int) -> int | None:
        """Tokens past ``num_computed`` that can be loaded, or None: ask again (a probe is out).

        ``hashes`` are the request's chained block hashes (the planner keeps the list: vLLM extends it
        as tokens are generated); ``num_tokens`` the tokens it holds; ``num_computed`` its local hit.
        """
        first, limit = match_range(request_id, hashes, num_tokens, num_computed, self.block_size)
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
        loaded = load_range(request_id, tracked.matched_from, num_external_tokens, self.block_size)
        first, stop = loaded.start, loaded.stop
        if stop > len(block_ids) or stop > len(tracked.hashes):
            raise InvalidArgumentError(
                f"request {request_id!r}: blocks {first}..{stop - 1} to load, but {len(block_ids)} allocated"
            )
        run = BlockRun(request_id, tuple(tracked.hashes[first:stop]), tuple(int(b) for b in block_ids[first:stop]))
        self._loads.append(run)
        for position, block in enumerate(run.block_ids, first):
            self._loading[block] = (request_id, position)
        tracked.num_saved = max(tracked.num_saved, stop)  # loaded blocks are stored already

    def fail(self, block_ids: Sequence[int]) -> None:
        """vLLM expects ``block_ids`` loaded but no load was planned (a plan that went wrong): they are
        reported as load errors, so vLLM recomputes them rather than reading whatever they hold."""
        self._failed.extend(int(b) for b in block_ids)

    # ------------------------------------------------------------------ steps

    def plan_step(
        self,
        scheduled: Sequence[Scheduled],
        preempted: Iterable[str] = (),
        hashes: Mapping[str, Sequence[BlockHash]] | None = None,
    ) -> StepPlan:
        """The plan of the step vLLM just scheduled: the loads allocated since the last plan, and the saves of
        the blocks its forward pass fills (see the module docstring).

        ``scheduled`` lists running requests before new ones, as vLLM schedules them (a new request can hit a
        block an earlier one fills in the same step); ``preempted`` requests lost their blocks first;
        ``hashes`` introduces requests the planner never matched (their hash lists).
        """
        for request_id in preempted:
            self.preempted(request_id)
        self._step += 1
        step = self._step
        loads, self._loads = tuple(self._loads), []
        failed, self._failed = tuple(self._failed), []
        self._undelivered = (loads, failed)
        provenance = self.provenance
        if loads:
            runs = tuple(run.block_ids for run in loads)
            provenance.loaded(step, runs)
            self._pending[step] = runs
        if failed:
            provenance.failed(failed)
        self._expire(step)
        epoch = now = provenance.epoch
        named = hashes or {}
        requests = self._requests
        size = self.block_size
        traced: list[_Work] = []  # entered, or whose context is not known clean: their writes carry roots
        candidates: list[tuple[Scheduled, _Tracked, int]] = []  # requests that fill a block to save, in order
        fresh = provenance.fresh
        for request in scheduled:
            request_id, computed, num_new, num_drafts, table, new_ids = request
            tracked = requests.get(request_id)
            if tracked is None:
                known = named.get(request_id)
                if known is None:
                    continue  # never matched, no hashes: nothing of it is saved
                tracked = requests[request_id] = _Tracked(known)
            if table is not None:  # new or resumed: a table from vLLM's prefix cache, and fresh blocks
                tracked.block_ids = list(table)
                fresh(tracked.block_ids[-(-computed // size) :])
                clean = provenance.clean
                tracked.context = _Context(now, 0, []) if clean else None
                tracked.clean_at = now if clean else -1
                traced.append(_Work(request, tracked, size, True))
            else:
                if new_ids:
                    tracked.block_ids.extend(new_ids)
                    fresh(new_ids)
                if computed < tracked.end:
                    now = provenance.epoch = now + 1  # it recomputes blocks it computed before: others may hold them
                if tracked.clean_at != now:
                    traced.append(_Work(request, tracked, size, False))
            end = tracked.end = computed + num_new
            full = (end - num_drafts) // size
            if full > tracked.num_saved:  # a block filled (if the table and the hashes reach it)
                full = min(full, len(tracked.hashes), len(tracked.block_ids))
                if full > tracked.num_saved:
                    candidates.append((request, tracked, full))
        if not provenance.clean:
            if now != epoch:  # a rewrite: every context may have changed
                traced = [
                    _Work(request, tracked, size, request.block_ids is not None)
                    for request in scheduled
                    if (tracked := requests.get(request.request_id)) is not None
                ]
            self._trace(traced, rescan_all=now != epoch)
        saves = [run for request, tracked, full in candidates if (run := self._saves(request, tracked, full))]
        self._undelivered = ((), ())
        return StepPlan(loads, tuple(saves), failed, step, next(iter(self._pending), step + 1))

    def salvage(self) -> StepPlan:
        """The plan to send when :meth:`plan_step` raised (a bug, or a scheduler output it could not read): the
        step's loads and failures, no saves -- and, since what this step writes is not known, every block of
        every request is taken for bad until rewritten (saves resume as vLLM recomputes or hands out blocks)."""
        loads, failed = self._undelivered
        self._undelivered = ((), ())
        if not loads and not failed:
            loads, self._loads = tuple(self._loads), []
            failed, self._failed = tuple(self._failed), []
        self.provenance.failed(b for tracked in self._requests.values() for b in tracked.block_ids)
        self.provenance.epoch += 1
        step = self._step = self._step + 1
        return StepPlan(loads, (), failed, step, next(iter(self._pending), step + 1))

    def _trace(self, work: list[_Work], *, rescan_all: bool) -> None:
        """Give every block this step writes the roots of its writer's context (see the provenance module).

        Running requests come first, then the ones that entered this step, in order: a request can hit a block
        in vLLM's prefix cache that an earlier one fills in this very step (each layer's KV is written before
        it is attended to). vLLM's two lists do not keep the scheduling order between new and resumed
        requests, and a request recomputing its blocks (``rescan_all``) rewrites blocks others hold: those
        are scanned again while one read a block written after it, until nothing changes.
        """
        written: dict[int, int] = {}  # block -> index of the last work item that wrote it this step
        for i, w in enumerate(work):
            self._write(w, written, i, rescan=w.entered or rescan_all)
        rescanned = [i for i, w in enumerate(work) if w.entered or rescan_all]
        for _ in range(len(rescanned)):
            changed = False
            for i in rescanned:
                w = work[i]
                if any(written.get(b, -1) > i for b in w.tracked.block_ids[: w.read_stop]):
                    before = w.tracked.context.roots if w.tracked.context is not None else frozenset()
                    changed |= self._write(w, written, i, rescan=True) != before
            if not changed:
                return
        for w in work:  # no fixed point in as many rounds as there are entries: a cycle; take the worst
            self.provenance.wrote(w.tracked.block_ids[w.write_start : w.write_stop], frozenset({BAD}))

    def _write(self, w: _Work, written: dict[int, int], i: int, *, rescan: bool) -> frozenset[Root]:
        """Scan ``w``'s context and give the blocks it writes its roots; returns them."""
        roots = self._context(w.tracked, w.read_stop, rescan=rescan).roots
        blocks = w.tracked.block_ids[w.write_start : w.write_stop]
        self.provenance.wrote(blocks, roots)
        for b in blocks:
            written[b] = i
        return roots

    def _context(self, tracked: _Tracked, stop: int, *, rescan: bool = False) -> _Context:
        """The provenance of ``tracked``'s blocks ``[0, stop)``; a clean scan from an earlier step is extended
        rather than repeated (blocks in a clean context change only when rewritten, which bumps the epoch)."""
        provenance = self.provenance
        table = tracked.block_ids
        cached = tracked.context
        if (
            not rescan
            and cached is not None
            and not cached.marks
            and cached.epoch == provenance.epoch
            and cached.stop <= stop
        ):
            start = cached.stop
        else:
            start = 0
        marks = provenance.tainted_positions(table, start, stop)
        context = tracked.context = _Context(provenance.epoch, stop, marks)
        tracked.clean_at = -1 if marks else provenance.epoch
        return context

    def _saves(self, request: Scheduled, tracked: _Tracked, full: int) -> BlockRun | None:
        """The blocks of ``request`` to save after this step (up to ``full``): whole, real, not stored, not planned
        lately, not over a bad context; each with its guard where its context awaits a load's outcome."""
        start = tracked.num_saved
        context = None if self.provenance.clean or tracked.context is None else tracked.context
        if context is not None and not context.marks:
            context = None  # clean: nothing to guard
        write_start = request.num_computed // self.block_size
        read_last = write_start - (0 if request.num_computed % self.block_size else 1)
        is_known = self.index.is_known
        planned = self._planned
        picked: list[tuple[BlockHash, int, frozenset[Root]]] = []
        stop = full
        no_roots: frozenset[Root] = frozenset()
        for i in range(start, full):
            if context is None:
                roots = no_roots
            elif i >= write_start:
                roots = context.roots  # written this step over the whole context
            else:
                roots = context.roots_through(min(i, read_last))
            if BAD in roots:
                stop = i  # saved once vLLM recomputes it over a clean context
                break
            h = tracked.hashes[i]
            if h not in planned and not is_known(h):
                picked.append((h, tracked.block_ids[i], roots))
        tracked.num_saved = stop
        if not picked:
            return None
        for h, _, _ in picked:
            planned[h] = None
        while len(planned) > self._recent_saves:
            planned.popitem(last=False)
        guards = tuple(roots for _, _, roots in picked) if any(roots for _, _, roots in picked) else ()
        return BlockRun(request.request_id, tuple(h for h, _, _ in picked), tuple(b for _, b, _ in picked), guards)

    # ------------------------------------------------------------------ outcomes

    def confirm(self, failed: Mapping[int, Collection[int]], dropped: Iterable[tuple[str, BlockHash]] = ()) -> None:
        """The workers' report: ``failed[step]`` are the block ids whose load in ``step`` failed (every step that
        loaded is named, failures or not); ``dropped`` the saves they withheld (request id, hash)."""
        for step, blocks in sorted(failed.items()):
            runs = self._pending.pop(step, None)
            if runs is not None:
                lost = set(blocks)
                arrived = [next((j for j, b in enumerate(run) if b in lost), len(run)) for run in runs]
                self.provenance.confirm(step, arrived)
            if blocks:
                self.load_failed(blocks)
        for request_id, h in dropped:
            self._planned.pop(h, None)
            tracked = self._requests.get(request_id)
            if tracked is None:
                continue
            for position, known in enumerate(tracked.hashes):
                if known == h:
                    tracked.num_saved = min(tracked.num_saved, position)
                    break

    def _expire(self, step: int) -> None:
        """Loads whose outcome stayed unreported for :data:`EXPIRE_STEPS` steps count as failed (what depends
        on them is never saved; the store's index keeps them, a later read checks them anyway)."""
        pending = self._pending
        while pending and (oldest := next(iter(pending))) <= step - EXPIRE_STEPS:
            self.provenance.confirm(oldest, [0] * len(pending.pop(oldest)))

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

    def preempted(self, request_id: str) -> None:
        """vLLM took the request's blocks back: its table is gone (what it saved stays saved)."""
        tracked = self._requests.get(request_id)
        if tracked is not None:
            tracked.block_ids = []
            tracked.context = None
            tracked.clean_at = -1
            tracked.end = 0
        self._probes.pop(request_id, None)

    def finished(self, request_id: str) -> None:
        """The request ended (finished or aborted): forget it."""
        self._requests.pop(request_id, None)
        self._probes.pop(request_id, None)
        self._loads = [run for run in self._loads if run.request_id != request_id]
