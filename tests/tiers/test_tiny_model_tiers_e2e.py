"""End to end over the tiers: a real (tiny) transformer whose KV outgrows the device pool.

The device pool holds any one request but not the working set, so serving the
shared-prefix prompts twice evicts blocks to a small host tier and, below it, to a
``FileStorage`` directory; revisiting a prompt brings them back (host swap-ins, storage
loads) and the logits must equal the uncached run's::

    device [14 blocks] --evict--> host [8 blocks] --evict--> FileStorage (a tmp directory)
         ^                             |                           |
         +--------- swap-in -----------+---- load (reader thread) --+

A second manager -- a restarted process, or another node sharing the directory -- serves
the prompts from what the first one stored; entries corrupted on disk are misses that get
recomputed; and tampering with what comes back changes the logits, so the comparisons
have teeth.

Requests are served the way an engine drives a :class:`TransferExecutor`: scheduling
calls, then ``executor.step()`` before every forward pass (an allocation may evict blocks
whose copies must run before the blocks are overwritten), commit, decode, free.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvblocks.accounting import CachedTokens, CacheStats
from kvblocks.backends.registry import get_backend
from kvblocks.hashing import DEFAULT_SCHEME, BlockHash
from kvblocks.tiers import EntryFormat, FileStorage, LoadResult, TierConfig, TieredKVCacheManager, TierStats
from kvblocks.tiers.entry import HEADER, block_key, namespace_tag
from kvblocks.tiers.executor import TransferExecutor
from kvblocks.tiers.transfers import TransferPlan
from tests.support.examples import load_example

tiny = load_example("tiny_model")

MODEL = tiny.TinyModel()
PROMPTS = tiny.shared_prefix_prompts()
# Every prompt twice: the second round revisits prompts whose blocks the first round evicted.
SCHEDULE = {f"{request}.{round_}": prompt for round_ in (1, 2) for request, prompt in PROMPTS.items()}
BLOCK_SIZE = 4
DECODE_STEPS = 4
DEVICE_BLOCKS = 14  # the longest request needs 13 (47 prompt + 4 decoded tokens); the schedule ~50 distinct
HOST_BLOCKS = 8
TOLERANCE = 1e-4  # float32 logits; the runs differ only in how tokens are batched into matmuls
POLICIES = ("write-back", "write-through")
WAIT_S = 30.0  # upper bound on any wait for the storage threads; runs take well under a second


@dataclass
class TieredRun(tiny.Run):
    """A ``tiny.Run`` plus what the tiers did."""

    stats: CacheStats | None = None
    tier_stats: TierStats | None = None
    admitted: dict[str, CachedTokens] = field(default_factory=dict)  # per request: what lookup reported
    hashes: dict[str, tuple[BlockHash, ...]] = field(default_factory=dict)  # per request: its full prompt blocks
    cut_back: int = 0  # admissions whose table a failed storage read cut back (tokens recomputed)


@pytest.fixture(scope="module")
def reference() -> tiny.Run:
    """The uncached run: every token of the schedule computed from scratch."""
    return tiny.generate(MODEL, SCHEDULE, caching=False, decode_steps=DECODE_STEPS, block_size=BLOCK_SIZE)


@pytest.fixture(scope="module")
def device_only() -> tiny.Run:
    """Prefix caching on the same small device pool, with no tiers below it."""
    return tiny.generate(
        MODEL, SCHEDULE, caching=True, decode_steps=DECODE_STEPS, block_size=BLOCK_SIZE, num_blocks=DEVICE_BLOCKS
    )


def tier_config(
    storage_dir: Path | None,
    *,
    num_host_blocks: int = HOST_BLOCKS,
    host_policy: str = "write-back",
    storage_policy: str = "write-back",
) -> TierConfig:
    """Tiers under the device pool; ``storage_dir`` None: no storage tier. A fresh ``FileStorage`` each time."""
    spec = MODEL.config.cache_spec(BLOCK_SIZE)
    return TierConfig(
        num_host_blocks=num_host_blocks,
        host_policy=host_policy,
        storage=None if storage_dir is None else FileStorage(storage_dir),
        entry_format=None if storage_dir is None else EntryFormat.for_spec(spec, DEFAULT_SCHEME),
        storage_policy=storage_policy,
        storage_timeout_s=WAIT_S,  # a read that times out is a miss: keep a busy test machine from causing one
    )


def _wait_for_probes(manager: TieredKVCacheManager, timeout: float = WAIT_S) -> None:
    """Wait until the storage reader answered every probe queued so far.

    ``add_sequence`` asks the reader thread which of the prompt's blocks are stored, and
    ``lookup`` reports them once it has answered. An engine sees the answer a step or more
    later; this test waits for it so that which blocks hit is deterministic.
    """
    if manager.storage is not None and not manager.storage.wait_idle(timeout):
        raise TimeoutError("the storage reader did not answer")


def _settle(manager: TieredKVCacheManager, executor: TransferExecutor, seq_id: str, timeout: float = WAIT_S) -> None:
    """Step until the sequence's swap-ins and storage reads completed (reads finish on a thread)."""
    deadline = time.monotonic() + timeout
    executor.step()
    while not manager.is_ready(seq_id):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{seq_id!r} never became ready")
        time.sleep(0.0005)
        executor.step()


