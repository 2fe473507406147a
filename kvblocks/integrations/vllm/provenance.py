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
that its bytes depend on (its *roots*, ``(step, block id)``), or *bad* once one of them failed::

    step 7: r0 loads its blocks 0..5 (vLLM ids 1..6) and computes 6..21 (ids 7..22);
            r1 hits r0's blocks 0..19 in vLLM's prefix cache and computes its own 20..21 (ids 23, 24)

        ids 1..6     roots {(7, 1)} .. {(7, 6)}            each load is its own root
        ids 7..22    roots {(7, 1), ..., (7, 6)}           computed over all six loads
        ids 23, 24   roots {(7, 1), ..., (7, 6)}           r1's context is r0's blocks

    a save of id 7 is planned with guard {(7, 1), ..., (7, 6)}: the worker, which knows the loads' outcomes
    before it saves, drops it if any of them failed. Step 7's outcome (the worker's report): id 2 failed ->
    ids 2, 7..24 are bad; ids 1, 3..6 are clean (their roots confirmed).

A bad block is clean again once a forward pass rewrites it over a clean context (vLLM's recompute), a load
fills it again, or vLLM hands it out as a new block. Blocks with no entry here are clean: in steady state
without loads this holds nothing and costs nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

__all__ = ["BAD", "BlockProvenance", "Root"]

Root = tuple[int, int]
"""A load whose outcome the scheduler has not heard yet: (the step that planned it, the vLLM block id it fills)."""
BAD: Root = (-1, -1)
"""The root every bad block carries: a load known to have failed (it never confirms)."""
_BAD_ONLY: frozenset[Root] = frozenset({BAD})
_NONE: frozenset[Root] = frozenset()


class BlockProvenance:
    """The roots of every vLLM block that has any (see the module docstring); the scheduler's thread only."""

    def __init__(self) -> None:
        self._roots: dict[int, frozenset[Root]] = {}  # block id -> roots; absent: clean
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

    def loaded(self, step: int, blocks: Iterable[int]) -> None:
        """Step ``step`` loads ``blocks``: each depends on its own load only."""
        roots = self._roots
        for b in blocks:
            roots[b] = frozenset({(step, b)})

    def failed(self, blocks: Iterable[int]) -> None:
        """``blocks`` will not hold their KV (a load vLLM expects that no load fills): bad."""
        for b in blocks:
            self._roots[b] = _BAD_ONLY

    def fresh(self, blocks: Iterable[int]) -> None:
        """vLLM handed ``blocks`` out new: whatever they held is never read before a forward pass writes them."""
        roots = self._roots
        if roots:
            for b in blocks:
                roots.pop(b, None)

    def wrote(self, blocks: Iterable[int], roots: frozenset[Root]) -> None:
        """A forward pass writes ``blocks`` over a context whose roots are ``roots``."""
        table = self._roots
        if roots:
            for b in blocks:
                table[b] = roots
        elif table:
            for b in blocks:
                table.pop(b, None)

    def tainted_positions(self, table: Sequence[int], start: int, stop: int) -> list[tuple[int, frozenset[Root]]]:
        """``(position, roots)`` of every block of ``table[start:stop]`` that is not clean, in position order."""
        roots = self._roots
        if not roots or roots.keys().isdisjoint(table[start:stop]):  # the common case, at C speed
            return []
        return [(i, roots[b]) for i, b in enumerate(table[start:stop], start) if b in roots]

    def confirm(self, step: int, failed: Collection[int]) -> None:
        """The worker reports step ``step``'s loads: ``failed`` are the block ids whose load failed, every other
        load of that step succeeded. Blocks depending on a failed load become bad; the rest lose those roots."""
        lost = {(step, b) for b in failed}
        table = self._roots
        settled: dict[frozenset[Root], frozenset[Root]] = {}  # blocks computed together share one roots set
        for block, roots in list(table.items()):
            after = settled.get(roots)
            if after is None:
                if not any(root[0] == step for root in roots):
                    after = roots
                elif lost and not lost.isdisjoint(roots):
                    after = _BAD_ONLY
                else:
                    after = frozenset(root for root in roots if root[0] != step)
                settled[roots] = after
            if after:
                table[block] = after
            else:
                del table[block]
