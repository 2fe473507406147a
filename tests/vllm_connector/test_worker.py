"""The connector's worker side (kvblocks.integrations.vllm.worker), without vLLM: a failed load is poisoned and
reported; a save whose guard names a failed load is withheld; the report and the counters say so."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvblocks.errors import ConfigError  # noqa: E402
from kvblocks.integrations.vllm.block_copy import LayerBlocks  # noqa: E402
from kvblocks.integrations.vllm.planner import BlockRun, StepPlan  # noqa: E402
from kvblocks.integrations.vllm.worker import ConnectorWorker, LoadRecord, WorkerReport  # noqa: E402
from kvblocks.tiers import FileStorage  # noqa: E402
from tests.support.vllm_transfer import HASHES, kv, payload_of, staged, tier_on  # noqa: E402

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("host", [True, False])
def test_a_poisoned_block_is_nan_in_every_layer_and_its_neighbours_untouched(dtype: torch.dtype, host: bool) -> None:
    buffer = torch.zeros((3, 6, 2, 4, 8), dtype=torch.float32).to(dtype)
    layers = {f"model.layers.{i}.attn": buffer[i] for i in range(3)}
    blocks = LayerBlocks(layers)
    if not host:
        blocks = staged(blocks)
    blocks.poison([1, 4])
    values = buffer.to(torch.float32)
    assert torch.isnan(values[:, [1, 4]]).all()
    assert (values[:, [0, 2, 3, 5]] == 0).all()


@pytest.fixture
def worker(tmp_path: Path):  # type: ignore[no-untyped-def]
    tier = tier_on(FileStorage(tmp_path))
    made = ConnectorWorker(tier)
    made.blocks = LayerBlocks(kv(1))
    yield made
    tier.close()


def _store(worker: ConnectorWorker, source: dict[str, torch.Tensor], hashes: list[bytes]) -> None:
    worker.tier.save(hashes, [payload_of(source, b) for b in range(len(hashes))])
    assert worker.tier.flush(5.0)


def test_a_load_that_fails_is_poisoned_reported_once_and_confirmed(worker: ConnectorWorker) -> None:
    source = kv(2)
    _store(worker, source, HASHES)
    (key,) = worker.tier.keys_of(HASHES[1])
    worker.tier.backend.put([(key, b"damaged")])  # block 1 of the run will not load
    plan = StepPlan(loads=(BlockRun("r", tuple(HASHES), (4, 5, 6, 7)),), step=3, oldest_pending=3)
    worker.load(plan)
    layers = worker.blocks._tensors  # type: ignore[union-attr]
    assert payload_of(dict(zip(worker.blocks.layer_names, layers, strict=True)), 4) == payload_of(source, 0)  # type: ignore[union-attr]
    assert all(torch.isnan(layer[b].float()).all() for layer in layers for b in (5, 6, 7))
    assert worker.take_load_errors() == {5, 6, 7} and worker.take_load_errors() == set()
    assert worker.report() == WorkerReport({3: frozenset({5, 6, 7})}) and worker.report() is None
    assert worker.stats.load_blocks == 1 and worker.stats.load_failed_blocks == 3
    assert worker.counters()["loads_corrupt"] == 1


def test_a_step_whose_loads_all_land_is_still_confirmed(worker: ConnectorWorker) -> None:
    _store(worker, kv(2), HASHES[:2])
    worker.load(StepPlan(loads=(BlockRun("r", tuple(HASHES[:2]), (0, 1)),), step=8, oldest_pending=8))
    assert worker.report() == WorkerReport({8: frozenset()}) and worker.take_load_errors() == set()
    worker.load(StepPlan(step=9, oldest_pending=10))  # no loads: nothing to confirm
    assert worker.report() is None


def test_a_save_guarded_by_a_failed_load_is_withheld_from_that_block_on(worker: ConnectorWorker) -> None:
    worker.load(StepPlan(loads=(BlockRun("r", (b"\x09" * 32,), (0,)),), step=5, oldest_pending=5))  # absent: fails
    assert worker.take_load_errors() == {0}
    clean, guarded = frozenset(), frozenset({(5, 0, 1)})
    other_load = frozenset({(5, 1, 1)})  # a second run of this step: none was planned, so unknown
    plan = StepPlan(
        saves=(
            BlockRun("r", tuple(HASHES[:3]), (1, 2, 3), (clean, guarded, guarded)),
            BlockRun("s", (HASHES[3],), (4,)),
        ),
        step=5,
        oldest_pending=5,
    )
    worker.save(plan)
    assert worker.tier.flush(5.0)
    assert [worker.tier.read_into([h], [worker.blocks.views(7)]) for h in HASHES] == [1, 0, 0, 1]  # type: ignore[union-attr]
    assert worker.stats.save_blocks == 2 and worker.stats.save_withheld_blocks == 2
    report = worker.report()
    assert report is not None and report.withheld == (("r", HASHES[1]), ("r", HASHES[2]))
    assert worker.record.failed_roots(other_load) == other_load  # a run never noted: taken for failed
    assert LoadRecord().failed_roots(guarded) == guarded  # a step never noted: taken for failed


def test_a_guard_of_loads_that_landed_saves_and_an_unregistered_worker_does_nothing(worker: ConnectorWorker) -> None:
    _store(worker, kv(3), HASHES[:1])
    worker.load(StepPlan(loads=(BlockRun("r", (HASHES[0],), (0,)),), step=2, oldest_pending=2))
    plan = StepPlan(saves=(BlockRun("r", (HASHES[1],), (1,), (frozenset({(2, 0, 1)}),)),), step=2, oldest_pending=2)
    worker.save(plan)
    assert worker.stats.save_blocks == 1 and worker.stats.save_withheld_blocks == 0
    idle = ConnectorWorker(worker.tier)
    idle.load(StepPlan(loads=(BlockRun("r", (HASHES[0],), (0,)),), step=1, oldest_pending=1))
    assert idle.take_load_errors() == {0} and idle.stats.errors  # nothing registered: every block recomputed


def test_the_record_forgets_confirmed_steps_and_takes_unknown_ones_for_failed() -> None:
    record = LoadRecord(keep_steps=2)
    record.note(1, [2, 5])
    record.note(2, [])
    assert record.failed_roots([(1, 0, 2), (1, 0, 3), (1, 1, 5), (1, 2, 1), (2, 0, 1)]) == {
        (1, 0, 3),
        (1, 2, 1),
        (2, 0, 1),
    }
    record.note(3, [1])  # keeps two steps: step 1 is gone
    assert record.failed_roots([(1, 0, 1), (3, 0, 1)]) == {(1, 0, 1)}
    record.forget_before(3)
    assert record.failed_roots([(2, 0, 0), (3, 0, 1)]) == {(2, 0, 0)}
    with pytest.raises(ConfigError):
        LoadRecord(keep_steps=0)


@settings(max_examples=60, deadline=None)
@given(
    arrived=st.lists(st.lists(st.integers(0, 4), min_size=3, max_size=3), min_size=2, max_size=4),
    roots=st.sets(st.tuples(st.just(1), st.integers(0, 2), st.integers(1, 4))),
)
def test_ranks_agree_a_load_failed_when_it_failed_on_any(
    arrived: list[list[int]], roots: set[tuple[int, int, int]]
) -> None:
    """Tensor parallelism: each rank's record, combined by an element-wise maximum (what the TP group's all-reduce
    computes), names exactly the roots that failed somewhere -- the same set on every rank."""
    records = []
    for counts in arrived:
        record = LoadRecord()
        record.note(1, counts)
        records.append(record)
    flags_by_rank: list[list[int]] = []

    def gather(flags: list[int]) -> list[int]:
        flags_by_rank.append(flags)
        return flags  # replaced below, once every rank has given its flags

    for record in records:
        record.failed_roots(roots, gather)
    combined = [max(column) for column in zip(*flags_by_rank, strict=True)] if roots else []
    verdicts = [record.failed_roots(roots, lambda _flags: combined) for record in records]
    expected = {root for root in roots if any(counts[root[1]] < root[2] for counts in arrived)}
    assert all(verdict == expected for verdict in verdicts)


def test_reports_of_two_ranks_merge_into_the_union() -> None:
    a = WorkerReport({1: frozenset({2}), 2: frozenset()}, (("r", b"h1"),))
    b = WorkerReport({1: frozenset({3}), 3: frozenset({9})}, (("r", b"h1"), ("s", b"h2")))
    assert a.merged(b) == WorkerReport(
        {1: frozenset({2, 3}), 2: frozenset(), 3: frozenset({9})}, (("r", b"h1"), ("s", b"h2"))
    )
    lost_a, lost_b = WorkerReport({}, (), ((0, b"h1"),)), WorkerReport({}, (), ((1, b"h1"), (0, b"h1")))
    assert lost_a.merged(lost_b).lost == ((0, b"h1"), (1, b"h1"))  # a block lost on any rank is lost


@pytest.fixture
def hybrid(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A per-request worker over two groups sharing one backend, each group under a key space of its own."""
    from kvblocks.hashing import Namespace
    from kvblocks.tiers.config import TierConfig
    from kvblocks.tiers.entry import group_tag
    from kvblocks.tiers.storage_tier import StorageTier
    from tests.support.vllm_transfer import FMT

    storage = FileStorage(tmp_path)
    tiers = [
        StorageTier(
            TierConfig(storage=storage, entry_format=FMT.entry_format),
            Namespace(FMT.model),
            FMT.scheme,
            FMT.block_size,
            tag=group_tag(FMT.tag, number, kind, FMT.block_size, 64 if number == 0 else 0),
            owns_backend=number == 0,
        )
        for number, kind in enumerate(("sliding_window", "full"))
    ]
    made = ConnectorWorker(tiers, per_request=True)
    made.group_blocks[0] = LayerBlocks(kv(1))
    made.group_blocks[1] = LayerBlocks(kv(2))
    yield made
    for tier in reversed(tiers):
        tier.close()


