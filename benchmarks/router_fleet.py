"""A deterministic fleet for the router at scale: W workers whose caches hold N blocks in all, with prefix sharing.

What the fleet holds (every worker's cache is prefix-closed: a held block's whole chain is held):

- ``system_prompts`` shared system prompts (16-96 blocks), picked by a Zipf-like popularity: the popular ones sit
  in hundreds of workers' caches;
- conversations, each on one system prompt, of 2-6 turns of 4-24 blocks; the worker that served it holds every
  turn, and ``replica_share`` of the conversations a worker takes are another worker's conversation, of which it
  holds the first few turns (a conversation moved between workers);
- ``long_docs`` documents of ``long_blocks`` blocks in all (a 32k-token prompt: a system prompt, then the
  document), held whole by ``long_holders`` workers and in part (a random prefix) by ``long_partial_holders`` more.

``--blocks N`` counts (block, worker) entries by default (``count="entries"``): the block hashes of every
worker's ``BlockStored`` events summed over the fleet, what the index is fed. ``count="distinct"`` counts the
distinct hashes instead (the prefix tree's nodes). Both are always reported.

Hashes: every node of the fleet's prefix tree is an integer id; its block hash (the chained, vLLM 64-bit int
form the router indexes) is ``splitmix64(id + SEQ_KEY)`` and its token hash (the per-block "local" hash
Dynamo's ``RadixTree`` walks by) ``splitmix64(id + LOCAL_KEY)``. splitmix64's finalizer is a bijection of
64-bit ints, so distinct nodes get distinct hashes -- what a collision-free chained hash of the prefix gives --
at numpy speed (10M hashes in well under a second) instead of sha256 over tokens.

Queries: "typical" prompts are a conversation (its system prompt and every turn: its serving worker holds
all of them, replicas a prefix, the system prompt's other holders its first blocks) plus a new turn nobody
holds, about 2k tokens; "long" prompts are a document's 2,048 blocks, fully held by its ``long_holders``.

Run ``python -m benchmarks.router_fleet --workers 512 --blocks 1000000 [--dynamo]`` for a table of build,
route and memory figures (memory is probed in fresh subprocesses: RSS delta, and tracemalloc for the Router).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

import numpy as np

from kvblocks.events import BlockStored
from kvblocks.routing import Router, RouterConfig

SEQ_KEY = 0x5EED_0000_0000_0001
LOCAL_KEY = 0x10CA_1000_0000_0003
_M64 = (1 << 64) - 1


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over uint64 (wrapping): a bijection, so distinct inputs give distinct outputs."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def seq_hashes(ids: np.ndarray) -> np.ndarray:
    """Block hashes (chained; what the router indexes) of node ids."""
    return splitmix64(ids.astype(np.uint64) + np.uint64(SEQ_KEY))


def local_hashes(ids: np.ndarray) -> np.ndarray:
    """Token hashes (per block; what Dynamo's RadixTree walks by) of node ids."""
    return splitmix64(ids.astype(np.uint64) + np.uint64(LOCAL_KEY))


@dataclass(frozen=True)
class FleetSpec:
    workers: int = 512
    blocks: int = 1_000_000
    count: str = "entries"  # what ``blocks`` counts: "entries" (block, worker) or "distinct" hashes
    block_size: int = 16
    seed: int = 0
    system_prompts: int = 16
    system_blocks: tuple[int, int] = (16, 96)
    turns: tuple[int, int] = (2, 6)
    turn_blocks: tuple[int, int] = (4, 24)
    replica_share: float = 0.2
    long_docs: int = 4
    long_blocks: int = 2048
    long_holders: int = 4
    long_partial_holders: int = 4

    def __post_init__(self) -> None:
        if self.count not in ("entries", "distinct"):
            raise ValueError(f"count must be 'entries' or 'distinct', got {self.count!r}")
        if self.workers < self.long_holders + self.long_partial_holders:
            raise ValueError("fewer workers than a long document's holders")


@dataclass
class Conversation:
    system: int
    start: int  # node ids start..turn_ends[-1]
    turn_ends: tuple[int, ...]


@dataclass
class Holding:
    """One worker's cache: system prompts, (conversation, turns held), (document, blocks held past its system)."""

    systems: list[int] = field(default_factory=list)
    conversations: dict[int, int] = field(default_factory=dict)
    docs: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Fleet:
    spec: FleetSpec
    systems: list[tuple[int, int]]  # node ranges
    conversations: list[Conversation]
    docs: list[tuple[int, int, int]]  # (system, start, end): the chain is the system's range, then start..end
    holdings: list[Holding]
    nodes: int
    entries: int
    seq: np.ndarray = field(repr=False)  # block hash by node id
    _local: np.ndarray | None = field(default=None, repr=False)

    @property
    def distinct(self) -> int:
        return self.nodes

    @property
    def local(self) -> np.ndarray:
        if self._local is None:
            self._local = local_hashes(np.arange(self.nodes, dtype=np.uint64))
        return self._local

    # ------------------------------------------------------------------ chains per worker

    def chains(self, worker: int) -> Iterator[tuple[int | None, int, int]]:
        """(parent node or None, start, end) runs in the order a worker stores them (parents first)."""
        h = self.holdings[worker]
        for s in h.systems:
            yield None, *self.systems[s]
        for c, turns in h.conversations.items():
            conv = self.conversations[c]
            parent, start = self.systems[conv.system][1] - 1, conv.start
            for end in conv.turn_ends[:turns]:
                yield parent, start, end
                parent, start = end - 1, end
        for d, held in h.docs:
            system, start, _ = self.docs[d]
            yield self.systems[system][1] - 1, start, start + held

    def ranges(self, worker: int) -> tuple[np.ndarray, np.ndarray]:
        """The worker's held node ranges, sorted (starts, ends): disjoint by construction."""
        runs = sorted((start, end) for _, start, end in self.chains(worker))
        return np.array([r[0] for r in runs], dtype=np.int64), np.array([r[1] for r in runs], dtype=np.int64)

    def events(self, worker: int, tier: str = "device") -> list[BlockStored]:
        """The worker's ``BlockStored`` events (one per system prompt, turn and document), parents first."""
        seq = self.seq
        out = []
        for parent, start, end in self.chains(worker):
            parent_hash = None if parent is None else int(seq[parent])
            out.append(BlockStored(tuple(seq[start:end].tolist()), parent_hash, tier))
        return out

    def dynamo_events(self, worker: int, first_id: int = 0) -> list[bytes]:
        """The same events as Dynamo's ``KvCacheEvent`` JSON (block hash + token hash per block)."""
        seq, local = self.seq, self.local
        out = []
        for i, (parent, start, end) in enumerate(self.chains(worker)):
            blocks = [
                {"block_hash": b, "tokens_hash": t}
                for b, t in zip(seq[start:end].tolist(), local[start:end].tolist(), strict=True)
            ]
            stored = {"parent_hash": None if parent is None else int(seq[parent]), "blocks": blocks}
            out.append(json.dumps({"event_id": first_id + i, "data": {"stored": stored}}).encode())
        return out

    # ------------------------------------------------------------------ queries and the oracle

    def expected_overlaps(self, ids: np.ndarray) -> dict[int, int]:
        """Brute force from the holdings: each worker's leading run of ``ids``, nonzero runs only."""
        out: dict[int, int] = {}
        for w in range(self.spec.workers):
            starts, ends = self.ranges(w)
            if not len(starts):
                continue
            i = np.searchsorted(starts, ids, side="right") - 1
            held = (i >= 0) & (ids < ends[np.maximum(i, 0)])
            run = int(np.argmin(held)) if not held.all() else len(ids)
            if run:
                out[w] = run
        return out


@dataclass(frozen=True)
class Query:
    ids: np.ndarray  # node ids (>= fleet.nodes: a block nobody holds)
    hashes: list[int]  # block hashes: what kvblocks routes by
    local: list[int]  # token hashes: what Dynamo's find_matches walks
    num_tokens: int


def _query(fleet: Fleet, ids: np.ndarray, tail_tokens: int) -> Query:
    seq = seq_hashes(ids)
    return Query(ids, seq.tolist(), local_hashes(ids).tolist(), len(ids) * fleet.spec.block_size + tail_tokens)


def typical_queries(fleet: Fleet, n: int, seed: int = 1) -> list[Query]:
    """Conversation prompts: system prompt + every turn + a new turn nobody holds (plus a partial block)."""
    rng = np.random.default_rng(seed)
    fresh = fleet.nodes + 1_000_000_000 * (seed + 1)
    out = []
    for c in rng.integers(0, len(fleet.conversations), n):
        conv = fleet.conversations[int(c)]
        s0, s1 = fleet.systems[conv.system]
        new = int(rng.integers(*fleet.spec.turn_blocks, endpoint=True))
        ids = np.concatenate(
            [np.arange(s0, s1), np.arange(conv.start, conv.turn_ends[-1]), np.arange(fresh, fresh + new)]
        )
        fresh += new
        out.append(_query(fleet, ids, int(rng.integers(1, fleet.spec.block_size))))
    return out


def long_queries(fleet: Fleet) -> list[Query]:
    """Each document's full prompt (``long_blocks`` blocks, plus a partial block): fully held by its holders."""
    out = []
    for system, start, end in fleet.docs:
        s0, s1 = fleet.systems[system]
        out.append(_query(fleet, np.concatenate([np.arange(s0, s1), np.arange(start, end)]), 8))
    return out


def prefix_query(fleet: Fleet, query: Query, blocks: int) -> Query:
    """The first ``blocks`` blocks of a query (plus a partial block), e.g. the 2k head of a cached 32k prompt."""
    return _query(fleet, query.ids[:blocks], 8)


# ---------------------------------------------------------------------- generation


def make_fleet(spec: FleetSpec) -> Fleet:
    """Build the fleet: documents first, then conversations round-robin over the workers until the target."""
    rng = np.random.default_rng(spec.seed)
    nodes = 0
    systems = []
    for _ in range(spec.system_prompts):
        length = int(rng.integers(*spec.system_blocks, endpoint=True))
        systems.append((nodes, nodes + length))
        nodes += length
    popularity = 1.0 / np.arange(1, spec.system_prompts + 1)
    popularity /= popularity.sum()
    holdings = [Holding() for _ in range(spec.workers)]
    held_systems: list[set[int]] = [set() for _ in range(spec.workers)]
    entries = 0

    def hold_system(w: int, s: int) -> int:
        if s in held_systems[w]:
            return 0
        held_systems[w].add(s)
        holdings[w].systems.append(s)
        return systems[s][1] - systems[s][0]

    docs = []
    for d in range(spec.long_docs):
        s = d % spec.system_prompts
        length = spec.long_blocks - (systems[s][1] - systems[s][0])
        docs.append((s, nodes, nodes + length))
        nodes += length
        chosen = rng.choice(spec.workers, spec.long_holders + spec.long_partial_holders, replace=False)
        for i, w in enumerate(chosen.tolist()):
            held = length if i < spec.long_holders else int(rng.integers(1, length))
            entries += hold_system(w, s) + held
            holdings[w].docs.append((d, held))

    conversations: list[Conversation] = []
    # draw in bulk: one row per conversation a worker takes
    batch = 4096
    draws: Iterator[tuple[int, float, int, np.ndarray, float]] = iter(())

    def refill() -> Iterator[tuple[int, float, int, np.ndarray, float]]:
        sys_pick = rng.choice(spec.system_prompts, batch, p=popularity)
        replica = rng.random(batch)
        turns = rng.integers(*spec.turns, size=batch, endpoint=True)
        lengths = rng.integers(*spec.turn_blocks, size=(batch, spec.turns[1]), endpoint=True)
        pick = rng.random(batch)
        return zip(sys_pick.tolist(), replica.tolist(), turns.tolist(), lengths, pick.tolist(), strict=True)

    def reached() -> bool:
        return (entries if spec.count == "entries" else nodes) >= spec.blocks

    w = 0
    while not reached() or len(conversations) < spec.workers:  # a small fleet still has conversations
        try:
            s, replica, turns, lengths, pick = next(draws)
        except StopIteration:
            draws = refill()
            continue
        h = holdings[w]
        if conversations and replica < spec.replica_share:
            c = int(pick * len(conversations))
            conv = conversations[c]
            held = max(1, int(pick * 7919) % len(conv.turn_ends) + 1)
            if held > h.conversations.get(c, 0):
                start_end = conv.turn_ends[h.conversations.get(c, 0) - 1] if c in h.conversations else conv.start
                entries += hold_system(w, conv.system) + conv.turn_ends[held - 1] - start_end
                h.conversations[c] = held
        else:
            ends = tuple((nodes + np.cumsum(lengths[:turns])).tolist())
            conversations.append(Conversation(s, nodes, ends))
            entries += hold_system(w, s) + ends[-1] - nodes
            nodes = ends[-1]
            h.conversations[len(conversations) - 1] = turns
        w = (w + 1) % spec.workers
    seq = seq_hashes(np.arange(nodes, dtype=np.uint64))
    return Fleet(spec, systems, conversations, docs, holdings, nodes, entries, seq)


# ---------------------------------------------------------------------- measuring


def build_router(fleet: Fleet, config: RouterConfig | None = None) -> tuple[Router, float]:
    """A Router fed every worker's events; returns it and the seconds spent in ``apply_events`` alone."""
    router = Router(range(fleet.spec.workers), config or RouterConfig(block_size=fleet.spec.block_size))
    spent = 0.0
    for w in range(fleet.spec.workers):
        events = fleet.events(w)
        start = time.perf_counter()
        router.apply_events(w, events)
        spent += time.perf_counter() - start
    return router, spent


def build_dynamo(fleet: Fleet) -> tuple[object, float]:
    """Dynamo's RadixTree fed the same events (JSON encoded beforehand); seconds of ``apply_event`` + a sync."""
    from dynamo._core import RadixTree  # optional: ai-dynamo-runtime

    tree = RadixTree()
    spent = 0.0
    for w in range(fleet.spec.workers):
        events = fleet.dynamo_events(w)
        start = time.perf_counter()
        for event in events:
            tree.apply_event(w, event)
        spent += time.perf_counter() - start
    start = time.perf_counter()
    tree.find_matches([0])  # queued behind the events on the tree's thread: they are applied once it returns
    return tree, spent + time.perf_counter() - start


def dynamo_overlaps(tree: object, query: Query) -> dict[int, int]:
    """Dynamo's scores as worker -> matched blocks (its keys are (worker, dp_rank))."""
    scores = tree.find_matches(query.local).scores  # type: ignore[attr-defined]
    return {int(w): int(v) for (w, _), v in scores.items() if v}


def median_time(fn: Callable[[], object], repeat: int, rounds: int = 7) -> float:
    """Median over ``rounds`` of the mean seconds of one call over ``repeat`` calls."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        times.append((time.perf_counter() - start) / repeat)
    return statistics.median(times)


def route_all(router: Router, queries: list[Query]) -> Callable[[], None]:
    def run() -> None:
        for q in queries:
            router.route(block_hashes=q.hashes, num_tokens=q.num_tokens).release()

    return run


def find_all(tree: object, queries: list[Query]) -> Callable[[], None]:
    find = tree.find_matches  # type: ignore[attr-defined]

    def run() -> None:
        for q in queries:
            find(q.local)

    return run


def rss_bytes() -> int:
    """This process's resident set, after glibc hands freed heap pages back (``malloc_trim``): live memory."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # not glibc: RSS as it is
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def probe(spec: FleetSpec, index: str, trace: bool) -> dict[str, float]:
    """In this (fresh) process: build ``index`` ("kvblocks" or "dynamo") and measure what it added.

    The fleet's hash arrays exist before the baseline. kvblocks' events are made per worker while building
    (their ints become the index's keys: counted); Dynamo's JSON events are all made before the baseline
    and kept alive, so the delta is the tree's own (Rust) memory, not freed Python buffers.
    """
    fleet = make_fleet(spec)
    out: dict[str, float] = {"entries": fleet.entries, "distinct": fleet.distinct}
    if index == "dynamo":
        from dynamo._core import RadixTree

        events = [fleet.dynamo_events(w) for w in range(spec.workers)]
        tree = RadixTree()
        tree.find_matches([0])
        gc.collect()
        before = rss_bytes()
        for w, batch in enumerate(events):
            for event in batch:
                tree.apply_event(w, event)
        tree.find_matches([0])
        time.sleep(0.2)
        out["rss"] = rss_bytes() - before
        return out
    import tracemalloc

    router = Router(range(spec.workers), RouterConfig(block_size=spec.block_size))
    gc.collect()
    if trace:
        tracemalloc.start()
    before = rss_bytes()
    traced = tracemalloc.get_traced_memory()[0] if trace else 0
    for w in range(spec.workers):
        router.apply_events(w, fleet.events(w))
    gc.collect()
    out["rss"] = rss_bytes() - before
    if trace:
        out["traced"] = tracemalloc.get_traced_memory()[0] - traced
    return out


def probe_in_subprocess(spec: FleetSpec, index: str, trace: bool = False) -> dict[str, float]:
    """:func:`probe` in a fresh interpreter (``sys.executable``), so nothing else's memory mixes in."""
    args = {k: v for k, v in spec.__dict__.items()}
    code = (
        "import json, sys; from benchmarks.router_fleet import FleetSpec, probe; "
        "a = json.loads(sys.argv[1]); a = {k: tuple(v) if isinstance(v, list) else v for k, v in a.items()}; "
        f"print(json.dumps(probe(FleetSpec(**a), {index!r}, {trace!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"memory probe ({index}) failed:\n{done.stderr[-4000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# ---------------------------------------------------------------------- CLI


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:10.1f} us"


def _mem_line(name: str, bytes_: float, fleet: Fleet) -> str:
    return (
        f"{name:<34} {bytes_ / 1e6:10.1f} MB  {bytes_ / fleet.entries:7.1f} B/entry  "
        f"{bytes_ / fleet.distinct:7.1f} B/distinct block"
    )


def overlaps_all(router: Router, queries: list[Query]) -> Callable[[], None]:
    def run() -> None:
        for q in queries:
            router.overlaps(q.hashes)

    return run


def nonzero(overlaps: dict[Hashable, float]) -> dict[int, int]:
    """Worker -> matched blocks, zeros dropped (how Dynamo reports; today's ``overlaps`` lists every worker)."""
    return {int(w): int(v) for w, v in overlaps.items() if v}  # type: ignore[call-overload]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--workers", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--count", choices=("entries", "distinct"), default="entries")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--queries", type=int, default=200, help="typical prompts timed")
    parser.add_argument("--dynamo", action="store_true", help="also Dynamo's RadixTree (ai-dynamo-runtime)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory probes (subprocesses)")
    parser.add_argument("--no-trace", action="store_true", help="skip the tracemalloc probe (slow at 10M)")
    return parser.parse_args(argv)


def _kvblocks_rows(fleet: Fleet, typical: list[Query], longs: list[Query]) -> tuple[Router, dict[str, float]]:
    heads = [prefix_query(fleet, q, 128) for q in longs]
    router, applied = build_router(fleet)
    print(f"{'kvblocks apply_events':<34} {applied:10.2f} s    {applied / fleet.entries * 1e9:7.0f} ns/entry")
    rows = {
        "route typical (2k)": median_time(route_all(router, typical), 1) / len(typical),
        "route 32k fully cached": median_time(route_all(router, longs), 10) / len(longs),
        "route 2k head of the 32k": median_time(route_all(router, heads), 10) / len(heads),
        "overlaps typical (2k)": median_time(overlaps_all(router, typical), 1) / len(typical),
        "overlaps 32k": median_time(overlaps_all(router, longs), 10) / len(longs),
    }
    for name, t in rows.items():
        print(f"{'kvblocks ' + name:<34} {_us(t)}")
    return router, rows


def _dynamo_rows(
    fleet: Fleet, router: Router, typical: list[Query], longs: list[Query], rows: dict[str, float]
) -> None:
    tree, applied = build_dynamo(fleet)
    print(f"{'Dynamo apply_event':<34} {applied:10.2f} s    {applied / fleet.entries * 1e9:7.0f} ns/entry")
    for name, queries, repeat in (("typical (2k)", typical, 1), ("32k fully cached", longs, 10)):
        t = median_time(find_all(tree, queries), repeat) / len(queries)
        print(f"{'Dynamo find_matches ' + name:<34} {_us(t)}")
        print(f"{'  Dynamo / kvblocks route':<34} {t / rows['route ' + name]:10.2f} x  (target >= 1.0 for 32k)")
    sample = typical[:50] + longs
    same = sum(dynamo_overlaps(tree, q) == nonzero(router.overlaps(q.hashes)) for q in sample)
    print(f"overlaps equal on {same}/{len(sample)} sampled queries")


def _memory_rows(spec: FleetSpec, fleet: Fleet, trace: bool, dynamo: bool) -> None:
    mem = probe_in_subprocess(spec, "kvblocks")
    print(_mem_line("kvblocks Router, RSS delta", mem["rss"], fleet))
    if trace:
        traced = probe_in_subprocess(spec, "kvblocks", True)["traced"]
        print(_mem_line("kvblocks Router, tracemalloc", traced, fleet))
    if dynamo:
        dyn = probe_in_subprocess(spec, "dynamo")
        print(_mem_line("Dynamo RadixTree, RSS delta", dyn["rss"], fleet))
        print(f"{'memory kvblocks / Dynamo (RSS)':<34} {mem['rss'] / dyn['rss']:10.2f} x  (target <= 1.0)")


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    spec = FleetSpec(workers=args.workers, blocks=args.blocks, count=args.count, seed=args.seed)
    start = time.perf_counter()
    fleet = make_fleet(spec)
    made = time.perf_counter() - start
    typical = typical_queries(fleet, args.queries)
    longs = long_queries(fleet)
    print(
        f"fleet: {spec.workers} workers, {fleet.entries:,} (block, worker) entries, {fleet.distinct:,} distinct "
        f"blocks ({fleet.entries / fleet.distinct:.2f} entries per block), {len(fleet.conversations):,} "
        f"conversations; made in {made:.1f} s"
    )
    mean_blocks = statistics.mean(len(q.hashes) for q in typical)
    mean_tokens = statistics.mean(q.num_tokens for q in typical)
    print(
        f"queries: {len(typical)} typical (mean {mean_blocks:.0f} blocks, {mean_tokens:.0f} tokens), "
        f"{len(longs)} long ({len(longs[0].hashes)} blocks)"
    )
    router, rows = _kvblocks_rows(fleet, typical, longs)
    if args.dynamo:
        _dynamo_rows(fleet, router, typical, longs, rows)
    del router
    gc.collect()
    if not args.no_memory:
        _memory_rows(spec, fleet, not args.no_trace, args.dynamo)


if __name__ == "__main__":
    main()
