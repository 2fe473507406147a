"""HolderIndex against a brute-force model: every worker's set of blocks, and the leading runs it implies.

The blocks form a fixed forest (each block's parent is fixed: chained hashes). Workers store chain
segments in or out of order, remove blocks in any order, and clear; prompts are root-to-node paths of
the forest. Whatever the order of events -- caches that are not prefix-closed included -- the walk's
runs must equal the brute-force ones.
"""

from __future__ import annotations

import random

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvblocks.errors import IntegrityError, InvalidBlockHashError
from kvblocks.holder_index import HolderIndex

WORKERS = 5
FOREST = 60


def make_forest(seed: int, size: int = FOREST, roots: int = 3) -> dict[int, int | None]:
    """block -> parent (None for a root); blocks are big random ints, as 64-bit event hashes are."""
    rng = random.Random(seed)
    blocks = list(dict.fromkeys(rng.getrandbits(64) | 1 for _ in range(size)))
    parent: dict[int, int | None] = {}
    for i, b in enumerate(blocks):
        parent[b] = (
            None if i < roots else blocks[rng.randrange(max(1, i - 8), i) if rng.random() < 0.8 else rng.randrange(i)]
        )
    return parent


def path_to(parent: dict[int, int | None], block: int) -> list[int]:
    out = [block]
    while (p := parent[out[-1]]) is not None:
        out.append(p)
    return out[::-1]


def brute_runs(held: dict[int, set[int]], prompt: list[int], alive: int) -> dict[int, int]:
    runs = {}
    for bit in range(WORKERS):
        if alive >> bit & 1:
            n = 0
            while n < len(prompt) and prompt[n] in held[bit]:
                n += 1
            runs[bit] = n
    return runs


def as_runs(groups: list[tuple[int, int]]) -> dict[int, int]:
    out = {}
    for run, mask in groups:
        for bit in range(mask.bit_length()):
            if mask >> bit & 1:
                assert bit not in out, "a worker in two groups"
                out[bit] = run
    return out


class HolderIndexMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 10_000), capacity=st.sampled_from([1, 16, 4096]))
    def setup(self, seed: int, capacity: int) -> None:
        self.parent = make_forest(seed)
        self.blocks = list(self.parent)
        self.index = HolderIndex(capacity)
        self.held: dict[int, set[int]] = {b: set() for b in range(WORKERS)}

    @rule(worker=st.integers(0, WORKERS - 1), node=st.integers(0, FOREST - 1), start=st.integers(0, 40))
    def store(self, worker: int, node: int, start: int) -> None:
        chain = path_to(self.parent, self.blocks[node])
        segment = chain[min(start, len(chain) - 1) :]  # may skip the start of the chain: out of order
        new = len(set(segment) - self.held[worker])
        assert self.index.add(worker, segment, self.parent[segment[0]]) == new
        self.held[worker] |= set(segment)

    @rule(worker=st.integers(0, WORKERS - 1), data=st.data())
    def remove(self, worker: int, data: st.DataObject) -> None:
        held = sorted(self.held[worker])
        if not held:
            return
        gone = data.draw(st.lists(st.sampled_from(held), max_size=6, unique=True))
        assert self.index.remove(worker, gone) == len(gone)
        self.held[worker] -= set(gone)

    @rule(worker=st.integers(0, WORKERS - 1), tail_first=st.booleans())
    def evict_chain_tail(self, worker: int, tail_first: bool) -> None:
        """An LRU-like eviction: the deepest blocks first (or, badly, the shallowest)."""
        held = sorted(self.held[worker], key=lambda b: len(path_to(self.parent, b)), reverse=tail_first)[:5]
        assert self.index.remove(worker, held) == len(held)
        self.held[worker] -= set(held)

    @rule(worker=st.integers(0, WORKERS - 1))
    def clear(self, worker: int) -> None:
        assert self.index.clear(worker) == len(self.held[worker])
        self.held[worker] = set()
        assert not self.index.suspect >> worker & 1

    @rule(node=st.integers(0, FOREST - 1), alive=st.integers(1, (1 << WORKERS) - 1), min_run=st.integers(0, 12))
    def walk_matches_brute_force(self, node: int, alive: int, min_run: int) -> None:
        """Every run, or with ``min_run`` exactly the runs at least that long."""
        prompt = path_to(self.parent, self.blocks[node])
        expected = {w: run for w, run in brute_runs(self.held, prompt, alive).items() if run >= min_run}
        assert as_runs(self.index.runs(prompt, alive, min_run)) == expected

    @rule(node=st.integers(0, FOREST - 1), alive=st.integers(1, (1 << WORKERS) - 1))
    def longest_run_matches_brute_force(self, node: int, alive: int) -> None:
        """The longest run and who holds it, or None (when a suspect is alive: then runs answers)."""
        prompt = path_to(self.parent, self.blocks[node])
        answer = self.index.longest_run(prompt, alive)
        if alive & self.index.suspect:
            assert answer is None
            return
        runs = brute_runs(self.held, prompt, alive)
        top = max(runs.values())
        assert answer == (top, sum(1 << w for w, run in runs.items() if run == top) if top else 0)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "index"):
            return
        self.index.check()
        for bit in range(WORKERS):
            assert self.index.held(bit) == len(self.held[bit])
            closed = all(self.parent[b] is None or self.parent[b] in self.held[bit] for b in self.held[bit])
            assert bool(self.index.suspect >> bit & 1) == (not closed)  # exact: a hole is never missed
        assert dict(self.index.items()) == {
            b: sum(1 << w for w in range(WORKERS) if b in self.held[w])
            for b in self.blocks
            if any(b in s for s in self.held.values())
        }