def test_a_per_request_worker_reports_loads_by_request_and_zeroes_what_failed(hybrid: ConnectorWorker) -> None:
    source = kv(5)
    for tier in hybrid.tiers:
        tier.save(HASHES, [payload_of(source, b) for b in range(len(HASHES))])
        assert tier.flush(5.0)
    (key,) = hybrid.tiers[1].keys_of(HASHES[2])
    hybrid.tiers[1].backend.put([(key, b"damaged")])  # group 1's block 2 will not load; group 0's will
    plan = StepPlan(
        loads=(
            BlockRun("ok", (HASHES[2], HASHES[3]), (4, 5), group=0),
            BlockRun("bad", tuple(HASHES), (0, 1, 2, 3), group=1),
            BlockRun("empty", (), ()),
        ),
        step=1,
        failed_requests=("lost",),
    )
    hybrid.load(plan)
    window = hybrid.group_blocks[0]
    full = hybrid.group_blocks[1]
    assert window is not None and full is not None
    named = dict(zip(window.layer_names, window._tensors, strict=True))
    assert payload_of(named, 4) == payload_of(source, 2) and payload_of(named, 5) == payload_of(source, 3)
    assert all((layer[b] == 0).all() for layer in full._tensors for b in (2, 3))  # zero, not NaN: vLLM frees them
    assert hybrid.take_finished_loads() == ({"ok", "bad", "empty", "lost"}, {"bad", "lost"})
    assert hybrid.take_finished_loads() == (set(), set())
    assert hybrid.take_load_errors() == set()  # never block ids: they are unique per group only
    # the scheduler side hears which (group, hash) did not arrive: block 2 of group 1, and the rest of its run
    assert hybrid.report() == WorkerReport({}, (), ((1, HASHES[2]), (1, HASHES[3]))) and hybrid.report() is None
    assert hybrid.stats.load_blocks == 4 and hybrid.stats.load_failed_blocks == 2
    assert hybrid.counters()["loads_corrupt"] == 1


def test_a_per_request_worker_saves_each_run_into_its_groups_key_space(hybrid: ConnectorWorker) -> None:
    plan = StepPlan(
        saves=(BlockRun("r", (HASHES[0],), (1,), group=0), BlockRun("r", (HASHES[0],), (1,), group=1)), step=1
    )
    hybrid.save(plan)
    assert all(tier.flush(5.0) for tier in hybrid.tiers)
    target = LayerBlocks(kv(9))
    named = dict(zip(target.layer_names, target._tensors, strict=True))
    for number, seed in ((0, 1), (1, 2)):
        assert hybrid.tiers[number].read_into([HASHES[0]], [target.views(7)]) == 1
        assert payload_of(named, 7) == payload_of(kv(seed), 1)  # each group's own layers, under its own key
    assert hybrid.tiers[0].keys_of(HASHES[0]) != hybrid.tiers[1].keys_of(HASHES[0])


def test_a_worker_needs_a_tier() -> None:
    with pytest.raises(ConfigError):
        ConnectorWorker([])
