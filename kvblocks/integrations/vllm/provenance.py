"""Which of vLLM's KV blocks may hold KV that is not what their hash names (the connector's scheduler side).

A load that fails leaves a block whose bytes are not its hash's KV, and every block a forward pass computes
while such a block is in its request's context is wrong too: layer 0 of a block depends on its own tokens
only, every later layer on attention over the whole context. vLLM recomputes the blocks a connector reports
failed, but the forward pass of the step that loaded them has already read them -- for the loading request
and for every request that hit the loading request's blocks in vLLM's prefix cache in that step. Saving what
that pass computed puts wrong KV under the right key in a store every engine shares, and nothing downstream
can tell. So the connector never saves a block whose context held a failed load.

The scheduler plans a step's saves before anyone knows whether the step's loads will succeed: the worker
loads just before the forward pass, and with async scheduling the next step is planned before this one's
outcome arrives. Every block therefore carries its *provenance*: the loads whose outcome is still unknown
that its bytes depend on (its *roots*), or *bad* once one of them failed. A load run (one request's blocks
loaded in one step) arrives as a leading run -- the blocks past its first failure are reported failed too --
so a root is ``(step, run, count)``: "the first ``count`` blocks of load run ``run`` of step ``step`` arrived
sound"::

    step 7: r0 loads its blocks 0..5 (vLLM ids 1..6, run 0) and computes 6..21 (ids 7..22);
            r1 hits r0's blocks 0..19 in vLLM's prefix cache and computes its own 20..21 (ids 23, 24)

        id 1 .. id 6   roots {(7, 0, 1)} .. {(7, 0, 6)}    block j depends on the run's first j + 1 loads
        ids 7..24      roots {(7, 0, 6)}                   computed over all six

    a save of id 7 is planned with guard {(7, 0, 6)}: the worker, which knows the loads' outcomes before it
    saves, drops it if fewer than 6 of run 0's blocks arrived. Step 7's outcome (the worker's report): id 2
    failed, so 1 block of run 0 arrived -> id 1 is clean, ids 2..24 are bad.

A bad block is clean again once a forward pass rewrites it over a clean context (vLLM's recompute), a load
fills it again, or vLLM hands it out as a new block. Blocks with no entry here are clean: in steady state
without loads this holds nothing and costs nothing; with loads, a block's roots are one per load run it
depends on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["BAD", "BlockProvenance", "Root", "merge_roots"]

Root = tuple[int, int, int]
"""Loads whose outcome the scheduler has not heard yet: (the step that planned them, the load run's index in the
step's plan, how many of the run's leading blocks must arrive sound)."""
BAD: Root = (-1, -1, 1)
"""The root every bad block carries: loads known to have failed (it never confirms)."""
_BAD_ONLY: frozenset[Root] = frozenset({BAD})
_NONE: frozenset[Root] = frozenset()


def merge_roots(sets: Iterable[frozenset[Root]]) -> frozenset[Root]:
    """The roots of a context made of blocks with roots ``sets``: per load run, the most blocks any of them needs.

    >>> sorted(merge_roots([frozenset({(7, 0, 1)}), frozenset({(7, 0, 3), (6, 1, 2)}), frozenset({(7, 0, 2)})]))
    [(6, 1, 2), (7, 0, 3)]
    """
    need: dict[tuple[int, int], int] = {}
    for roots in sets:
        for step, run, count in roots:
            if need.get((step, run), 0) < count:
                need[step, run] = count
    return frozenset((step, run, count) for (step, run), count in need.items())


class BlockProvenance:
    """The roots of every vLLM block that has any (see the module docstring); the scheduler's thread only."""

    def __init__(self) -> None:
        self._roots: dict[int, frozenset[Root]] = {}  # block id -> roots; absent: clean
        self._by_step: dict[int, set[int]] = {}  # step -> the blocks whose roots name it (what its report settles)
        self.epoch = 0
        """Bumped whenever a block that may sit in a running request's context changes provenance other than
        by confirmation (a request recomputing blocks it had computed before): cached context scans are stale."""

    def __len__(self) -> int:
        return len(self._roots)

    @property
    def clean(self) -> bool:
        """Whether every block is clean (nothing to guard, nothing to scan)."""
        return not self._roots

    def roots_of(self, block: int) -> frozenset[Root]:
        """Block ``block``'s roots (empty: clean; containing :data:`BAD`: bad)."""
        return self._roots.get(block, _NONE)

    def is_bad(self, block: int) -> bool:
        return BAD in self._roots.get(block, _NONE)

    def _set(self, block: int, roots: frozenset[Root]) -> None:
        table, by_step = self._roots, self._by_step
        old = table.get(block)
        if old is not None:
            for step, _, _ in old:
                blocks = by_step.get(step)
                if blocks is not None:
                    blocks.discard(block)
                    if not blocks:
                        del by_step[step]
        if roots:
            table[block] = roots
            for step, _, _ in roots:
                if step >= 0:
                    by_step.setdefault(step, set()).add(block)
        elif old is not None:
            del table[block]

    def loaded(self, step: int, runs: Sequence[Sequence[int]]) -> None:
        """Step ``step`` loads ``runs[r]`` (block ids in order): block ``j`` of run ``r`` depends on its first
        ``j + 1`` loads."""
        for run, blocks in enumerate(runs):
            for j, b in enumerate(blocks):
                self._set(b, frozenset({(step, run, j + 1)}))

    def failed(self, blocks: Iterable[int]) -> None:
        """``blocks`` will not hold their KV (a load vLLM expects that no load fills): bad."""
        for b in blocks:
            self._set(b, _BAD_ONLY)

    def fresh(self, blocks: Iterable[int]) -> None:
        """vLLM handed ``blocks`` out new: whatever they held is never read before a forward pass writes them."""
        if self._roots:
            for b in blocks:
                if b in self._roots:
                    self._set(b, _NONE)

    def wrote(self, blocks: Iterable[int], roots: frozenset[Root]) -> None:
        """A forward pass writes ``blocks`` over a context whose roots are ``roots``."""
        if roots or self._roots:
            for b in blocks:
                self._set(b, roots)

    def tainted_positions(self, table: Sequence[int], start: int, stop: int) -> list[tuple[int, frozenset[Root]]]:
        """``(position, roots)`` of every block of ``table[start:stop]`` that is not clean, in position order."""
        roots = self._roots
        if not roots or roots.keys().isdisjoint(table[start:stop]):  # the common case, at C speed
            return []
        return [(i, roots[b]) for i, b in enumerate(table[start:stop], start) if b in roots]

    def confirm(self, step: int, arrived: Sequence[int]) -> None:
        """The worker reports step ``step``'s loads: ``arrived[r]`` leading blocks of load run ``r`` arrived sound.
        Blocks needing more of a run become bad; the rest lose the step's roots."""
        table = self._roots
        settled: dict[frozenset[Root], frozenset[Root]] = {}  # blocks computed together share one roots set
        for block in self._by_step.pop(step, ()):
            roots = table.get(block)
            if roots is None:
                continue
            after = settled.get(roots)
            if after is None:
                kept = []
                bad = False
                for root in roots:
                    if root[0] != step:
                        kept.append(root)
                    elif root[1] >= len(arrived) or arrived[root[1]] < root[2]:
                        bad = True
                after = settled[roots] = _BAD_ONLY if bad else frozenset(kept)
            if after:
                table[block] = after
                for other, _, _ in after:
                    if other >= 0 and other != step:
                        self._by_step.setdefault(other, set()).add(block)
            else:
                del table[block]
