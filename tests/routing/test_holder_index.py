"""HolderIndex against a brute-force model: every worker's set of blocks, and the leading runs it implies.

The blocks form a fixed forest (each block's parent is fixed: chained hashes). Workers store chain
segments in or out of order, remove blocks in any order, and clear; prompts are root-to-node paths of
the forest. Whatever the order of events -- caches that are not prefix-closed included -- the walk's
runs must equal the brute-force ones.

Workers may also lie: state a block under a parent that is not its own (an ancestor further up, any
block, or none). A worker holding no block under a false parent must still get its exact run, whatever
the liars sent; a liar's run may be overstated (its false links are what the walk trusts for it) but is
never below its true one. And workers may aim keys at one slot, with the index's secret in hand (a
leak): no row may then sit farther than the probe limit from its home.
"""

from __future__ import annotations

import random

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvblocks.errors import IntegrityError, InvalidArgumentError, InvalidBlockHashError
from kvblocks.routing.holder_index import M64, PROBE_LIMIT, HolderIndex

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


def aimed_keys(index: HolderIndex, count: int, slot: int) -> list[int]:
    """``count`` distinct keys whose probes all start at ``slot`` (modulo the table's size), under the
    index's current secret (as if it had leaked)."""
    inverse = pow(index._mult, -1, 1 << 64)
    top = (slot % index._cap) << index._shift
    return [(inverse * (top + j)) & M64 for j in range(1, count + 1)]


def longest_cluster(index: HolderIndex) -> int:
    """The longest run of consecutive non-empty slots (rows or tombstones): what a probe may cross."""
    longest = run = 0
    for v in index._ids:
        run = run + 1 if v else 0
        longest = max(longest, run)
    return longest


