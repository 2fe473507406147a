"""A simulated engine for tier tests: block memories as dicts, KV content derived from block hashes.

The "KV" of a block is ``content_of(hash)`` -- bytes only that hash produces -- so after
any sequence of plans, loads and reuse, every block the manager calls cached can be checked
against the prefix its hash names. The engine runs plans exactly as the contract says
(saves, then swap-outs, then swap-ins, from its memories at that moment) and writes the
payloads of loads into device memory.
"""

from __future__ import annotations

import time
from collections.abc import Hashable

import xxhash

from kvblocks.errors import IntegrityError
from kvblocks.hashing import BlockHash
from kvblocks.tiers import EntryFormat, LoadResult, TieredKVCacheManager, TransferPlan

PAYLOAD = 16
FORMAT = EntryFormat("xxh3-128", "uint8", (PAYLOAD,), 0, PAYLOAD)
GARBAGE = b"\xee" * PAYLOAD  # what a block holds before anything wrote it


def content_of(block_hash: BlockHash) -> bytes:
    raw = block_hash if isinstance(block_hash, bytes) else str(block_hash).encode()
    return xxhash.xxh3_128_digest(raw)[:PAYLOAD]


class SimEngine:
    """Runs a :class:`TieredKVCacheManager` the way an engine does, with memories it can check."""

    def __init__(self, manager: TieredKVCacheManager, *, settle: bool = False) -> None:
        self.m = manager
        self.settle = settle  # default of step(settle=...)
        self.device: dict[int, bytes] = {}
        self.host: dict[int, bytes] = {}
        self.fail_swap_ins: set[int] = set()
        self.plans: list[TransferPlan] = []

    def read_device(self, block: int) -> bytes:
        return self.device.get(block, GARBAGE)

    def run_plan(self) -> TransferPlan:
        plan = self.m.take_transfers()
        self.plans.append(plan)
        saved = [self.read_device(s.block) if s.tier == "device" else self.host[s.block] for s in plan.saves]
        for device_block, host_block in plan.swap_outs:
            self.host[host_block] = self.read_device(device_block)
        failed = set()
        for host_block, device_block in plan.swap_ins:
            if device_block in self.fail_swap_ins:
                failed.add(device_block)
                self.device[device_block] = GARBAGE
            else:
                self.device[device_block] = self.host[host_block]
        self.m.complete_transfers(plan, saved=saved if plan.saves else None, failed_swap_ins=failed)
        return plan

    def apply(self, results: list[LoadResult]) -> None:
        for result in results:
            for block, parts in zip(result.blocks, result.payloads, strict=True):
                self.device[block] = bytes(parts[0])

    def step(self, *, settle: bool | None = None) -> list[LoadResult]:
        """Run the plan, then apply finished loads. ``settle`` first waits for every queued
        write and read, so that what happens no longer depends on thread timing."""
        self.run_plan()
        storage = self.m.storage
        if (self.settle if settle is None else settle) and storage is not None:
            storage.flush(5)
            storage.wait_idle(5)
        results = self.m.poll_loads()
        self.apply(results)
        return results

    def wait_ready(self, seq_id: Hashable, timeout: float = 5.0) -> list[LoadResult]:
        """Step until the sequence's copies settled."""
        out: list[LoadResult] = []
        deadline = time.monotonic() + timeout
        while True:
            out += self.step()
            if self.m.is_ready(seq_id):
                return out
            if time.monotonic() > deadline:
                raise TimeoutError(f"{seq_id!r} never became ready")
            time.sleep(0.001)

    def compute(self, seq_id: Hashable, upto: int) -> None:
        """The forward pass: write the KV of every table position below ``upto`` tokens not yet written."""
        size = self.m.block_size
        table = self.m.block_table(seq_id)
        hashes = self.m.block_hashes(seq_id)
        first = self.m.num_computed_tokens(seq_id) // size
        for position in range(first, min(len(hashes), upto // size)):
            self.device[table[position]] = content_of(hashes[position])

    def serve(self, seq_id: Hashable, tokens: list[int]) -> None:
        """Admit, load, compute and commit a whole prompt, then free it."""
        m = self.m
        m.add_sequence(seq_id, tokens)
        cached = m.lookup(seq_id)
        if m.allocate(seq_id, len(tokens) - cached.total) is None:
            raise RuntimeError("pool too small")
        self.wait_ready(seq_id)
        missing = len(tokens) - len(m.block_table(seq_id)) * m.block_size
        if missing > 0:
            if m.allocate(seq_id, len(tokens) - m.num_computed_tokens(seq_id)) is None:
                raise RuntimeError("pool too small")
            self.step()  # the allocation may have evicted blocks: their copies run before the forward pass
        self.check_sequence(seq_id)
        self.compute(seq_id, len(tokens))
        m.commit(seq_id, len(tokens))
        m.free(seq_id)

    def check_sequence(self, seq_id: Hashable) -> None:
        """Every committed block of the sequence holds the KV of its own prefix."""
        size = self.m.block_size
        table = self.m.block_table(seq_id)
        hashes = self.m.block_hashes(seq_id)
        for position in range(self.m.num_computed_tokens(seq_id) // size):
            if self.read_device(table[position]) != content_of(hashes[position]):
                raise IntegrityError(f"{seq_id!r} position {position}: block {table[position]} holds wrong KV")

    def check_cached(self) -> None:
        """Every device node and every ready host entry holds the KV its hash names."""
        tree = self.m.tree
        for block in range(self.m.num_blocks):
            block_hash = tree.hash_of(block)
            if block_hash is not None and self.read_device(block) != content_of(block_hash):
                raise IntegrityError(f"device block {block} holds wrong KV")
        host = self.m.host
        if host is not None:
            for block in range(host.pool.num_blocks):
                block_hash = host.pool.content_key(block)
                if block_hash is not None and self.host.get(block) != content_of(block_hash):  # type: ignore[arg-type]
                    raise IntegrityError(f"host block {block} holds wrong KV")
