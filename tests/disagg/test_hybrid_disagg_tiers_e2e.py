"""End to end: a hybrid model (sliding-window + full layers) served by a tiered prefill node and a tiered
decode node sharing storage.

The tiny hybrid transformer (window 6, block 4), two nodes built by ``manager_for_role`` with their own
per-group CPU caches (device and host) and one ``FileStorage`` directory; every group has a host tier
and stores under its own keys::

    turn 1   P: prefill ──handoff (every group's table)──> D: decode 8 tokens, written through to storage
             in both groups (D completes blocks P never computed)
    others   P serves other prompts: its small device pools evict the conversation's blocks to host, its
             small host tiers to storage, in both groups
    turn 2   P: prefill (history + new message) -- the history loads from storage in both groups, the
             window group's blocks being the ones only D computed -- ──handoff──> D: decode

Every logit must equal an uncached single mixed node's (< 1e-4, same tokens); turn 2's lookup must report
storage hits covering D's decoded blocks; and zeroing what P loads for the sliding-window group only must
change the logits (the window group really is loaded).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvblocks import CacheConfig, CachedTokens, DisaggConfig, PrefillHandoff, manager_for_role
from kvblocks.backends.registry import get_backend
from kvblocks.hashing import DEFAULT_SCHEME
from kvblocks.hybrid import LocalGroup, TieredHybridDecodeManager, TieredHybridPrefillManager
from kvblocks.tiers import EntryFormat, FileStorage, GroupTransfers, LoadResult, TierConfig
from tests.support.examples import load_example

tiny = load_example("tiny_hybrid_model")

MODEL = tiny.TinyHybridModel()
PROMPTS = tiny.shared_prefix_prompts()
BLOCK = 4
WINDOW = MODEL.config.window
STEPS = 8
TOLERANCE = 1e-4
WAIT_S = 30.0
BACKEND = get_backend("cpu")
HOST = get_backend("cpu")
GROUPS = (tiny.FULL, tiny.WINDOW)
SPECS = {g: MODEL.config.cache_spec(g, BLOCK) for g in GROUPS}
MESSAGE = [201, 17, 93, 5, 250]  # the user's next message, after the history


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matmuls: torch's intra-op threads only contend on a small shared machine (seconds per test)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def node(directory: Path, role: str, *, full: int, window: int, host: int, window_host: int, policy: str):
    tiers = TierConfig(
        num_host_blocks=host,
        group_host_blocks=(window_host,),
        storage=FileStorage(directory),
        entry_format=EntryFormat.for_spec(SPECS[tiny.FULL], DEFAULT_SCHEME),
        group_entry_formats=(EntryFormat.for_spec(SPECS[tiny.WINDOW], DEFAULT_SCHEME),),
        storage_policy=policy,
        storage_timeout_s=WAIT_S,
    )
    return manager_for_role(
        CacheConfig(full, BLOCK),
        DisaggConfig(role=role),
        tiers=tiers,
        groups=[LocalGroup("sliding_window", span=WINDOW, num_blocks=window)],
    )


class Node:
    """A tiered hybrid manager with one device and one host cache per group, and the per-group runner of its
    plans and storage loads (what ``TransferExecutor`` does for one group)."""

    def __init__(self, m, *, zero_loads_of: int | None = None) -> None:
        self.m = m
        self.device = {g: BACKEND.allocate(SPECS[g], m.group_pool(g).num_blocks) for g in GROUPS}
        self.host = {g: HOST.allocate(SPECS[g], m.group_host(g).pool.num_blocks) for g in GROUPS}
        self.zero_loads_of = zero_loads_of  # the negative control: that group's storage loads become zeros
        self.saves = dict.fromkeys(GROUPS, 0)
        self.swap_outs = dict.fromkeys(GROUPS, 0)
        self.swap_ins = dict.fromkeys(GROUPS, 0)
        self.loads: list[LoadResult] = []

    def _snapshot(self, g: GroupTransfers) -> list[memoryview]:
        """The bytes of every block group ``g.group`` saves, copied before any swap can overwrite them."""
        rows: list[memoryview] = [memoryview(b"")] * len(g.saves)
        for tier, cache in (("device", self.device[g.group]), ("host", self.host[g.group])):
            positions = [i for i, save in enumerate(g.saves) if save.tier == tier]
            if positions:
                data = BACKEND.gather(cache, [g.saves[i].block for i in positions]).cpu().numpy()
                for row, i in enumerate(positions):
                    rows[i] = memoryview(data[row])
        return rows

    def run_plan(self) -> None:
        plan = self.m.take_transfers()
        saved = {}
        for g in plan.group_transfers:  # each on its own group's caches: saves, then swap-outs, then swap-ins
            if g.saves:
                saved[g.group] = self._snapshot(g)
                self.saves[g.group] += len(g.saves)
            if g.swap_outs:
                source, target = (list(ids) for ids in zip(*g.swap_outs, strict=True))
                BACKEND.transfer(self.device[g.group], self.host[g.group], source, target).wait()
                self.swap_outs[g.group] += len(source)
            if g.swap_ins:
                source, target = (list(ids) for ids in zip(*g.swap_ins, strict=True))
                BACKEND.transfer(self.host[g.group], self.device[g.group], source, target).wait()
                self.swap_ins[g.group] += len(source)
        self.m.complete_transfers(plan, saved=saved or None)

    def apply_loads(self) -> None:
        for result in self.m.poll_loads():
            self.loads.append(result)
            if not result.blocks:
                continue
            cache = self.device[result.group]
            data = torch.frombuffer(bytearray(b"".join(p[0] for p in result.payloads)), dtype=torch.uint8)
            BACKEND.scatter(cache, list(result.blocks), data.view(len(result.blocks), -1))
            if result.group == self.zero_loads_of:
                BACKEND.zero(cache, list(result.blocks))

    def step(self) -> None:
        self.run_plan()
        self.apply_loads()

    def settle(self, seq_id: str) -> None:
        deadline = time.monotonic() + WAIT_S
        self.step()
        while not self.m.is_ready(seq_id):
            assert time.monotonic() < deadline, f"{seq_id!r} never became ready"
            time.sleep(0.0005)
            self.step()

    def tables(self, seq_id: str) -> dict[int, list[int]]:
        return {g: list(self.m.group_block_table(seq_id, g)) for g in GROUPS}


class Cluster:
    def __init__(self, directory: Path, *, zero_window_loads: bool = False) -> None:
        # P: device pools too small for the conversation and the other traffic, tiny host tiers (write-back:
        # evicted device blocks go to host, blocks the host evicts go to storage); D: written through
        p = node(directory, "prefill", full=12, window=10, host=4, window_host=4, policy="write-back")
        d = node(directory, "decode", full=24, window=12, host=8, window_host=8, policy="write-through")
        assert isinstance(p, TieredHybridPrefillManager) and isinstance(d, TieredHybridDecodeManager)
        self.p = Node(p, zero_loads_of=tiny.WINDOW if zero_window_loads else None)
        self.d = Node(d)
        self.handoffs: dict[str, PrefillHandoff] = {}
        self.lookups: dict[str, CachedTokens] = {}
        self.loads: dict[str, list[LoadResult]] = {}

    def close(self) -> None:
        self.p.m.close()
        self.d.m.close()

    def serve(self, request: str, prompt: list[int]) -> tuple[list[torch.Tensor], list[int]]:
        """Prefill on P, hand off, decode STEPS tokens on D; the logits of the last prompt token and each step."""
        P, D = self.p, self.d
        p, d = P.m, D.m
        p.add_sequence(request, prompt)
        deadline = time.monotonic() + WAIT_S
        while p.is_storage_check_pending(request):  # every group's storage probe answered before lookup
            assert time.monotonic() < deadline
            time.sleep(0.0005)
        cached = self.lookups[request] = p.lookup(request)
        loaded_before = len(P.loads)
        assert p.allocate(request, len(prompt) - cached.total) is not None
        P.settle(request)
        self.loads[request] = P.loads[loaded_before:]
        if p.num_allocated_tokens(request) < len(prompt):  # a load fell short: compute the rest
            assert p.allocate(request, len(prompt) - p.num_allocated_tokens(request)) is not None
            P.step()
        start = p.num_computed_tokens(request)
        logits = [MODEL.forward(prompt[start:], start, P.device, P.tables(request))[-1]]
        p.commit(request, len(prompt))
        handoff = PrefillHandoff.from_bytes(p.finish_prefill(request).to_bytes())
        self.handoffs[request] = handoff
        admission = d.accept_handoff(handoff, prompt)
        assert admission is not None
        D.step()  # blocks the admission evicted (any group) are saved / swapped out before the KV lands in them
        for g, pairs in enumerate(admission.group_transfers):
            if pairs:
                source, target = (list(ids) for ids in zip(*pairs, strict=True))
                BACKEND.scatter(D.device[g], target, BACKEND.gather(P.device[g], source))
        d.receive_done(request)
        p.transfer_done(request)
        P.step()
        tokens = list(prompt)
        for _ in range(STEPS):
            token = int(logits[-1].argmax())
            tokens.append(token)
            d.append_tokens(request, [token])
            assert d.allocate(request, 1) is not None
            D.step()
            logits.append(MODEL.forward([token], len(tokens) - 1, D.device, D.tables(request))[-1])
            d.commit(request, len(tokens))
        d.free(request)
        D.step()  # the write-through saves of the last commits
        assert d.flush(WAIT_S) and p.flush(WAIT_S)
        p.check_integrity()
        d.check_integrity()
        return logits, tokens


def reference(prompt: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """A single mixed node, no prefix caching: every token computed."""
    return _reference(tuple(prompt))


@functools.cache
def _reference(prompt: tuple[int, ...]) -> tuple[list[torch.Tensor], list[int]]:
    run = tiny.generate(MODEL, {"r": list(prompt)}, caching=False, decode_steps=STEPS, block_size=BLOCK)
    return run.logits["r"], run.tokens["r"]


def conversation(cluster: Cluster) -> dict[str, tuple[list[torch.Tensor], list[int], list[int]]]:
    """Turn 1, other traffic, turn 2; per request: logits, tokens, and the prompt it was given."""
    out = {}
    turn1 = PROMPTS["a1"]
    logits, tokens = cluster.serve("turn1", turn1)
    out["turn1"] = (logits, tokens, turn1)
    for other in ("b1", "b2", "a2"):  # P's pools and host tiers overflow: the conversation goes down to storage
        out[other] = (*cluster.serve(other, PROMPTS[other]), PROMPTS[other])
    turn2 = tokens + MESSAGE  # the history (prompt + answer) and the user's next message
    out["turn2"] = (*cluster.serve("turn2", turn2), turn2)
    return out


def test_the_next_turn_loads_every_group_from_what_the_decode_node_wrote(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    try:
        served = conversation(cluster)
        P = cluster.p
        # P's evictions went down both groups' tiers: to host, and from host to storage
        assert all(P.swap_outs[g] > 0 and P.saves[g] > 0 for g in GROUPS), (P.swap_outs, P.saves)
        assert all(cluster.d.saves[g] > 0 for g in GROUPS)  # D wrote through in both groups
        for n in (P, cluster.d):  # every save got its payload and was queued to its group's own storage
            assert n.m.tier_stats.saves_without_payload == 0
            assert all(n.m.group_storage(g).stats.saves_queued > 0 for g in GROUPS)
        history = served["turn1"][1]
        prompt_blocks = len(PROMPTS["a1"]) // BLOCK  # full blocks P computed in turn 1
        history_blocks = len(history) // BLOCK  # full blocks of the history: the last ones only D computed
        assert prompt_blocks + 2 <= history_blocks
        hit = history_blocks * BLOCK
        cached = cluster.lookups["turn2"]
        assert cached.total == hit and cluster.handoffs["turn2"].cached == cached
        assert cached.storage >= (history_blocks - prompt_blocks) * BLOCK  # covers D's decoded blocks
        # both groups loaded from storage; the window group its window at the hit: the blocks D completed
        loads = cluster.loads["turn2"]
        assert all(r.complete and not r.timed_out for r in loads)
        loaded = {g: sum(len(r.blocks) for r in loads if r.group == g) for g in GROUPS}
        assert loaded[tiny.FULL] * BLOCK == cached.storage
        first_window_block = (hit - WINDOW + 1) // BLOCK
        assert loaded[tiny.WINDOW] == history_blocks - first_window_block
        assert first_window_block >= prompt_blocks  # blocks P never completed (D did)
        assert P.m.group_storage(tiny.WINDOW).stats.loads_hit >= loaded[tiny.WINDOW]
        for request, (logits, tokens, prompt) in served.items():
            expected_logits, expected_tokens = reference(prompt)
            assert tokens == expected_tokens, request
            worst = max(float((a - b).abs().max()) for a, b in zip(logits, expected_logits, strict=True))
            assert worst < TOLERANCE, (request, worst)
    finally:
        cluster.close()


def test_zeroed_window_group_loads_change_turn_two(tmp_path: Path) -> None:
    """The negative control: the same run with only the sliding-window group's storage loads zeroed on P."""
    cluster = Cluster(tmp_path, zero_window_loads=True)
    try:
        served = conversation(cluster)
        assert any(r.group == tiny.WINDOW and r.blocks for r in cluster.loads["turn2"])
        assert [request for request, loads in cluster.loads.items() if loads] == ["turn2"]
        for request, (logits, _, prompt) in served.items():
            expected, _ = reference(prompt)
            worst = float((logits[0] - expected[0]).abs().max())
            if request == "turn2":  # the only request that loaded from storage
                assert worst > 1e-2, worst
            else:
                assert worst < TOLERANCE, (request, worst)
    finally:
        cluster.close()
