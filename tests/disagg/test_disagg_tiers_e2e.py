"""End to end: a conversation across a tiered prefill node and a tiered decode node sharing storage.

The tiny transformer, two nodes with their own CPU caches, and one ``FileStorage`` directory::

    turn 1   P: prefill ──handoff──> D: decode 4 tokens, every full block written through to storage
    others   P and D serve other prompts: P's small device pool evicts the conversation's own blocks
    turn 2   P: prefill (history + new message) -- the history *loads from storage*, including the
             blocks of the tokens D decoded, which P never computed -- ──handoff──> D: decode

Every logit must equal an uncached single node's (< 1e-4, same tokens), turn 2's handoff must
report storage hits covering D's decoded blocks, and zeroing what P loads must change the logits
(the comparison has teeth).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kvblocks import PrefillHandoff, TieredDecodeManager, TieredPrefillManager
from kvblocks.backends.registry import get_backend
from kvblocks.hashing import DEFAULT_SCHEME
from kvblocks.tiers import EntryFormat, FileStorage, LoadResult, TierConfig, TieredKVCacheManager
from kvblocks.tiers.executor import TransferExecutor
from tests.support.examples import load_example

tiny = load_example("tiny_model")

MODEL = tiny.TinyModel()
PROMPTS = tiny.shared_prefix_prompts()
BLOCK = 4
STEPS = 4
TOLERANCE = 1e-4
WAIT_S = 30.0
BACKEND = get_backend("cpu")
SPEC = MODEL.config.cache_spec(BLOCK)


def tiers(directory: Path, policy: str) -> TierConfig:
    return TierConfig(
        storage=FileStorage(directory),
        entry_format=EntryFormat.for_spec(SPEC, DEFAULT_SCHEME),
        storage_policy=policy,
        storage_timeout_s=WAIT_S,
    )


class ZeroedLoads(TransferExecutor):
    """The negative control: what storage returns is replaced by zeros."""

    def apply(self, loads: list[LoadResult]) -> None:
        super().apply(loads)
        for result in loads:
            if result.blocks:
                BACKEND.zero(self.device_cache, list(result.blocks))


def settle(m: TieredKVCacheManager, executor: TransferExecutor, seq_id: str) -> None:
    deadline = time.monotonic() + WAIT_S
    executor.step()
    while not m.is_ready(seq_id):
        assert time.monotonic() < deadline, f"{seq_id!r} never became ready"
        time.sleep(0.0005)
        executor.step()


class Cluster:
    def __init__(self, directory: Path, *, prefill_executor: type[TransferExecutor] = TransferExecutor) -> None:
        self.p = TieredPrefillManager(14, BLOCK, tiers=tiers(directory, "write-back"))
        self.d = TieredDecodeManager(24, BLOCK, tiers=tiers(directory, "write-through"))
        self.cache_p, self.cache_d = BACKEND.allocate(SPEC, 14), BACKEND.allocate(SPEC, 24)
        self.exec_p = prefill_executor(self.p, BACKEND, self.cache_p)
        self.exec_d = TransferExecutor(self.d, BACKEND, self.cache_d)
        self.handoffs: dict[str, PrefillHandoff] = {}

    def close(self) -> None:
        self.p.close()
        self.d.close()

    def serve(self, request: str, prompt: list[int]) -> tuple[list[torch.Tensor], list[int]]:
        """Prefill on P, hand off, decode STEPS tokens on D; the logits of the last prompt token and each step."""
        p, d = self.p, self.d
        p.add_sequence(request, prompt)
        assert p.storage is not None and p.storage.wait_idle(WAIT_S)  # what D stored is known before lookup
        assert p.allocate(request, len(prompt) - p.lookup(request).total) is not None
        settle(p, self.exec_p, request)
        if len(p.block_table(request)) * BLOCK < len(prompt):
            assert p.allocate(request, len(prompt) - p.num_computed_tokens(request)) is not None
            self.exec_p.step()
        start = p.num_computed_tokens(request)
        logits = [MODEL.forward(prompt[start:], start, self.cache_p, list(p.block_table(request)))[-1]]
        p.commit(request, len(prompt))
        handoff = PrefillHandoff.from_bytes(p.finish_prefill(request).to_bytes())
        self.handoffs[request] = handoff
        admission = d.accept_handoff(handoff, prompt)
        assert admission is not None
        self.exec_d.step()  # blocks the admission evicted are saved before the KV lands in them
        if admission.transfers:
            source, target = (list(ids) for ids in zip(*admission.transfers, strict=True))
            BACKEND.scatter(self.cache_d, target, BACKEND.gather(self.cache_p, source))
        d.receive_done(request)
        p.transfer_done(request)
        self.exec_p.step()
        tokens = list(prompt)
        for _ in range(STEPS):
            token = int(logits[-1].argmax())
            tokens.append(token)
            d.append_tokens(request, [token])
            assert d.allocate(request, 1) is not None
            self.exec_d.step()
            logits.append(MODEL.forward([token], len(tokens) - 1, self.cache_d, list(d.block_table(request)))[-1])
            d.commit(request, len(tokens))
        d.free(request)
        self.exec_d.step()  # the write-through saves of the last commits
        assert d.flush(WAIT_S) and p.flush(WAIT_S)
        p.check_integrity()
        d.check_integrity()
        return logits, tokens


def reference(prompt: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    run = tiny.generate(MODEL, {"r": prompt}, caching=False, decode_steps=STEPS, block_size=BLOCK)
    return run.logits["r"], run.tokens["r"]


def conversation(cluster: Cluster) -> dict[str, tuple[list[torch.Tensor], list[int], list[int]]]:
    """Turn 1, other traffic, turn 2; per request: logits, tokens, and the prompt it was given."""
    out = {}
    turn1 = PROMPTS["a1"]
    logits, tokens = cluster.serve("turn1", turn1)
    out["turn1"] = (logits, tokens, turn1)
    for other in ("b1", "b2", "a2"):  # fills P's 14-block device pool with other prompts
        out[other] = (*cluster.serve(other, PROMPTS[other]), PROMPTS[other])
    turn2 = tokens + [201, 17, 93, 5, 250]  # the history (prompt + answer) and the user's next message
    out["turn2"] = (*cluster.serve("turn2", turn2), turn2)
    return out


def test_the_next_turn_loads_what_the_decode_node_wrote(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    try:
        served = conversation(cluster)
        turn1_tokens = served["turn1"][1]
        handoff = cluster.handoffs["turn2"]
        decoded_full = len(turn1_tokens) // BLOCK * BLOCK  # full blocks of the history on D
        assert len(PROMPTS["a1"]) // BLOCK * BLOCK < decoded_full  # D completed blocks P never computed
        # the whole history is cached: the shared system prompt still on P's device (a2 kept it warm), the
        # rest loaded from storage -- at least the blocks only D computed, which P never had
        assert handoff.cached.total == decoded_full and handoff.cached.host == 0
        assert handoff.cached.storage >= decoded_full - len(PROMPTS["a1"]) // BLOCK * BLOCK
        assert cluster.p.stats.hit_tokens_storage >= handoff.cached.storage
        for request, (logits, tokens, prompt) in served.items():
            expected_logits, expected_tokens = reference(prompt)
            assert tokens == expected_tokens, request
            worst = max(float((a - b).abs().max()) for a, b in zip(logits, expected_logits, strict=True))
            assert worst < TOLERANCE, (request, worst)
    finally:
        cluster.close()


def test_zeroed_loads_change_turn_two(tmp_path: Path) -> None:
    """The negative control: the same run with P's storage loads zeroed differs at turn 2."""
    cluster = Cluster(tmp_path, prefill_executor=ZeroedLoads)
    try:
        served = conversation(cluster)
        assert cluster.handoffs["turn2"].cached.storage > 0
        logits, _, prompt = served["turn2"]
        expected, _ = reference(prompt)
        assert float((logits[0] - expected[0]).abs().max()) > 1e-2
    finally:
        cluster.close()
