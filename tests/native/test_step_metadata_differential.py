"""The step-metadata builder compiled against its pure-Python source: the same tensors for the same steps.

A hypothesis-drawn schedule (admissions with shared prefixes, chunked prefill, decodes, preemptions, frees)
drives a manager and a builder from each kvblocks copy; every build's tensors must be equal, element for
element, and a refused build must raise the same error in both.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kvblocks  # noqa: E402
import kvblocks.attention.step_metadata  # noqa: E402
from kvblocks import native  # noqa: E402
from tests.support.side_by_side import TORCH_MODULES, load_pure, outcome  # noqa: E402

pytestmark = pytest.mark.skipif(
    not native.status().compiled, reason="nothing compiled: the pure and the compiled kvblocks are the same code"
)

B = 4
ACTIONS = st.lists(
    st.tuples(st.sampled_from(["admit", "step", "preempt", "free", "build-bad"]), st.integers(0, 5), st.integers(1, 9)),
    min_size=1,
    max_size=40,
)


def tensors(meta: object) -> tuple:
    """Everything a build returns, as plain values."""
    fields = ("block_tables", "slot_mappings")
    out: list[object] = [meta.groups, meta.max_seq_len, meta.max_query_len, meta.num_tokens]  # type: ignore[attr-defined]
    for name in fields:
        out.append(tuple(t.tolist() for t in getattr(meta, name)))
    for name in ("positions", "seq_lens", "query_start_loc"):
        out.append(getattr(meta, name).tolist())
    return tuple(out)


class Side:
    """One copy's manager and builder, and the engine's view of its running sequences."""

    def __init__(self, mods: dict) -> None:
        self.m = mods["kvblocks"].KVCacheManager(num_blocks=24, block_size=B)
        self.builder = mods["kvblocks.attention.step_metadata"].StepMetadataBuilder(self.m)
        self.running: dict[int, int] = {}  # id -> tokens it computes next
        self.known: set[int] = set()  # ids registered with the manager

    def act(self, action: str, seq: int, size: int) -> object:
        m = self.m
        if action == "admit" and seq not in self.running:
            if seq in self.known:  # preempted (or never admitted): registered again with a new prompt
                m.free(seq)
            m.add_sequence(seq, [7, 8, 9, 10, 11, 12][: 1 + seq % 3] * 4 + [seq] * size)
            self.known.add(seq)
            cached = m.lookup(seq).total
            if m.allocate(seq, min(size, m.num_tokens(seq) - cached), num_cached_tokens=cached) is None:
                return "full"
            self.running[seq] = m.num_allocated_tokens(seq) - m.num_computed_tokens(seq)
            return "admitted"
        if action == "step" and self.running:
            ids = sorted(self.running)
            meta = outcome(lambda: tensors(self.builder.build(ids, [self.running[i] for i in ids])))
            computed = [m.num_computed_tokens(i) + self.running[i] for i in ids]
            sampled = [[size] if computed[k] >= m.num_tokens(i) else None for k, i in enumerate(ids)]
            failed = m.step(ids, computed, sampled)
            for i in ids:
                self.running[i] = 1 if i not in failed else 0
            for i in failed:
                m.preempt(i)
                del self.running[i]
            for i in [i for i in self.running if not self.running[i]]:
                del self.running[i]
            return meta, failed
        if action == "preempt" and seq in self.running:
            m.preempt(seq)
            del self.running[seq]
            return "preempted"
        if action == "free" and seq in self.known:
            m.free(seq)
            self.known.discard(seq)
            self.running.pop(seq, None)
            return "freed"
        if action == "build-bad":
            return outcome(lambda: tensors(self.builder.build([seq, seq], [1, 1])))
        return None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ACTIONS)
def test_every_build_gives_the_same_tensors_compiled_and_pure(actions: list[tuple[str, int, int]]) -> None:
    pure = load_pure(TORCH_MODULES)
    compiled = {"kvblocks": kvblocks, "kvblocks.attention.step_metadata": kvblocks.attention.step_metadata}
    assert pure["kvblocks.attention.step_metadata"] is not compiled["kvblocks.attention.step_metadata"]
    a, b = Side(pure), Side(compiled)
    for step in actions:
        assert outcome(lambda side=a, act=step: side.act(*act)) == outcome(lambda side=b, act=step: side.act(*act))