class HolderIndexMachine(RuleBasedStateMachine):
    @initialize(
        seed=st.integers(0, 10_000),
        capacity=st.sampled_from([1, 16, 4096]),
        limit=st.sampled_from([4, 16, PROBE_LIMIT]),
    )
    def setup(self, seed: int, capacity: int, limit: int) -> None:
        self.parent = make_forest(seed)
        self.blocks = list(self.parent)
        self.index = HolderIndex(capacity, probe_limit=limit)
        self.held: dict[int, set[int]] = {b: set() for b in range(WORKERS)}
        self.stated: dict[int, dict[int, int | None]] = {b: {} for b in range(WORKERS)}  # parent each stated

    def _store(self, worker: int, segment: list[int], parent: int | None) -> None:
        """Worker stores ``segment`` as a chain under ``parent``; a block it already holds keeps the parent
        it stated first."""
        held, stated = self.held[worker], self.stated[worker]
        new = len(set(segment) - held)
        assert self.index.add(worker, segment, parent) == new
        for block in segment:
            if block not in held:
                held.add(block)
                stated[block] = parent
            parent = block

    def ordered(self, blocks: set[int | None]) -> list[int]:
        """In the order the blocks were made (the aimed keys' values change from run to run: hypothesis
        must draw the same blocks when it replays a run)."""
        return sorted((b for b in blocks if b is not None), key=self.blocks.index)

    def honest(self, worker: int) -> bool:
        """Every block the worker holds, it holds under its true parent."""
        return all(self.stated[worker][b] == self.parent[b] for b in self.held[worker])

    @rule(worker=st.integers(0, WORKERS - 1), node=st.integers(0, FOREST - 1), start=st.just(0) | st.integers(0, 40))
    def store(self, worker: int, node: int, start: int) -> None:
        """A chain from its root (half the time), or a segment of it that skips its start (out of order)."""
        chain = path_to(self.parent, self.blocks[node])
        segment = chain[min(start, len(chain) - 1) :]
        self._store(worker, segment, self.parent[segment[0]])

    @rule(
        worker=st.integers(0, WORKERS - 1),
        node=st.integers(0, FOREST - 1),
        start=st.integers(0, 40),
        skip=st.integers(1, 3),
    )
    def lie_skipping_ancestors(self, worker: int, node: int, start: int, skip: int) -> None:
        """A segment stated under an ancestor further up than its parent (h2 under h0), or as a root."""
        chain = path_to(self.parent, self.blocks[node])
        first = min(start, len(chain) - 1)
        self._store(worker, chain[first:], chain[first - 1 - skip] if first - 1 - skip >= 0 else None)

    @rule(worker=st.integers(0, WORKERS - 1), data=st.data())
    def store_over_a_lie(self, worker: int, data: st.DataObject) -> None:
        """An honest chain from the root through a block some worker stated under a false parent (whose
        row may keep the false link: the lie came first), to it or below it."""
        lied = {b for stated in self.stated.values() for b, up in stated.items() if up != self.parent[b]}
        through = [b for b in self.blocks if lied.intersection(path_to(self.parent, b))]
        if through:
            self._store(worker, path_to(self.parent, data.draw(st.sampled_from(through))), None)

    @rule(worker=st.integers(0, WORKERS - 1), data=st.data())
    def lie_anything(self, worker: int, data: st.DataObject) -> None:
        """Any blocks, in any order, under any parent (a block itself included, or none)."""
        blocks = data.draw(st.lists(st.sampled_from(self.blocks), min_size=1, max_size=5))
        self._store(worker, blocks, data.draw(st.none() | st.sampled_from(self.blocks)))

    @rule(worker=st.integers(0, WORKERS - 1), slot=st.integers(0, 1 << 20), count=st.integers(1, 40))
    def aim_at_one_slot(self, worker: int, slot: int, count: int) -> None:
        """A chain of new keys that all start their probe at one slot, under the secret of the moment."""
        keys = [k for k in aimed_keys(self.index, count, slot) if k not in self.parent]
        for up, key in zip([None, *keys], keys, strict=False):
            self.parent[key] = up
        self.blocks.extend(keys)
        if keys:
            self._store(worker, keys, None)

    @rule(worker=st.integers(0, WORKERS - 1), data=st.data())
    def remove(self, worker: int, data: st.DataObject) -> None:
        held = self.ordered(self.held[worker])
        if not held:
            return
        gone = data.draw(st.lists(st.sampled_from(held), max_size=6, unique=True))
        assert self.index.remove(worker, gone) == len(gone)
        self.held[worker] -= set(gone)

    @rule(worker=st.integers(0, WORKERS - 1), data=st.data())
    def evict_inside(self, worker: int, data: st.DataObject) -> None:
        """One block the worker holds a child of: a hole in the middle of its chain."""
        held = self.held[worker]
        inner = self.ordered({self.parent[b] for b in held} & held - {None})
        if inner:
            gone = data.draw(st.sampled_from(inner))
            assert self.index.remove(worker, [gone]) == 1
            held.discard(gone)

    @rule(worker=st.integers(0, WORKERS - 1), tail_first=st.booleans())
    def evict_chain_tail(self, worker: int, tail_first: bool) -> None:
        """An LRU-like eviction: the deepest blocks first (or, badly, the shallowest)."""
        held = sorted(self.ordered(self.held[worker]), key=lambda b: len(path_to(self.parent, b)), reverse=tail_first)[
            :5
        ]
        assert self.index.remove(worker, held) == len(held)
        self.held[worker] -= set(held)

    @rule(worker=st.integers(0, WORKERS - 1))
    def clear(self, worker: int) -> None:
        assert self.index.clear(worker) == len(self.held[worker])
        self.held[worker] = set()
        assert not self.index.suspect >> worker & 1

    def assert_runs(self, prompt: list[int], alive: int, got: dict[int, int], min_run: int = 0) -> None:
        """Honest workers: exactly their runs (of at least ``min_run``). Liars: at least their true run."""
        true = brute_runs(self.held, prompt, alive)
        for w, run in true.items():
            if self.honest(w):
                assert got.get(w) == (run if run >= min_run else None), (w, run, got)
            elif w in got:
                assert run <= got[w] <= len(prompt)
                assert got[w] == len(prompt) or prompt[got[w]] not in self.held[w]  # ends where it lacks one

    def walk(self, prompt: list[int], alive: int, min_run: int) -> None:
        """Every run, or with ``min_run`` exactly the runs at least that long."""
        self.assert_runs(prompt, alive, as_runs(self.index.runs(prompt, alive, min_run)), min_run)
        self.longest(prompt, alive)

    def longest(self, prompt: list[int], alive: int) -> None:
        """The longest run and who holds it, or None (when a suspect is alive: then runs answers). With
        liars alive, the honest workers in the answer hold exactly that run and the others less."""
        answer = self.index.longest_run(prompt, alive)
        if alive & self.index.suspect:
            assert answer is None
            return
        runs = brute_runs(self.held, prompt, alive)
        if all(self.honest(w) for w in runs):
            top = max(runs.values())
            assert answer == (top, sum(1 << w for w, run in runs.items() if run == top) if top else 0)
        elif answer is not None:
            top, mask = answer
            for w, run in runs.items():
                if self.honest(w):
                    assert run == top if mask >> w & 1 else run < top or run == top == 0

    @rule(node=st.integers(0, FOREST - 1), alive=st.integers(1, (1 << WORKERS) - 1), min_run=st.integers(0, 12))
    def walk_to_any_block(self, node: int, alive: int, min_run: int) -> None:
        self.walk(path_to(self.parent, self.blocks[node]), alive, min_run)

    @rule(worker=st.integers(0, WORKERS - 1), alive=st.integers(1, (1 << WORKERS) - 1), data=st.data())
    def walk_to_a_held_block(self, worker: int, alive: int, data: st.DataObject) -> None:
        """A prompt ending at a block the worker holds: where a false link would stretch its run."""
        if self.held[worker]:
            block = data.draw(st.sampled_from(self.ordered(self.held[worker])))
            self.walk(path_to(self.parent, block), alive | 1 << worker, 0)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "index"):
            return
        self.index.check()
        for bit in range(WORKERS):
            assert self.index.held(bit) == len(self.held[bit])
            stated = self.stated[bit]
            closed = all(stated[b] is None or stated[b] in self.held[bit] for b in self.held[bit])
            assert bool(self.index.suspect >> bit & 1) == (not closed)  # exact: a hole is never missed
        assert dict(self.index.items()) == {
            b: sum(1 << w for w in range(WORKERS) if b in self.held[w])
            for b in self.blocks
            if any(b in s for s in self.held.values())
        }

    @invariant()
    def honest_runs_to_every_held_block_are_exact(self) -> None:
        """Where a false link would stretch a run: a prompt ending at a block the worker holds."""
        if not hasattr(self, "index"):
            return
        for w in range(WORKERS):
            if self.honest(w):
                for block in self.held[w]:
                    prompt = path_to(self.parent, block)
                    assert as_runs(self.index.runs(prompt, 1 << w)) == brute_runs(self.held, prompt, 1 << w)


