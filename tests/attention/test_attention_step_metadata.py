"""Step metadata: exact tensors on hand-checked cases, and equality with a reference rebuilt from the manager's
tables in plain Python after every step of a random workload (plain and hybrid managers)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvblocks import KVCacheManager
from kvblocks.attention import StepMetadata, StepMetadataBuilder
from kvblocks.errors import InvalidArgumentError, SequenceStateError, UnknownSequenceError
from kvblocks.hybrid import HybridKVCacheManager, LocalGroup

# ---------------------------------------------------------------- the reference, from public calls only


def table_of(m: KVCacheManager, seq_id: object, group: int) -> list[int]:
    if isinstance(m, HybridKVCacheManager):
        return m.group_block_table(seq_id, group)
    return list(m.block_table(seq_id))


def reference(m: KVCacheManager, batch: list, queries: list[int], sizes: list[int]) -> dict:
    """What build() must return, computed token by token from the manager's tables."""
    starts = [m.num_computed_tokens(s) for s in batch]
    out: dict = {"tables": [], "slots": []}
    for group, size in enumerate(sizes):
        tables = [table_of(m, s, group) for s in batch]
        width = max((len(t) for t in tables), default=0)
        out["tables"].append([t + [-1] * (width - len(t)) for t in tables])
        out["slots"].append(
            [t[p // size] * size + p % size for t, a, q in zip(tables, starts, queries) for p in range(a, a + q)]
        )
    out["positions"] = [p for a, q in zip(starts, queries) for p in range(a, a + q)]
    out["seq_lens"] = [a + q for a, q in zip(starts, queries)]
    out["query_start_loc"] = [0, *itertools.accumulate(queries)]
    out["max_seq_len"] = max(out["seq_lens"], default=0)
    out["max_query_len"] = max(queries, default=0)
    return out


def assert_matches(meta: StepMetadata, expected: dict) -> None:
    count = len(expected["seq_lens"])
    for table, want in zip(meta.block_tables, expected["tables"], strict=True):
        assert table.dtype == torch.int32 and tuple(table.shape) == (count, len(want[0]) if want else 0)
        assert table.tolist() == want
    for slots, want in zip(meta.slot_mappings, expected["slots"], strict=True):
        assert slots.dtype == torch.int64 and slots.tolist() == want
    assert meta.positions.dtype == torch.int64 and meta.positions.tolist() == expected["positions"]
    assert meta.seq_lens.dtype == torch.int32 and meta.seq_lens.tolist() == expected["seq_lens"]
    assert meta.query_start_loc.dtype == torch.int32 and meta.cu_seqlens_q.tolist() == expected["query_start_loc"]
    assert (meta.max_seq_len, meta.max_query_len) == (expected["max_seq_len"], expected["max_query_len"])
    assert meta.num_tokens == len(expected["positions"]) and meta.num_seqs == count


# ---------------------------------------------------------------- hand-checked cases


def test_decode_and_chunked_prefill_by_hand() -> None:
    m = KVCacheManager(num_blocks=16, block_size=4)
    m.add_sequence("a", list(range(8)))
    m.allocate("a", 8)  # blocks 0, 1
    m.commit("a", 8)
    m.add_sequence("b", list(range(100, 106)))
    m.allocate("b", 6)  # blocks 2, 3
    m.step(["a"], [8], [[9]])  # a: 9 known, slots for token 8 -> block 4
    builder = StepMetadataBuilder(m)
    meta = builder.build(["a", "b"], [1, 6])
    assert meta.groups == (0,)
    assert meta.block_table.tolist() == [[0, 1, 4], [2, 3, -1]]
    assert meta.slot_mapping.tolist() == [16, 8, 9, 10, 11, 12, 13]  # 4*4+0; then blocks 2, 3 from offset 0
    assert meta.positions.tolist() == [8, 0, 1, 2, 3, 4, 5]
    assert meta.seq_lens.tolist() == [9, 6]
    assert meta.query_start_loc.tolist() == [0, 1, 7]
    assert (meta.max_seq_len, meta.max_query_len, meta.num_tokens) == (9, 6, 7)


def test_a_prefix_hit_starts_the_query_after_the_hit() -> None:
    m = KVCacheManager(num_blocks=16, block_size=4)
    m.add_sequence("x", list(range(10)))
    m.allocate("x", 10)  # blocks 0, 1, 2
    m.commit("x", 10)
    m.add_sequence("y", [*range(8), 50, 51, 52])  # shares blocks 0 and 1
    table = m.allocate("y", 3)  # from the 8-token hit: tokens 8..10 -> a new block
    assert list(table) == [0, 1, 3]
    meta = StepMetadataBuilder(m).build(["y"], [3])
    assert meta.slot_mapping.tolist() == [12, 13, 14]
    assert meta.positions.tolist() == [8, 9, 10]
    assert meta.seq_lens.tolist() == [11] and meta.query_start_loc.tolist() == [0, 3]


def test_only_appended_ids_are_copied_and_rows_follow_readmissions() -> None:
    m = KVCacheManager(num_blocks=8, block_size=2)
    m.add_sequence("a", [1, 2, 3])
    m.allocate("a", 3)  # [0, 1]
    builder = StepMetadataBuilder(m)
    assert builder.build(["a"], [3]).block_table.tolist() == [[0, 1]]
    m.step(["a"], [3], [[4]], 1)  # 4 known, slot 3 is in block 1: no new block
    assert builder.build(["a"], [1]).slot_mapping.tolist() == [3]
    m.step(["a"], [4], [[5]], 1)  # token 4 -> block 2
    meta = builder.build(["a"], [1])
    assert meta.block_table.tolist() == [[0, 1, 2]] and meta.slot_mapping.tolist() == [4]
    m.preempt("a")
    m.allocate("a", 5)  # readmitted: a new table (prefix hit of 4 tokens: blocks 0, 1; then a new one)
    table = list(m.block_table("a"))
    meta = builder.build(["a"], [1])
    assert meta.block_table.tolist() == [table]
    assert meta.slot_mapping.tolist() == [table[2] * 2]


def test_a_readmission_to_a_table_of_the_same_length_and_last_block_is_seen() -> None:
    m = KVCacheManager(num_blocks=3, block_size=4)
    m.add_sequence("a", list(range(8)))
    m.allocate("a", 8)
    builder = StepMetadataBuilder(m)
    assert builder.build(["a"], [8]).block_table.tolist() == [[0, 1]]
    m.preempt("a")  # released tail first, behind block 2 in the fresh queue
    assert list(m.allocate("a", 8)) == [2, 1]  # same length, same last block: only the first differs
    assert builder.build(["a"], [8]).block_table.tolist() == [[2, 1]]


def test_a_tail_shrunk_and_grown_back_between_two_builds_is_seen() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence("a", [1, 2, 3])
    m.allocate("a", 3, num_lookahead_tokens=5)  # 8 slots: [0, 1]
    builder = StepMetadataBuilder(m)
    assert builder.build(["a"], [3]).block_table.tolist() == [[0, 1]]
    m.allocate("a", 0)  # the draft slots go back: [0]
    m.allocate("a", 0, num_lookahead_tokens=5)  # and come back in another block: [0, 2]
    assert list(m.block_table("a")) == [0, 2]
    assert builder.build(["a"], [3]).block_table.tolist() == [[0, 2]]


def test_a_table_shrunk_at_its_tail_is_rewritten() -> None:
    m = KVCacheManager(num_blocks=16, block_size=2)
    m.add_sequence("a", [1, 2, 3])
    m.allocate("a", 3, num_lookahead_tokens=4)  # 7 slots: 4 blocks
    builder = StepMetadataBuilder(m)
    assert builder.build(["a"], [5]).block_table.tolist() == [[0, 1, 2, 3]]
    m.step(["a"], [3], None, 1, 0)  # the draft slots go back: 4 slots, 2 blocks
    meta = builder.build(["a"], [1])
    assert meta.block_table.tolist() == [[0, 1]] and meta.slot_mapping.tolist() == [3]


def test_rows_of_sequences_that_left_are_reused_and_the_rows_grow_when_needed() -> None:
    m = KVCacheManager(num_blocks=1024, block_size=4)
    builder = StepMetadataBuilder(m)
    ids = itertools.count()
    for _wave in range(4):  # 4 waves of 50: rows of the freed waves are reclaimed
        batch = [next(ids) for _ in range(50)]
        for s in batch:
            m.add_sequence(s, [s, 1, 2, 3, 4])
            m.allocate(s, 5)
        assert_matches(builder.build(batch, [5] * 50), reference(m, batch, [5] * 50, [4]))
        for s in batch:
            m.free(s)
    assert len(builder._owner) == 64  # never more rows than the most sequences seen at once, rounded up
    batch = [next(ids) for _ in range(100)]
    for s in batch:
        m.add_sequence(s, [s, 9])
        m.allocate(s, 2)
    assert_matches(builder.build(batch, [2] * 100), reference(m, batch, [2] * 100, [4]))
    assert len(builder._owner) == 128


def test_bad_input_raises_and_leaves_the_last_metadata_alone() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence("a", list(range(6)))
    m.allocate("a", 6)
    m.add_sequence("waiting", [1, 2])
    m.add_sequence("gone", [1, 2])
    m.free("gone")
    builder = StepMetadataBuilder(m)
    meta = builder.build(["a"], [6])
    before = (meta.block_table.tolist(), meta.slot_mapping.tolist(), meta.seq_lens.tolist())
    with pytest.raises(UnknownSequenceError, match="freed"):
        builder.build(["a", "gone"], [6, 1])
    with pytest.raises(UnknownSequenceError):
        builder.build(["nobody"], [1])
    with pytest.raises(SequenceStateError, match="not admitted"):
        builder.build(["waiting"], [1])
    with pytest.raises(InvalidArgumentError, match="allocated 6"):
        builder.build(["a"], [7])  # beyond the slots
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(InvalidArgumentError):
            builder.build(["a"], [bad])
    with pytest.raises(InvalidArgumentError, match="twice"):
        builder.build(["a", "a"], [1, 1])
    with pytest.raises(InvalidArgumentError, match="entries"):
        builder.build(["a"], [1, 1])
    with pytest.raises(InvalidArgumentError):
        StepMetadataBuilder("not a manager")  # type: ignore[arg-type]
    assert (meta.block_table.tolist(), meta.slot_mapping.tolist(), meta.seq_lens.tolist()) == before


def test_an_empty_step_gives_empty_tensors() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    meta = StepMetadataBuilder(m).build([], [])
    assert meta.block_table.shape == (0, 0) and meta.slot_mapping.numel() == 0
    assert meta.query_start_loc.tolist() == [0] and (meta.max_seq_len, meta.max_query_len) == (0, 0)


def test_importing_the_package_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, kvblocks.attention; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


# ---------------------------------------------------------------- hybrid managers

LOCALS = [
    LocalGroup("sliding_window", span=6, num_blocks=40),
    LocalGroup("chunked_local", span=8, num_blocks=24, block_size=8),
]


def test_hybrid_tables_per_group_by_hand() -> None:
    m = HybridKVCacheManager(16, 4, local_groups=LOCALS[:1])
    m.add_sequence("a", list(range(17)))
    m.allocate("a", 17)  # 5 blocks in each group
    m.commit("a", 17)  # the window of token 17 is 12..17: positions 0-2 released in group 1
    m.step(["a"], [17], [[5]])
    builder = StepMetadataBuilder(m)
    meta = builder.build(["a"], [1])
    assert builder.groups == meta.groups == (0, 1)
    assert meta.block_tables[0].tolist() == [[0, 1, 2, 3, 4]]
    assert meta.block_tables[1].tolist() == [[-1, -1, -1, 3, 4]]
    assert [s.tolist() for s in meta.slot_mappings] == [[17], [17]]


def test_a_window_group_never_shows_a_stale_id_inside_the_window() -> None:
    """A kernel reading only the window of the sliding group finds ids the sequence holds, never a released one."""
    m = HybridKVCacheManager(64, 2, local_groups=[LocalGroup("sliding_window", span=5, num_blocks=64)])
    m.add_sequence("a", [1, 2, 3])
    m.allocate("a", 3)
    builder = StepMetadataBuilder(m)
    computed = 0
    for step in range(40):
        meta = builder.build(["a"], [m.num_allocated_tokens("a") - m.num_computed_tokens("a")])
        computed = int(meta.seq_lens[0])
        window_start = max(0, computed - 1 - 5 + 1)  # what the last new token attends to
        row = meta.block_tables[1][0].tolist()
        held = set(m.group_block_table("a", 1)) - {-1}
        for position in range(window_start // 2, -(-computed // 2)):
            assert row[position] in held and m.group_pool(1).ref_count(row[position]) > 0
        assert all(b == -1 for b in row[: m.group_block_table("a", 1).count(-1)])
        m.step(["a"], [computed], [[step]])


# ---------------------------------------------------------------- the state machine


class TinyBuilder(StepMetadataBuilder):
    """Starts with 2 rows of 1 block: row reuse and growth of both dimensions happen within a few steps."""

    _ROWS = 2
    _WIDTH = 1


class StepMetadataMachine(RuleBasedStateMachine):
    """Admissions, steps (chunked prefill, decode, drafts), frees and preemptions; after every step the
    builder's tensors equal the reference rebuilt from the manager's tables."""

    @initialize(hybrid=st.booleans(), num_blocks=st.integers(12, 40), seed=st.integers(0, 2**16), small=st.booleans())
    def setup(self, hybrid: bool, num_blocks: int, seed: int, small: bool) -> None:
        if hybrid:
            self.m: KVCacheManager = HybridKVCacheManager(num_blocks, 4, local_groups=LOCALS)
            self.sizes = [4, 4, 8]
        else:
            self.m = KVCacheManager(num_blocks=num_blocks, block_size=4)
            self.sizes = [4]
        self.builder = (TinyBuilder if small else StepMetadataBuilder)(self.m)
        self.rng = random.Random(seed)
        self.ids = itertools.count()
        self.waiting: list[int] = []
        self.running: dict[int, int | None] = {}  # seq -> tokens the last forward pass computed (None: none yet)

    @rule(length=st.integers(1, 30), shared=st.integers(0, 16))
    def add(self, length: int, shared: int) -> None:
        seq = next(self.ids)
        prompt = [*range(min(shared, length)), *(1000 + seq * 50 + i for i in range(length - min(shared, length)))]
        self.m.add_sequence(seq, prompt)
        self.waiting.append(seq)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.waiting))
        hit = self.m.lookup(seq).total
        chunk = data.draw(st.integers(1, self.m.num_tokens(seq) - hit))
        if self.m.allocate(seq, chunk) is not None:
            self.waiting.remove(seq)
            self.running[seq] = None
            self.check_build([seq])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        m = self.m
        batch = data.draw(st.lists(st.sampled_from(sorted(self.running)), min_size=1, unique=True))
        commits, appends, news, drafts = [], [], [], []
        for seq in batch:
            pending = self.running[seq]
            known = m.num_tokens(seq)
            sampled = pending is not None and pending >= known
            appends.append([7] if sampled else None)
            commits.append(None if pending is None else min(pending, known + sampled))
            news.append(data.draw(st.integers(1, 6)))
            drafts.append(data.draw(st.integers(0, 3)))
        failed = set(m.step(batch, commits, appends, news, drafts))
        ran = [s for s in batch if s not in failed]
        self.check_build(ran)

    def check_build(self, batch: list[int]) -> None:
        m = self.m
        self.rng.shuffle(batch)
        queries = [self.rng.randint(1, m.num_allocated_tokens(s) - m.num_computed_tokens(s)) for s in batch]
        meta = self.builder.build(batch, queries)
        assert_matches(meta, reference(m, batch, queries, self.sizes))
        for seq, q in zip(batch, queries):
            self.running[seq] = m.num_computed_tokens(seq) + q

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def leave(self, data: st.DataObject, preempt: bool) -> None:
        seq = data.draw(st.sampled_from(sorted(self.running)))
        del self.running[seq]
        if preempt:
            self.m.preempt(seq)
            self.waiting.append(seq)
        else:
            self.m.free(seq)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def drop_waiting(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.waiting))
        self.waiting.remove(seq)
        self.m.free(seq)

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "m"):
            self.m.check_integrity()