def _granted(table: object, request: str) -> None:
    if table is None:
        raise RuntimeError(f"the device pool is too small for {request!r}")


def serve_tiered(
    model: tiny.TinyModel,
    prompts: dict[str, list[int]],
    tiers: TierConfig,
    *,
    num_blocks: int = DEVICE_BLOCKS,
    decode_steps: int = DECODE_STEPS,
    block_size: int = BLOCK_SIZE,
    block_major: bool = True,
    executor_type: type[TransferExecutor] = TransferExecutor,
) -> TieredRun:
    """Serve ``prompts`` one after another through a tiered manager, greedy-decoding each.

    ``tiny.generate`` with prefix caching, except that the device pool sits on ``tiers``
    and a ``TransferExecutor`` (or ``executor_type``) moves the blocks. Storage writes are
    flushed after every request, so the next one's hits do not depend on the writer
    thread's timing. The manager is closed before returning.
    """
    backend = get_backend("cpu")
    spec = model.config.cache_spec(block_size, block_major=block_major)  # NHD, as tier_config's entry format
    device = backend.allocate(spec, num_blocks)
    host = backend.allocate(spec, tiers.num_host_blocks) if tiers.host_enabled else None
    manager = TieredKVCacheManager(num_blocks, block_size, tiers=tiers)
    assert tiers.entry_format is None or tiers.entry_format.scheme == manager.config.hash_scheme
    executor = executor_type(manager, backend, device, host)
    run = TieredRun()
    try:
        for request, prompt in prompts.items():
            manager.add_sequence(request, prompt)
            _wait_for_probes(manager)
            cached = manager.lookup(request)
            run.admitted[request] = cached
            _granted(manager.allocate(request, len(prompt) - cached.total), request)
            _settle(manager, executor, request)
            if len(manager.block_table(request)) * block_size < len(prompt):  # a read failed: compute the rest
                run.cut_back += 1
                _granted(manager.allocate(request, len(prompt) - manager.num_computed_tokens(request)), request)
                executor.step()
            start = manager.num_computed_tokens(request)
            logits = model.forward(prompt[start:], start, device, list(manager.block_table(request)))
            manager.commit(request, len(prompt))
            run.computed_tokens += len(prompt) - start
            run.prompt_tokens += len(prompt)
            run.logits[request] = [logits[-1]]
            run.hashes[request] = manager.block_hashes(request)[: len(prompt) // block_size]
            tokens = list(prompt)
            for _ in range(decode_steps):
                token = int(run.logits[request][-1].argmax())
                tokens.append(token)
                manager.append_tokens(request, [token])
                _granted(manager.allocate(request, 1), request)
                executor.step()  # the allocation may have evicted: copy those blocks out before reuse
                logits = model.forward([token], len(tokens) - 1, device, list(manager.block_table(request)))
                manager.commit(request, len(tokens))
                run.computed_tokens += 1
                run.logits[request].append(logits[-1])
            run.tokens[request] = tokens
            manager.free(request)
            executor.step()  # the copies the last commits planned (write-through)
            assert manager.flush(WAIT_S)
        manager.check_integrity()
        run.stats = manager.stats
        run.tier_stats = manager.tier_stats
    finally:
        manager.close()
    return run


def assert_same_as_uncached(run: tiny.Run, reference: tiny.Run) -> None:
    assert tiny.max_logit_difference(reference, run) < TOLERANCE
    assert run.tokens == reference.tokens


def assert_hits_account_for_the_savings(run: TieredRun, reference: tiny.Run) -> None:
    """Every token a tier reported as a hit is one the run did not compute, and no other."""
    assert run.prompt_tokens == reference.prompt_tokens
    assert run.computed_tokens == reference.computed_tokens - run.stats.hit_tokens


def _stored_files(storage_dir: Path) -> list[Path]:
    return sorted(path for path in storage_dir.rglob("*") if path.is_file())


def entry_files(storage_dir: Path, block_hashes: list[BlockHash]) -> list[Path]:
    """The files under ``storage_dir`` holding the entries of ``block_hashes`` (a file is named by its key)."""
    tag = namespace_tag("default", DEFAULT_SCHEME, BLOCK_SIZE)  # the key space of tier_config's managers
    entry_format = EntryFormat.for_spec(MODEL.config.cache_spec(BLOCK_SIZE), DEFAULT_SCHEME)
    keys = [block_key(tag, DEFAULT_SCHEME, h, format_tag=entry_format.tag) for h in block_hashes]
    return [path for key in keys for path in storage_dir.rglob(key)]


# ---------------------------------------------------------------------- device -> host -> storage and back


@pytest.mark.parametrize("storage_policy", POLICIES)
@pytest.mark.parametrize("host_policy", POLICIES)
def test_blocks_evicted_to_host_and_storage_come_back(
    reference, device_only, tmp_path: Path, host_policy: str, storage_policy: str
) -> None:
    run = serve_tiered(MODEL, SCHEDULE, tier_config(tmp_path, host_policy=host_policy, storage_policy=storage_policy))
    assert_same_as_uncached(run, reference)
    stats, tiers = run.stats, run.tier_stats
    assert tiers.host_evicted > 0  # the host tier is too small for the working set as well ...
    assert stats.hit_tokens_host > 0 and tiers.swap_ins > 0  # ... yet blocks came back from host
    assert stats.hit_tokens_storage > 0 and tiers.storage.loads_hit > 0  # ... and from storage
    assert tiers.swap_in_failures == 0 and tiers.storage.loads_corrupt == 0 and run.cut_back == 0
    assert_hits_account_for_the_savings(run, reference)
    assert run.computed_tokens < device_only.computed_tokens < reference.computed_tokens


def test_storage_only_tier(reference, device_only, tmp_path: Path) -> None:
    """No host tier: blocks evicted from the device go straight to storage and come back from there."""
    run = serve_tiered(MODEL, SCHEDULE, tier_config(tmp_path, num_host_blocks=0))
    assert_same_as_uncached(run, reference)
    stats, tiers = run.stats, run.tier_stats
    assert stats.hit_tokens_host == 0 and tiers.swap_ins == tiers.swap_outs == 0
    assert stats.hit_tokens_storage > 0 and tiers.storage.loads_hit > 0
    assert tiers.storage.saves_queued > 0 and tiers.writer.written == tiers.storage.saves_queued
    assert_hits_account_for_the_savings(run, reference)
    assert run.computed_tokens < device_only.computed_tokens


# ---------------------------------------------------------------------- a second manager over the same directory


@dataclass(frozen=True)
class Served:
    directory: Path  # the storage directory the run used
    run: TieredRun


def _copy(directory: Path, to: Path) -> Path:
    shutil.copytree(directory, to)
    return to


def _contents(directory: Path) -> dict[Path, bytes]:
    return {path.relative_to(directory): path.read_bytes() for path in _stored_files(directory)}


@pytest.fixture(scope="module")
def first_node(tmp_path_factory) -> Served:
    """A first manager that stored every committed block (write-through storage), then shut down."""
    directory = tmp_path_factory.mktemp("tiers-e2e") / "first"
    run = serve_tiered(MODEL, SCHEDULE, tier_config(directory, storage_policy="write-through"))
    assert run.tier_stats.writer.written == run.tier_stats.storage.saves_queued > 0
    return Served(directory, run)


def _second_node(directory: Path, **kwargs) -> TieredRun:
    """New manager, new device and host caches, a new FileStorage on ``directory``; it only reads storage."""
    return serve_tiered(MODEL, SCHEDULE, tier_config(directory, storage_policy="off"), **kwargs)


@pytest.fixture(scope="module")
def second_node(first_node: Served) -> Served:
    directory = _copy(first_node.directory, first_node.directory.parent / "second")
    return Served(directory, _second_node(directory))


def test_a_restarted_manager_reuses_what_storage_holds(reference, first_node: Served, second_node: Served) -> None:
    """A restart, or another node sharing the directory: blocks come back from storage alone."""
    run = second_node.run
    assert_same_as_uncached(run, reference)
    opening = next(iter(SCHEDULE))  # nothing on this node yet: every full prompt block comes from storage
    full = (len(SCHEDULE[opening]) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert run.admitted[opening] == CachedTokens(storage=full, num_prompt_tokens=len(SCHEDULE[opening]))
    assert run.stats.hit_tokens_storage > 0 and run.tier_stats.storage.loads_hit > 0
    assert run.tier_stats.storage.loads_corrupt == run.cut_back == 0
    assert run.tier_stats.storage.saves_queued == 0  # storage "off": it only read ...
    assert _contents(second_node.directory) == _contents(first_node.directory)  # ... and left the entries as they were
    assert_hits_account_for_the_savings(run, reference)
    assert run.computed_tokens < first_node.run.computed_tokens  # not even the first round's prompts were computed


def test_a_node_with_another_cache_arrangement_reads_the_same_entries(
    reference, first_node: Served, tmp_path: Path
) -> None:
    """Entries are canonical bytes: a layer-major cache loads what a block-major one stored."""
    run = _second_node(_copy(first_node.directory, tmp_path / "kv"), block_major=False)
    assert_same_as_uncached(run, reference)
    assert run.stats.hit_tokens_storage > 0 and run.tier_stats.storage.loads_corrupt == 0


def test_corrupt_entries_are_misses_and_get_recomputed(
    reference, first_node: Served, second_node: Served, tmp_path: Path
) -> None:
    """Entries damaged on disk fail their checksum: they are deleted, and their tokens computed."""
    directory = _copy(first_node.directory, tmp_path / "kv")
    hashes = first_node.run.hashes
    victims = [hashes["a1.1"][2], hashes["b1.1"][1], hashes["a4.1"][-1]]  # each read by the second node
    damaged = entry_files(directory, victims)
    assert len(damaged) == len(victims)
    for path in damaged:
        data = bytearray(path.read_bytes())
        assert len(data) == HEADER.size + MODEL.config.cache_spec(BLOCK_SIZE).bytes_per_block
        for offset in (HEADER.size, HEADER.size + 101, len(data) - 1):  # payload bytes: the header stays intact
            data[offset] ^= 0x5A
        path.write_bytes(bytes(data))

    tiers = tier_config(directory, storage_policy="off")
    run = serve_tiered(MODEL, SCHEDULE, tiers)
    assert_same_as_uncached(run, reference)
    storage = run.tier_stats.storage
    assert storage.loads_corrupt == len(victims) and storage.loads_hit > 0
    assert run.cut_back >= len(victims)  # each corrupt entry cut a table back; the engine computed the rest
    assert not any(path.exists() for path in damaged)  # the corrupt entries were removed
    assert tiers.storage.stats.deletes == len(victims)
    assert_hits_account_for_the_savings(run, reference)
    assert run.computed_tokens > second_node.run.computed_tokens  # what the clean copy served, these recomputed


# ---------------------------------------------------------------------- negative controls: the comparisons have teeth


class ZeroedLoads(TransferExecutor):
    """Writes zeros where every storage read's payloads belong."""

    def apply(self, loads: list[LoadResult]) -> None:
        zeroed = [
            dataclasses.replace(
                r, payloads=tuple(tuple(memoryview(bytes(len(p))) for p in parts) for parts in r.payloads)
            )
            for r in loads
        ]
        super().apply(zeroed)


class ZeroedSwapIns(TransferExecutor):
    """Zeroes the host blocks a plan swaps in, just before it runs."""

    def run(self, plan: TransferPlan) -> None:
        if plan.swap_ins:
            get_backend("cpu").zero(self.host_cache, [host_block for host_block, _ in plan.swap_ins])
        super().run(plan)


def test_the_logits_really_come_from_storage(reference, tmp_path: Path) -> None:
    broken = serve_tiered(MODEL, SCHEDULE, tier_config(tmp_path, num_host_blocks=0), executor_type=ZeroedLoads)
    assert broken.tier_stats.storage.loads_hit > 0
    assert tiny.max_logit_difference(reference, broken) > 1e-2


def test_the_logits_really_come_from_host(reference) -> None:
    broken = serve_tiered(MODEL, SCHEDULE, tier_config(None), executor_type=ZeroedSwapIns)
    assert broken.tier_stats.swap_ins > 0
    assert tiny.max_logit_difference(reference, broken) > 1e-2