TestHolderIndexMachine = HolderIndexMachine.TestCase
TestHolderIndexMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class Reads(list[int]):
    """A prompt that records which of its positions the walk reads (each once: the walk remembers)."""

    def __init__(self, blocks: list[int]) -> None:
        super().__init__(blocks)
        self.read: set[int] = set()

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        self.read.add(i)
        return super().__getitem__(i)


def test_a_prompt_walk_probes_logarithmically_many_blocks() -> None:
    """A fully held 2,048-block chain costs a few dozen probes, not 2,048."""
    index = HolderIndex()
    chain = list(range(10, 2058))
    for w in range(8):
        index.add(w, chain[: 256 * (w + 1)], None)
    prompt = Reads(chain)
    assert as_runs(index.runs(prompt, 0xFF)) == {w: 256 * (w + 1) for w in range(8)}
    # per distinct run: a gallop and a bisection of <= 11 steps each, a probe and a link check per step
    assert len(prompt.read) <= 8 * 2 * 11 * 2 < 2048 / 5


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


def test_a_lying_workers_parent_link_does_not_change_an_honest_workers_run() -> None:
    """Issue 30: a liar stores h2 under h0; an honest worker then stores h0..h3 and evicts h1. The row of h2
    keeps the liar's link, but the honest worker's own link (h1) is what its closure counts: it holds h2
    without h1, so it is scanned, and its run is 1, not 4."""
    h0, h1, h2, h3 = 101, 102, 103, 104
    index = HolderIndex()
    index.add(1, [h2], h0)
    index.add(0, [h0, h1, h2, h3], None)
    index.remove(0, [h1])
    index.check()
    assert index.suspect & 1
    assert as_runs(index.runs([h0, h1, h2, h3], 0b01)) == {0: 1}
    assert as_runs(index.runs([h0, h1, h2, h3], 0b11)) == {0: 1, 1: 0}
    assert index.longest_run([h0, h1, h2, h3], 0b01) is None  # a suspect: runs answers
    index.remove(0, [h2, h3])  # its orphans go: trusted again, and the walk still reads its own links
    assert not index.suspect & 1
    assert index.longest_run([h0, h1, h2, h3], 0b01) == (1, 1)


