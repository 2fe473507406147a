"""Both halves of ``KVBlocksConnector`` driven through a failed load, as vLLM drives them (issue 29).

No engine: a two-layer toy model stands in for the forward pass, with the one property that matters -- layer 0 of
a token depends on the token alone, layer 1 on layer 0 of its whole context -- and the steps follow vLLM 0.32's
order (match, allocate, plan, load, forward, save, load errors, worker report, recovery). Engine A saves every
block of two prompts that share a prefix; the store is damaged; engine B loads what it can, one load fails
(block 1 holds another key's sound entry), the same step computes past it for both requests, vLLM recomputes.
Every entry in the store afterwards must be bit-identical to A's entry under the same key.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kvblocks.hashing import block_hashes
from kvblocks.tiers.entry import HEADER
from tests.vllm_engine.fleet import entries

BS = 4
WIDTH = 32  # floats per token per layer: a 512-byte page of 4 tokens (1 KV head, head size 16, K and V)
NUM_BLOCKS = 64
SHARED = list(range(101, 133))  # 8 blocks
PROMPTS = {"r0": SHARED + list(range(201, 210)), "r1": SHARED + list(range(301, 310))}  # 10 blocks and 1 token


def _configs(store: Path) -> tuple[Any, Any]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    transfer = SimpleNamespace(
        kv_connector_extra_config={"path": str(store)},
        kv_load_failure_policy="recompute",
        is_kv_producer=True,
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=transfer,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model="toy"),
        cache_config=SimpleNamespace(prefix_caching_hash_algo="sha256", block_size=BS),
    )
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=16, dtype=torch.float32)
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=["model.layers.0.attn", "model.layers.1.attn"])
    return vllm_config, SimpleNamespace(kv_cache_groups=[group], kv_cache_layout="NHD")


class ToyEngine:
    """The scheduler and worker halves of one engine, a toy forward pass and vLLM's recovery rule."""

    def __init__(self, store: Path) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from kvblocks.integrations.vllm.connector import KVBlocksConnector

        config, kv_config = _configs(store)
        self.scheduler = KVBlocksConnector(config, KVConnectorRole.SCHEDULER, kv_config)
        self.worker = KVBlocksConnector(config, KVConnectorRole.WORKER, kv_config)
        self.layers = [torch.zeros((NUM_BLOCKS, BS, WIDTH)) for _ in range(2)]
        self.worker.register_kv_caches({f"model.layers.{i}.attn": t for i, t in enumerate(self.layers)})
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}

    def close(self) -> None:
        self.worker.tier.flush(10.0)
        self.scheduler.shutdown()
        self.worker.shutdown()

    def request(self, rid: str) -> Any:
        tokens = self.tokens[rid]
        return SimpleNamespace(
            request_id=rid, block_hashes=block_hashes(tokens, BS, scheme="vllm-sha256"), num_tokens=len(tokens)
        )

    def match(self, rid: str, local: int) -> int:
        deadline = time.monotonic() + 10
        while (got := self.scheduler.get_num_new_matched_tokens(self.request(rid), local)[0]) is None:
            assert time.monotonic() < deadline, "the store's probe never answered"
            time.sleep(0.01)
        return got

    def allocate(self, rid: str, table: list[int], external: int) -> None:
        self.tables[rid] = table
        blocks = SimpleNamespace(get_block_ids=lambda: (table,))
        self.scheduler.update_state_after_alloc(self.request(rid), blocks, external)

    def step(self, new: list[tuple[str, int]], running: list[tuple[str, int]]) -> set[int]:
        """One engine step: ``new`` and ``running`` are (request, tokens computed before it); every request computes
        the rest of its tokens. Returns the block ids the worker reported failed."""
        out = SimpleNamespace(
            scheduled_new_reqs=[
                SimpleNamespace(req_id=rid, num_computed_tokens=done, block_ids=(self.tables[rid],))
                for rid, done in new
            ],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[rid for rid, _ in running],
                new_block_ids=[None for _ in running],
                num_computed_tokens=[done for _, done in running],
                resumed_req_ids=set(),
            ),
            num_scheduled_tokens={rid: len(self.tokens[rid]) - done for rid, done in new + running},
            scheduled_spec_decode_tokens={},
            preempted_req_ids=set(),
        )
        meta = self.scheduler.build_connector_meta(out)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        self.forward(running + new)
        self.worker.wait_for_save()
        failed = self.worker.get_block_ids_with_load_errors()
        report = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        self.scheduler.update_connector_output(
            SimpleNamespace(invalid_block_ids=failed, kv_connector_worker_meta=report)
        )
        return failed

    def forward(self, work: list[tuple[str, int]]) -> None:
        """Layer 0 of every computed token first (its embedding), then layer 1 (its embedding plus a tenth of the
        mean of layer 0 over its whole context): what attention makes of a context, in miniature."""
        for rid, done in work:
            for i in range(done, len(self.tokens[rid])):
                block, slot = self.tables[rid][i // BS], i % BS
                self.layers[0][block, slot] = self.embedding(self.tokens[rid][i], i)
        for rid, done in work:
            table = self.tables[rid]
            for i in range(done, len(self.tokens[rid])):
                context = torch.stack([self.layers[0][table[j // BS], j % BS] for j in range(i + 1)])
                block, slot = table[i // BS], i % BS
                self.layers[1][block, slot] = self.embedding(self.tokens[rid][i], i) + 0.1 * context.mean(dim=0)

    @staticmethod
    def embedding(token: int, position: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(token * 1009 + position)
        return torch.randn(WIDTH, generator=generator)


def _payloads(store: Path) -> dict[str, bytes]:
    return {key: path.read_bytes()[HEADER.size :] for key, path in entries(store).items()}


def test_a_recovering_engine_never_stores_kv_computed_over_a_failed_load(tmp_path: Path) -> None:
    store = tmp_path / "store"
    a = ToyEngine(store)
    try:
        a.tokens = dict(PROMPTS)
        a.match("r0", 0)
        a.allocate("r0", list(range(1, 12)), 0)
        a.match("r1", 0)
        a.allocate("r1", list(range(1, 9)) + [20, 21, 22], 0)  # r1 hits r0's 8 shared blocks in vLLM's cache
        assert a.step([("r0", 0), ("r1", 32)], []) == set()
    finally:
        a.close()
    reference = _payloads(store)
    assert len(reference) == 12  # 8 shared blocks and 2 of each request's own
    shared = block_hashes(SHARED, BS, scheme="vllm-sha256")
    files = entries(store)

    def path_of(position: int) -> Path:
        (hit,) = [f for name, f in files.items() if name.endswith("b" + shared[position].hex())]
        return hit

    path_of(1).write_bytes(path_of(3).read_bytes())  # another key's sound entry
    data = bytearray(path_of(4).read_bytes())
    data[HEADER.size + 7] ^= 0x10  # a flipped payload byte
    path_of(4).write_bytes(bytes(data))
    path_of(6).unlink()  # the external hit stops before block 6

    b = ToyEngine(store)
    try:
        b.tokens = dict(PROMPTS)
        assert b.match("r0", 0) == 6 * BS
        b.allocate("r0", list(range(1, 12)), 6 * BS)
        # r1 hits r0's 8 shared blocks in vLLM's prefix cache (cached at r0's allocation, filled this step), and
        # its own two blocks in the store
        assert b.match("r1", 8 * BS) == 2 * BS
        b.allocate("r1", list(range(1, 9)) + [20, 21, 22], 2 * BS)
        failed = b.step([("r0", 6 * BS), ("r1", 10 * BS)], [])
        assert failed == {2, 3, 4, 5, 6}  # block 1 (id 2) failed, so r0's run stops there; r1's own loaded
        assert all(torch.isnan(b.layers[0][blk]).all() for blk in failed)  # poisoned, never read as KV
        # vLLM: r0 recomputes from block 1; r1 holds the failed blocks too and re-runs its step beside it
        assert b.step([], [("r1", 10 * BS), ("r0", 1 * BS)]) == set()
        stats = b.worker.stats
        assert stats.save_withheld_blocks > 0 and stats.load_failed_blocks == 5
    finally:
        b.close()
    after = _payloads(store)
    assert set(after) == set(reference)  # every block is stored again, 6 included
    wrong = sorted(key for key, payload in after.items() if payload != reference[key])
    assert wrong == [], f"{len(wrong)} entries hold KV that is not their block's"
