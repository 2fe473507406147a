"""End to end, two nodes: prefill on one, decode on another, the KV moved between their caches.

A :class:`PrefillManager` with its own CPU-backend cache computes the tiny model's prompt KV,
hands the request off as bytes, and a :class:`DecodeManager` with its own cache receives the
prompt's blocks through ``gather`` / ``scatter`` (and raw bytes in between) and greedy-decodes.
Every logit must equal a single mixed node's (``tiny.generate``) beyond float noise, and the
accounting invariants of both nodes must hold after every step -- with preemption on either
side and handoffs the decode node refuses::

    prefill node P                                   decode node D
    lookup / allocate / forward / commit
    finish_prefill(r) -> handoff ──to_bytes──>       accept_handoff(from_bytes(..), prompt)
                                                       None: refused, nothing changed; retry later
    gather(cache_p, src) ──────bytes──────────>      scatter(cache_d, dst)
    transfer_done(r)                                 receive_done(r); decode steps; usage(r); free(r)

Accounting, checked after every step: a request's cached tokens are counted once across the
nodes -- the prefill node's first admission counts its hits, the decode node only what it found
beyond that report -- and never exceed the prompt.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from kvblocks import CachedTokens, DecodeManager, PrefillHandoff, PrefillManager, RequestUsage
from kvblocks.backends.registry import get_backend
from tests.support.examples import load_example
from tests.support.snapshots import manager_snapshot

tiny = load_example("tiny_model")

MODEL = tiny.TinyModel()
SHARED = tiny.shared_prefix_prompts()
ALIGNED = [*SHARED["a1"], 7, 11]  # 32 tokens: every block full
# the shared-prefix prompts, then one block-aligned prompt sent twice: the repeat must report what the
# prefill node's last-token rule allows (7 of 8 blocks) on both nodes, although all 8 are cached
PROMPTS = {**SHARED, "c1": ALIGNED, "c2": list(ALIGNED)}
BLOCK = 4
STEPS = 4  # decode steps per request
TOLERANCE = 1e-4  # float32 logits; the nodes differ from the mixed one only in how tokens are batched
BACKEND = get_backend("cpu")


PROMPT_SETS = {"all": PROMPTS, "shared": SHARED}


@pytest.fixture(scope="module")
def reference():
    """A single mixed node serving the prompts one after another, prefix caching on."""
    return _reference("all", STEPS)


@functools.cache
def _reference(prompt_set: str, steps: int):
    return tiny.generate(MODEL, PROMPT_SETS[prompt_set], caching=True, decode_steps=steps, block_size=BLOCK)


def _blocks(tokens: int) -> int:
    return math.ceil(tokens / BLOCK)


class Cluster:
    """Prefill node(s) and one decode node, each with its own cache, driven the way engines drive them.

    Every operation is followed by :meth:`check`, the accounting and integrity invariants.
    """

    def __init__(
        self,
        prompts: dict[str, list[int]],
        *,
        prefill_nodes: int = 1,
        prefill_blocks: int = 64,
        decode_blocks: int = 64,
        decode_cache: bool = True,
        reserve: int = 1,
        decode_block_major: bool = True,
        steps: int = STEPS,
        tamper=None,
    ) -> None:
        self.prompts = prompts
        self.steps = steps
        self.prefill = [PrefillManager(prefill_blocks, BLOCK) for _ in range(prefill_nodes)]
        self.cache_p = [BACKEND.allocate(MODEL.config.cache_spec(BLOCK), prefill_blocks) for _ in self.prefill]
        self.decode = DecodeManager(
            decode_blocks, BLOCK, reserve_blocks_per_sequence=reserve, enable_prefix_caching=decode_cache
        )
        spec_d = MODEL.config.cache_spec(BLOCK, block_major=decode_block_major)
        self.cache_d = BACKEND.allocate(spec_d, decode_blocks)
        self.tamper = tamper  # (request, dst ids, payload) -> (dst ids, payload): the negative control's hook
        self.node_of = {r: i % prefill_nodes for i, r in enumerate(prompts)}
        # what the test itself knows, to hold the managers' figures against
        self.first_hits: dict[str, int] = {}  # the prefill node's lookup at the request's first admission
        self.handoffs: dict[str, PrefillHandoff] = {}  # finish_prefill's handoff (as the prefill node made it)
        self.wire: dict[str, bytes] = {}  # handed off, not yet accepted by the decode node
        self.usage: dict[str, CachedTokens] = {}  # the decode node's figure, fixed at acceptance
        self.final_usage: dict[str, RequestUsage] = {}  # D.usage(r) right before free
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.running: list[str] = []  # on the decode node, in order of acceptance (the oldest first)
        self.d_preempted: dict[str, bool] = {}  # request -> its last token's KV is still to compute
        self.p_preempted: set[str] = set()
        self.finished: list[str] = []
        self.refusals = self.transferred = 0
        self.p_preemptions = self.p_readmissions = 0
        self.d_preemptions = self.d_self_preemptions = self.d_readmissions = 0
        self.p_readmission_found: dict[str, int] = {}  # request -> tokens its prefill re-admission found cached
        self.checks = 0

    # ------------------------------------------------------------------ invariants

    def check(self) -> None:
        self.checks += 1
        d = self.decode
        for p in self.prefill:
            p.check_integrity()
        d.check_integrity()
        for r in self.running:  # every live request on the decode node
            u = d.usage(r)
            assert 0 <= u.cached_tokens <= len(self.prompts[r]) == u.prompt_tokens
            assert u.cached == self.usage[r]  # fixed at acceptance: preemption and re-admission never change it
        for r in self.wire:  # refused (or not yet offered): the prefill node still holds the prompt's blocks
            p = self.prefill[self.node_of[r]]
            assert p.is_transferring(r)
            assert all(p.pool.ref_count(b) > 0 for b in self.handoffs[r].source_blocks)
        prefill_hits = sum(p.stats.hit_tokens for p in self.prefill)
        accepted = self.usage
        counters = d.decode_counters
        assert prefill_hits == sum(self.first_hits.values())  # first admissions only
        assert counters.seeded_hit_tokens == sum(self.first_hits[r] for r in accepted)
        not_yet_accepted = sum(hits for r, hits in self.first_hits.items() if r not in accepted)
        # the nodes' counters, summed, count every request's cached tokens exactly once
        assert prefill_hits + counters.decode_hit_tokens == sum(c.total for c in accepted.values()) + not_yet_accepted
        assert counters.handoffs_accepted == len(accepted)
        assert counters.handoffs_refused == self.refusals
        assert counters.transferred_blocks == self.transferred
        assert sum(p.stats.readmissions for p in self.prefill) == self.p_readmissions
        assert d.stats.readmissions == self.d_readmissions  # re-admissions are counted apart

    # ------------------------------------------------------------------ prefill node

    def prefill_step(self, r: str, budget: int | None = None) -> bool:
        """Prefill up to ``budget`` more prompt tokens (all by default); False: no room, nothing changed."""
        p, cache = self.prefill[self.node_of[r]], self.cache_p[self.node_of[r]]
        prompt = self.prompts[r]
        if r not in p:
            p.add_sequence(r, prompt)
            self.check()
        admitting = not p.is_admitted(r)
        start = p.lookup(r).device if admitting else p.num_computed_tokens(r)
        count = len(prompt) - start if budget is None else min(budget, len(prompt) - start)
        table = p.allocate(r, count)
        if table is None:
            self.check()
            return False
        assert p.num_computed_tokens(r) == start  # admission took exactly the prefix lookup reported
        if admitting and r in self.p_preempted:
            self.p_preempted.discard(r)
            self.p_readmissions += 1
            self.p_readmission_found[r] = start
        elif admitting:
            assert r not in self.first_hits
            self.first_hits[r] = start
        logits = MODEL.forward(prompt[start : start + count], start, cache, list(table))
        p.commit(r, start + count)
        self.check()
        if start + count == len(prompt):
            self.logits[r] = [logits[-1]]
            handoff = p.finish_prefill(r)
            # the report is the first admission's, even when a re-admission found the request's own blocks
            assert handoff.cached == CachedTokens(device=self.first_hits[r], num_prompt_tokens=len(prompt))
            assert len(handoff.source_blocks) == _blocks(len(prompt))
            self.handoffs[r] = handoff
            self.wire[r] = handoff.to_bytes()  # the handoff crosses the wire as bytes
            self.check()
        return True

    def prefill_turn(self, r: str, budget: int | None, active: list[str]) -> None:
        """One scheduler turn for ``r``: grow it, preempting the newest admitted request when the pool is short."""
        p = self.prefill[self.node_of[r]]
        while not self.prefill_step(r, budget):
            if not p.is_admitted(r):
                return  # waiting for room; running requests are never preempted for a waiting one
            admitted = [v for v in active if v in p and p.is_admitted(v) and not p.is_transferring(v)]
            victim = admitted[-1]  # the newest, possibly r itself
            p.preempt(victim)
            self.p_preempted.add(victim)
            self.p_preemptions += 1
            self.check()
            if victim == r:
                return

    # ------------------------------------------------------------------ the handoff

    def try_accept(self, r: str) -> bool:
        p, d = self.prefill[self.node_of[r]], self.decode
        prompt = self.prompts[r]
        handoff = PrefillHandoff.from_bytes(self.wire[r])
        assert handoff == self.handoffs[r]
        before = dataclasses.replace(d.decode_counters)
        admission = d.accept_handoff(handoff, prompt)
        if admission is None:  # the decode node lacks room beyond its reserve; the engine retries later
            self.refusals += 1
            assert d.decode_counters == dataclasses.replace(before, handoffs_refused=before.handoffs_refused + 1)
            assert r not in d
            self.check()
            return False
        del self.wire[r]
        delta = d.decode_counters.decode_hit_tokens - before.decode_hit_tokens
        assert delta >= 0
        # usage = the prefill node's lookup at first admission + what only the decode node found
        assert admission.cached.total == self.first_hits[r] + delta <= len(prompt)
        assert admission.cached.device == handoff.cached.device + delta
        self.usage[r] = admission.cached
        transfers = admission.transfers
        self.transferred += len(transfers)
        skipped = _blocks(len(prompt)) - len(transfers)  # the decode node's own prefix hit
        assert [src for src, _ in transfers] == list(handoff.source_blocks[skipped:])
        assert [dst for _, dst in transfers] == list(admission.table)[skipped:]
        assert d.is_receiving(r) and p.is_transferring(r)
        self.check()
        if transfers:
            self.move(r, transfers, p)
        d.receive_done(r)
        self.check()
        p.transfer_done(r)
        self.check()
        assert d.num_computed_tokens(r) == len(prompt)
        self.tokens[r] = list(prompt)
        self.running.append(r)
        return True

    def move(self, r: str, transfers: tuple[tuple[int, int], ...], p: PrefillManager) -> None:
        """Gather on the prefill node, raw bytes across, scatter on the decode node."""
        src, dst = (list(ids) for ids in zip(*transfers))
        raw = BACKEND.gather(self.cache_p[self.prefill.index(p)], src).numpy().tobytes()
        payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(len(src), self.cache_d.spec.bytes_per_block)
        if self.tamper is not None:
            dst, payload = self.tamper(r, dst, payload)
        if dst:
            BACKEND.scatter(self.cache_d, dst, payload)

    # ------------------------------------------------------------------ decode node

    def decode_turn(self, r: str) -> None:
        """One decode step for ``r`` (or its re-admission when it was preempted)."""
        d = self.decode
        if r in self.d_preempted:
            self.readmit_decode(r)
            return
        tokens = self.tokens[r]
        token = int(self.logits[r][-1].argmax())
        tokens.append(token)
        d.append_tokens(r, [token])
        self.check()
        while (table := d.allocate(r, 1)) is None:
            victim = [v for v in self.running if v not in self.d_preempted][-1]  # the newest, possibly r itself
            d.preempt(victim)
            self.d_preempted[victim] = victim == r  # r's new token is appended but not computed
            self.d_preemptions += 1
            self.d_self_preemptions += victim == r
            self.check()
            if victim == r:
                return
        logits = MODEL.forward([token], len(tokens) - 1, self.cache_d, list(table))
        d.commit(r, len(tokens))
        self.logits[r].append(logits[-1])
        self.check()
        self.finish_if_done(r)

    def readmit_decode(self, r: str) -> None:
        """Recompute a preempted sequence: whatever the decode cache still holds, then the rest."""
        d = self.decode
        tokens = self.tokens[r]
        assert d.num_tokens(r) == len(tokens)
        cached = d.lookup(r).device
        if not d.can_allocate(r, len(tokens) - cached):
            return  # waits for room
        table = d.allocate(r, len(tokens) - cached)
        assert table is not None and d.num_computed_tokens(r) == cached
        logits = MODEL.forward(tokens[cached:], cached, self.cache_d, list(table))
        d.commit(r, len(tokens))
        self.d_readmissions += 1
        if self.d_preempted.pop(r):
            self.logits[r].append(logits[-1])  # the step it was preempted in
        else:  # recomputing the last step's token gives the logits that step gave
            assert float((logits[-1] - self.logits[r][-1]).abs().max()) < TOLERANCE
        self.check()
        self.finish_if_done(r)

    def finish_if_done(self, r: str) -> None:
        if len(self.logits[r]) < self.steps + 1:
            return
        d = self.decode
        usage = d.usage(r)
        assert usage.cached == self.usage[r] and usage.prompt_tokens == len(self.prompts[r])
        assert usage.cached_tokens <= len(self.prompts[r])
        self.final_usage[r] = usage
        d.free(r)
        self.running.remove(r)
        self.finished.append(r)
        self.check()

    # ------------------------------------------------------------------ drivers

    def serve_sequentially(self) -> Cluster:
        """One request at a time, like ``tiny.generate``: prefill, hand off, decode, free."""
        self.check()
        for r in self.prompts:
            assert self.prefill_step(r)
            assert self.try_accept(r)
            while r not in self.finished:
                self.decode_turn(r)
        return self

    def serve_concurrently(self, chunk: int, max_ticks: int = 400) -> Cluster:
        """All requests at once: chunked prefill round-robin on P, handoffs FIFO, decode round-robin on D."""
        self.check()
        prefilling = list(self.prompts)
        for _ in range(max_ticks):
            if len(self.finished) == len(self.prompts):
                return self
            for r in list(prefilling):
                self.prefill_turn(r, chunk, prefilling)
                if r in self.handoffs:
                    prefilling.remove(r)
            for r in list(self.wire):
                self.try_accept(r)
            for r in list(self.running):
                self.decode_turn(r)
        raise AssertionError(f"no progress: finished {self.finished}")


def assert_matches_mixed_node(cluster: Cluster, reference, requests=None) -> None:
    for r in requests or reference.logits:
        got, want = cluster.logits[r], reference.logits[r]
        assert len(got) == len(want) == cluster.steps + 1
        difference = max(float((x - y).abs().max()) for x, y in zip(got, want, strict=True))
        assert difference < TOLERANCE, (r, difference)
        assert cluster.tokens[r] == reference.tokens[r]


@functools.cache
def _sequential(decode_cache: bool, decode_block_major: bool = True) -> Cluster:
    return Cluster(PROMPTS, decode_cache=decode_cache, decode_block_major=decode_block_major).serve_sequentially()


# ---------------------------------------------------------------- 1. two nodes equal one mixed node


@pytest.mark.parametrize("decode_block_major", [True, False], ids=["block-major", "layer-major"])
@pytest.mark.parametrize("decode_cache", [True, False], ids=["decode-cache", "no-decode-cache"])
def test_two_nodes_equal_one_mixed_node(reference, decode_cache: bool, decode_block_major: bool) -> None:
    cluster = _sequential(decode_cache, decode_block_major)
    assert_matches_mixed_node(cluster, reference)
    p, d = cluster.prefill[0], cluster.decode
    prompt_blocks = sum(_blocks(len(t)) for t in PROMPTS.values())
    if decode_cache:
        assert d.decode_counters.transferred_blocks < prompt_blocks  # shared prefixes did not move again
    else:
        assert d.decode_counters.transferred_blocks == prompt_blocks
    # the prefill node reaches the mixed node's hit rate: it computed exactly what the mixed node computed
    computed = sum(len(t) - cluster.first_hits[r] for r, t in PROMPTS.items()) + STEPS * len(PROMPTS)
    assert computed == reference.computed_tokens
    assert p.stats.hit_tokens > 0
    # every request's figure is the prefill node's report: the decode cache, warm on the same prefix, adds nothing
    assert d.decode_counters.decode_hit_tokens == 0
    for r, t in PROMPTS.items():
        usage = cluster.final_usage[r]
        assert usage.cached_tokens == cluster.first_hits[r] <= len(t)
        assert usage.openai() == {
            "prompt_tokens": len(t),
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        }
    assert p.num_sequences == d.num_sequences == p.num_transferring == 0
    assert d.num_free_blocks == d.num_blocks and p.num_free_blocks == p.num_blocks


def test_usage_is_the_same_with_the_decode_cache_on_or_off() -> None:
    on, off = _sequential(True), _sequential(False)
    assert {r: u.cached for r, u in on.final_usage.items()} == {r: u.cached for r, u in off.final_usage.items()}
    assert sum(u.cached_tokens for u in on.final_usage.values()) > 0
    # the verbatim repeat: both nodes hold all 8 blocks, both report 7 (the last token is always computed)
    assert on.final_usage["c2"].cached_tokens == off.final_usage["c2"].cached_tokens == len(ALIGNED) - BLOCK


# ---------------------------------------------------------------- 2. accounting across nodes


@pytest.mark.parametrize("decode_cache", [True, False], ids=["decode-cache", "no-decode-cache"])
def test_counters_of_all_nodes_count_each_request_once(reference, decode_cache: bool) -> None:
    """Two prefill nodes, each cold for what the other prefilled, feed one decode node.

    With the decode cache on, the decode node finds prefixes the (cold) prefill node did not:
    those count on the decode node only, beyond the report, and the request's figure is what a
    single mixed node would have found -- counted once, never past the prompt.
    """
    cluster = Cluster(PROMPTS, prefill_nodes=2, decode_cache=decode_cache).serve_sequentially()
    assert_matches_mixed_node(cluster, reference)
    assert cluster.checks > 2 * STEPS * len(PROMPTS)  # the invariants ran after every step
    d = cluster.decode
    counters = d.decode_counters
    prefill_hits = sum(p.stats.hit_tokens for p in cluster.prefill)
    usage = {r: u.cached_tokens for r, u in cluster.final_usage.items()}
    assert prefill_hits + counters.decode_hit_tokens == sum(usage.values())
    assert counters.seeded_hit_tokens == prefill_hits
    assert all(0 <= usage[r] <= len(t) for r, t in PROMPTS.items())
    one_prefill_node = {r: u.cached_tokens for r, u in _sequential(True).final_usage.items()}
    if decode_cache:
        assert counters.decode_hit_tokens > 0  # warm on decode, cold on the request's prefill node
        assert usage == one_prefill_node
        assert counters.transferred_blocks < sum(_blocks(len(t)) for t in PROMPTS.values())
    else:
        assert counters.decode_hit_tokens == 0
        assert usage == cluster.first_hits
        assert sum(usage.values()) < sum(one_prefill_node.values())


# ---------------------------------------------------------------- 3. preemption on both sides


@pytest.mark.parametrize("decode_cache", [True, False], ids=["decode-cache", "no-decode-cache"])
def test_concurrent_requests_with_preemption_on_both_nodes(decode_cache: bool) -> None:
    """All six requests at once on small pools: chunked prefill preempts on P, decode growth preempts on D.

    20 decode steps grow a sequence by 5 blocks, more than the reserve of 1 the decode node keeps
    for it, so running sequences get preempted (by newer ones' growth and by their own) and are
    re-admitted by recomputation; handoffs are refused while the decode node is full.
    """
    steps = 20
    cluster = Cluster(SHARED, prefill_blocks=20, decode_blocks=22, decode_cache=decode_cache, steps=steps)
    cluster.serve_concurrently(chunk=8)
    assert_matches_mixed_node(cluster, _reference("shared", steps))
    p, d = cluster.prefill[0], cluster.decode
    # the pools were small enough for every path to run
    assert cluster.p_preemptions > 0 and cluster.p_readmissions > 0
    assert cluster.d_preemptions > cluster.d_self_preemptions > 0  # running requests preempted by others, and selves
    assert cluster.d_readmissions > 0 and d.stats.readmissions == cluster.d_readmissions
    assert cluster.refusals > 0
    # a prefill re-admission found the request's own blocks, yet the handoff reported the first admission's
    assert any(found > cluster.first_hits[r] for r, found in cluster.p_readmission_found.items())
    assert p.stats.readmission_hit_tokens > 0
    for r, t in SHARED.items():
        assert cluster.handoffs[r].cached.total == cluster.first_hits[r]
        assert cluster.final_usage[r].cached_tokens <= len(t)
    assert d.decode_counters.seeded_hit_tokens == p.stats.hit_tokens
    assert p.stats.hit_tokens + d.decode_counters.decode_hit_tokens == sum(
        u.cached_tokens for u in cluster.final_usage.values()
    )
    assert p.num_sequences == d.num_sequences == 0


# ---------------------------------------------------------------- 4. a refused handoff


def _decode_snapshot(d: DecodeManager) -> dict:
    return {
        **manager_snapshot(d),
        "free": d.num_free_blocks,
        "sequences": d.num_sequences,
        "running": d.num_running,
        "counters": dataclasses.replace(d.decode_counters),
    }


@pytest.mark.parametrize("decode_cache", [True, False], ids=["decode-cache", "no-decode-cache"])
def test_a_refused_handoff_changes_nothing_and_succeeds_on_retry(reference, decode_cache: bool) -> None:
    prompts = {r: PROMPTS[r] for r in ("a4", "b1", "b2")}  # 12, 7 and 7 prompt blocks
    cluster = Cluster(prompts, prefill_blocks=20, decode_blocks=20, decode_cache=decode_cache)
    p, d = cluster.prefill[0], cluster.decode
    assert cluster.prefill_step("a4") and cluster.try_accept("a4")  # 12 blocks + 1 reserved of 20
    cluster.decode_turn("a4")
    assert cluster.prefill_step("b1")
    handoff = cluster.handoffs["b1"]
    need = _blocks(len(prompts["b1"]))
    # 8 free blocks would hold b1's 7, but not with a4's reserve and b1's own kept free as well
    assert d.reserve_blocks == 1 and need <= d.num_free_blocks < need + d.reserve_blocks + 1
    before = _decode_snapshot(d)
    assert not cluster.try_accept("b1")
    after = _decode_snapshot(d)
    counters = before.pop("counters")
    assert after.pop("counters") == dataclasses.replace(counters, handoffs_refused=counters.handoffs_refused + 1)
    assert after == before  # pool ref counts and orders, tree, sequences, stats: all as they were
    assert "b1" not in d and d.decode_counters.handoffs_refused == 1
    assert p.is_transferring("b1") and all(p.pool.ref_count(b) > 0 for b in handoff.source_blocks)

    # the prefill node goes on serving (evicting what it must) while it holds b1's blocks for the retry
    assert cluster.prefill_step("b2")
    assert not cluster.try_accept("b2") and not cluster.try_accept("b1")
    assert p.stats.evicted_blocks > 0
    assert cluster.first_hits["b2"] == 16  # b1's system-prompt blocks, cached on P while they wait to move
    assert cluster.handoffs["b2"].source_blocks[:4] == handoff.source_blocks[:4]
    assert p.is_transferring("b1") and all(p.pool.ref_count(b) > 0 for b in handoff.source_blocks)
    while "a4" not in cluster.finished:
        cluster.decode_turn("a4")  # the running request grows into the reserve kept for it
    assert cluster.d_preemptions == 0

    assert cluster.try_accept("b1")  # after a4 finished: there is room now
    assert not p.is_transferring("b1") and "b1" not in p
    assert cluster.try_accept("b2")
    while len(cluster.finished) < 3:
        for r in list(cluster.running):
            cluster.decode_turn(r)
    assert cluster.refusals == 3
    assert_matches_mixed_node(cluster, reference, prompts)
    assert d.decode_counters.handoffs_accepted == 3 and d.num_sequences == p.num_sequences == 0


# ---------------------------------------------------------------- 5. negative control


def _zero_first(r: str, dst: list[int], payload: torch.Tensor):
    if r == "a2":
        payload[0].zero_()
    return dst, payload


def _skip_first(r: str, dst: list[int], payload: torch.Tensor):
    return (dst[1:], payload[1:]) if r == "a2" else (dst, payload)


@pytest.mark.parametrize("tamper", [_zero_first, _skip_first], ids=["zeroed-block", "skipped-block"])
def test_a_block_that_did_not_arrive_changes_the_logits(reference, tamper) -> None:
    """The comparisons above have teeth: one transferred block lost and the decode logits differ."""
    cluster = Cluster(PROMPTS, decode_cache=False, tamper=tamper).serve_sequentially()
    assert_matches_mixed_node(cluster, reference, ["a1"])  # before the damage
    got, want = cluster.logits["a2"], reference.logits["a2"]
    assert float((got[0] - want[0]).abs().max()) < TOLERANCE  # the prefill node's logits are intact
    assert min(float((x - y).abs().max()) for x, y in zip(got[1:], want[1:], strict=True)) > 1e-2