def test_an_honest_worker_keeps_the_logarithmic_walk_beside_a_liars_links() -> None:
    """The liar wrote h2's row first (under h0) and left; honest workers 0 and 2 hold the chain through it
    under their own link (h1). Their walks check their own links and pass: no scan for the liar's lie."""
    chain = list(range(1000, 1064))
    index = HolderIndex()
    index.add(1, [chain[2]], chain[0])
    index.add(0, chain, None)
    index.add(2, chain[:3], None)
    index.remove(1, [chain[2]])  # the row keeps its first writer's link
    assert index.suspect == 0
    assert index.longest_run(chain[:3], 0b101) == (3, 0b101)  # bisection probes h2 first (None: a failed link)
    prompt = Reads(chain)
    assert as_runs(index.runs(prompt, 0b101)) == {0: 64, 2: 3}  # the gallop checks h2's link for both
    assert 2 in prompt.read and len(prompt.read) < 24  # a scan would read all 64 blocks
    index.check()


def test_keys_aimed_at_a_public_multiplier_do_not_cluster() -> None:
    """Issue 30: the index placed an int key by a fixed public multiplier (2**64 / phi), so the keys
    ``i * inverse(mult)`` all started at slot 0 and filled one cluster, every insert crossing it. Those
    keys, and other structured families, now spread like random ones."""
    inverse = pow(0x9E3779B97F4A7C15, -1, 1 << 64)
    rng = random.Random(1)
    families = {
        "inverse of the old multiplier": [(i * inverse) & M64 for i in range(1, 6001)],
        "consecutive": list(range(6000)),
        "multiples of 2**40": [i << 40 for i in range(6000)],
        "high bits only": [i << 51 for i in range(6000)],
        "random": [rng.getrandbits(64) for _ in range(6000)],
    }
    for name, keys in families.items():
        index = HolderIndex()
        for i in range(0, len(keys), 16):
            index.add(0, keys[i : i + 16], None)
        assert len(index) == len(keys)
        assert longest_cluster(index) < 150, name  # random keys: ~40; the old placement: 6,000
        index.check()


def test_placement_is_secret_per_index_and_results_are_not() -> None:
    """Two indexes fed the same events place the keys differently, and answer the same."""
    rng = random.Random(2)
    chain = [rng.getrandbits(64) for _ in range(300)]
    a, b = HolderIndex(), HolderIndex()
    for index in (a, b):
        index.add(0, chain, None)
        index.add(1, chain[:100], None)
        index.remove(1, chain[50:100])
    assert a._mult != b._mult
    assert [a._find(k) for k in chain] != [b._find(k) for k in chain]
    assert dict(a.items()) == dict(b.items())
    assert a.runs(chain, 0b11) == b.runs(chain, 0b11) == [(50, 2), (300, 1)]


def test_keys_aimed_at_a_leaked_secret_rebuild_the_table_under_a_new_one() -> None:
    """Someone who knows the secret sends 600 keys that all start at one slot: once an insert would probe
    past the limit the table is rebuilt under a fresh secret, so no row sits farther than the limit from
    its home and the runs stay exact."""
    index = HolderIndex(probe_limit=16)
    index.add(2, list(range(1, 41)), None)
    secret = index._mult
    keys = aimed_keys(index, 600, 7)
    index.add(0, keys, None)
    assert index._mult != secret
    index.check()  # every row within 16 slots of its home
    assert as_runs(index.runs(keys, 0b101)) == {0: 600, 2: 0}
    assert as_runs(index.runs(list(range(1, 41)), 0b101)) == {0: 0, 2: 40}


def test_probe_limit_is_validated() -> None:
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(InvalidArgumentError):
            HolderIndex(probe_limit=bad)  # type: ignore[arg-type]


def test_the_old_module_path_is_the_package_s_module() -> None:
    import kvblocks.holder_index as old
    import kvblocks.routing.holder_index as new

    assert old.__all__ == ["M64", "PROBE_LIMIT", "HolderIndex"]
    assert all(getattr(old, name) is getattr(new, name) for name in old.__all__)


def test_the_routing_package_keeps_its_names_and_its_modules_stay_short() -> None:
    from pathlib import Path

    import kvblocks.routing

    assert sorted(kvblocks.routing.__all__) == ["Lease", "NoWorkerError", "Router", "RouterConfig", "WorkerLoad"]
    assert all(hasattr(kvblocks.routing, name) for name in kvblocks.routing.__all__)
    lengths = {p.name: len(p.read_text().splitlines()) for p in Path(kvblocks.routing.__file__).parent.glob("*.py")}
    assert {name: n for name, n in lengths.items() if n > 600} == {}