TestHolderIndexMachine = HolderIndexMachine.TestCase
TestHolderIndexMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_prompt_walk_probes_logarithmically_many_blocks() -> None:
    """A fully held 2,048-block chain costs a few dozen probes, not 2,048."""
    index = HolderIndex()
    chain = list(range(10, 2058))
    for w in range(8):
        index.add(w, chain[: 256 * (w + 1)], None)
    probes = 0
    find = index._find

    def counting(key: int) -> int:
        nonlocal probes
        probes += 1
        return find(key)

    index._find = counting  # type: ignore[method-assign]
    assert as_runs(index.runs(chain, 0xFF)) == {w: 256 * (w + 1) for w in range(8)}
    # per distinct run: a gallop and a bisection of <= 11 steps each, a probe and a link check per step
    assert probes <= 8 * 2 * 11 * 2 < 2048 / 5


def test_a_prompt_that_is_not_one_chain_falls_back_to_a_scan() -> None:
    """Two chains glued together: the probe that crosses the seam sees a parent that is not the block
    before it, and the walk scans instead (still exact)."""
    index = HolderIndex()
    a, b = list(range(100, 140)), list(range(200, 240))
    index.add(0, a, None)
    index.add(0, b, None)
    index.add(1, a[:20], None)
    prompt = a[:10] + b[10:]  # worker 0 holds every block, but b[10:] is not a child of a[9]
    assert as_runs(index.runs(prompt, 0b11)) == {0: len(prompt), 1: 10}


def test_bytes_and_wide_ints_fold_apart() -> None:
    index = HolderIndex()
    index.add(0, [b"\x05", 5, 1 << 70], None)
    assert index.holders(b"\x05") == index.holders(5) == index.holders(1 << 70) == 1
    assert len({index.fold(b"\x05"), index.fold(5), index.fold(1 << 70)}) == 3
    assert index.holders(b"\x06") == 0


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.integers(min_value=-2, max_value=(1 << 64) + 2),
            st.integers(min_value=1 << 64, max_value=1 << 90),
            st.booleans(),
            st.binary(max_size=3),
            st.integers(min_value=0, max_value=(1 << 64) - 1).map(np.uint64),
            st.floats(allow_nan=False),
        ),
        max_size=6,
    )
)
def test_fold_all_is_fold_of_each(hashes: list[object]) -> None:
    """The batch fold (C when all are 64-bit ints) keys and refuses exactly as one fold per hash."""
    index = HolderIndex()
    try:
        expected = [index.fold(h) for h in hashes]  # type: ignore[arg-type]
    except InvalidBlockHashError:
        with pytest.raises(InvalidBlockHashError):
            index.fold_all(hashes)  # type: ignore[arg-type]
        return
    got = index.fold_all(iter(hashes))  # type: ignore[arg-type]
    assert got == expected and all(type(k) is int for k in got)


def test_growth_keeps_every_row() -> None:
    index = HolderIndex(16)
    rng = random.Random(3)
    keys = list(dict.fromkeys(rng.getrandbits(64) for _ in range(5000)))
    for i in range(0, 5000, 100):
        index.add((i // 100) % 7, keys[i : i + 100], None)
    index.remove(3, keys[300:400])
    index.check()
    assert len(index) == 4900
    assert all(index.holders(k) == 1 << ((i // 100) % 7) for i, k in enumerate(keys) if not 300 <= i < 400)


def test_check_catches_a_stale_count() -> None:
    index = HolderIndex()
    index.add(0, [1, 2, 3], None)
    index._held[0] = 2
    with pytest.raises(IntegrityError):
        index.check()


def test_evicting_a_block_another_worker_extended_is_no_hole() -> None:
    """Worker 0 drops a block only worker 1 holds children of: worker 0 keeps a prefix-closed cache, so it
    stays trusted (its walk stays logarithmic); worker 1 dropping the same block is a hole."""
    index = HolderIndex()
    index.add(0, [11, 12], None)
    index.add(1, [11, 12, 13, 14], None)
    index.remove(0, [12])
    assert index.suspect == 0
    index.remove(1, [12])  # worker 1 still holds 13 and 14 under it
    assert index.suspect == 0b10
    index.add(1, [12], 11)  # back: the hole is filled
    assert index.suspect == 0
    index.remove(1, [11, 12, 13])  # head first, in one batch: 14 alone is left without its parent
    assert index.suspect == 0b10
    index.remove(1, [14])
    assert index.suspect == 0
    index.check()
