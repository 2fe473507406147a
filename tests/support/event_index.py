"""What a router knows from KV events, held strictly (shared by the event tests).

The consumer side plays a router: a strict index (hash -> parent hash) per producer, maintained only through
``on_events`` / ``on_snapshot``. Storing a hash twice, storing under an unknown parent or removing an unknown hash
raises -- so a batch applied twice, out of order or after a loss the consumer failed to notice breaks the tests.
"""

from __future__ import annotations

import random

from kvblocks import BlockRemoved, BlockStored, EventSink, KVCacheManager, PrefixTree
from kvblocks.events import EventConsumer, KVEvent


def apply_events(view: dict, events: tuple[KVEvent, ...]) -> None:
    """Apply events to a hash -> parent index, refusing anything an in-sync view cannot receive."""
    for e in events:
        if isinstance(e, BlockStored):
            parent = e.parent_hash
            if parent is not None and parent not in view:
                raise AssertionError(f"stored under unknown parent {parent!r}")
            for h in e.block_hashes:
                if h in view:
                    raise AssertionError(f"hash {h!r} stored twice")
                view[h] = parent
                parent = h
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                if h not in view:
                    raise AssertionError(f"removed unknown hash {h!r}")
                if any(p == h for p in view.values()):
                    raise AssertionError(f"removed {h!r} before its children")
                del view[h]
        else:
            view.clear()


class Index:
    """What a router knows: one strict index per producer, plus the gaps it was told about."""

    def __init__(self) -> None:
        self.of: dict[str, dict] = {}
        self.gaps: list[tuple[str, int, int]] = []
        self.consumer = EventConsumer(
            on_events=self.on_events, on_snapshot=self.on_snapshot, on_gap=lambda *gap: self.gaps.append(gap)
        )

    def on_events(self, producer: str, events: tuple[KVEvent, ...]) -> None:
        apply_events(self.of.setdefault(producer, {}), events)

    def on_snapshot(self, producer: str, events: tuple[KVEvent, ...]) -> None:
        view: dict = {}
        apply_events(view, events)
        self.of[producer] = view


def tree_view(tree: PrefixTree) -> dict:
    """The tree's cached hashes and their parents' hashes, through its public queries."""
    out = {}
    for b in range(tree.pool.num_blocks):
        h = tree.hash_of(b)
        if h is not None:
            p = tree.parent_of(b)
            out[h] = None if p is None else tree.hash_of(p)
    return out


class Workload:
    """A manager with a tiny pool driven by random add / allocate / commit / free: it stores and evicts a lot."""

    SYSTEM = ((), (9, 8, 7, 6, 5, 4), (9, 8, 7, 1), (3, 3, 3, 3))

    def __init__(self, sink: EventSink, *, scheme: str = "xxh3-128", num_blocks: int = 8) -> None:
        self.m = KVCacheManager(num_blocks=num_blocks, block_size=2, hash_scheme=scheme, event_sink=sink)
        self.tokens: dict[int, list[int]] = {}
        self.admitted: set[int] = set()
        self.next_id = 0

    def step(self, op: int, pick: int, size: int) -> None:
        """0: add a sequence; 1: admit one; 2: commit half or all of a running one;
        3: free a finished one.

        At most 4 sequences live at once (an add frees one instead); an op with no
        candidate falls back to the next one.
        """
        m = self.m
        if op == 0 and len(self.tokens) >= 4:
            op = 3
        for k in range(4):
            current = (op + k) % 4
            if current == 0 and len(self.tokens) < 4:
                suffix = random.Random(pick * 8 + size).choices(range(4), k=size)
                tokens = list(self.SYSTEM[pick % len(self.SYSTEM)]) + suffix
                m.add_sequence(self.next_id, tokens or [pick])
                self.tokens[self.next_id] = tokens or [pick]
                self.next_id += 1
                return
            waiting = [s for s in self.tokens if s not in self.admitted]
            running = [s for s in sorted(self.admitted) if m.num_computed_tokens(s) < len(self.tokens[s])]
            finished = [s for s in sorted(self.admitted) if s not in running]
            candidates = {0: [], 1: waiting, 2: running, 3: finished}[current]
            if candidates:
                break
        seq = candidates[pick % len(candidates)]
        tokens = self.tokens[seq]
        if current == 1:
            if m.allocate(seq, len(tokens) - m.lookup(seq).device) is not None:
                self.admitted.add(seq)
        elif current == 2:
            done = m.num_computed_tokens(seq)
            m.commit(seq, done + max(1, (len(tokens) - done) * (1 + size % 2) // 2))
        else:
            m.free(seq)
            del self.tokens[seq]
            self.admitted.discard(seq)

    def run(self, rng: random.Random, steps: int) -> None:
        for _ in range(steps):
            self.step(rng.randrange(4), rng.randrange(100), rng.randrange(8))