StepMetadataMachine.TestCase.settings = settings(max_examples=250, stateful_step_count=30, deadline=None)
test_step_metadata_machine = StepMetadataMachine.TestCase


@pytest.mark.cuda
def test_on_cuda_the_tensors_equal_the_cpu_ones_over_many_steps() -> None:
    """Pinned staging, one copy per array, and staging reused only after the last copies ran."""
    m = KVCacheManager(num_blocks=4096, block_size=16)
    ids = list(range(64))
    for i in ids:
        m.add_sequence(i, [i, *range(40)])
        m.allocate(i, 41)
    on_cpu, on_gpu = StepMetadataBuilder(m), StepMetadataBuilder(m, "cuda")
    queries = [41] * 64
    kept = []
    for step in range(30):
        cpu_meta, gpu_meta = on_cpu.build(ids, queries), on_gpu.build(ids, queries)
        assert gpu_meta.block_table.is_cuda and gpu_meta.slot_mapping.is_cuda
        for name in ("block_table", "slot_mapping", "positions", "seq_lens", "query_start_loc"):
            assert torch.equal(getattr(gpu_meta, name).cpu(), getattr(cpu_meta, name)), name
        kept.append((gpu_meta.slot_mapping, cpu_meta.slot_mapping.clone()))
        m.step(ids, [m.num_allocated_tokens(i) for i in ids], [[step]] * 64)
        queries = [1] * 64
    for gpu, cpu in kept:  # earlier steps' device tensors were not overwritten by later builds
        assert torch.equal(gpu.cpu(), cpu)
