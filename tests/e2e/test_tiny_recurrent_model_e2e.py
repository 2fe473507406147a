"""End to end: a tiny model with full attention beside gated linear recurrences, over HybridKVCacheManager.

Prefix caching must leave every logit equal (to float noise) to an uncached run and to a dense
recomputation while computing fewer tokens. A hit restores exactly the state checkpointed at its
end; a new slot's stale bytes (NaN here) are cleared by the plan's zero; checkpoints not cached
(never used, or evicted) are never read; and a checkpoint saved by a step's plan is not handed to a
request admitted in that same step.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.support.examples import load_example

tiny = load_example("tiny_recurrent_model")

MODEL = tiny.TinyRecurrentModel()
PROMPTS = tiny.shared_prefix_prompts()
BLOCK = 4
SLOTS = 2
DECODE = 6  # a1 and a2 end at 36 tokens: a save from a freed slot shares a plan with the slot's next zero
TOLERANCE = 1e-4  # float32; the runs differ only in how tokens are batched into matmuls
NAN = float("nan")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matrices: on a busy 2-core machine more threads only contend (100x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _engine(**options: object) -> tiny.Engine:
    options = {"block_size": BLOCK, "num_slots": SLOTS, "decode_steps": DECODE, **options}
    return tiny.Engine(MODEL, **options)


def _serve(engine: tiny.Engine, prompts: dict[str, list[int]] = PROMPTS) -> tiny.Run:
    for request, prompt in prompts.items():
        engine.submit(request, prompt)
    return engine.drain()


@pytest.fixture(scope="module")
def plain() -> tiny.Run:
    """Prefix caching disabled: every prompt token computed."""
    return _serve(_engine(caching=False))


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _same_logits(a: tiny.Run, b: tiny.Run) -> bool:
    finite = all(bool(torch.isfinite(x).all()) for logits in b.logits.values() for x in logits)
    return finite and tiny.max_logit_difference(a, b) < TOLERANCE


@pytest.mark.parametrize("every", [1, 2])
def test_cached_logits_equal_uncached_and_dense_with_fewer_tokens_computed(plain: tiny.Run, every: int) -> None:
    engine = _engine(checkpoint_every=every)
    cached = _serve(engine)
    assert _same_logits(plain, cached)
    assert _same_logits(tiny.reference(MODEL, cached), cached)
    assert _same_logits(tiny.reference(MODEL, plain), plain)
    assert cached.tokens == plain.tokens
    decoded = DECODE * len(PROMPTS)
    assert plain.hit_tokens == 0 and plain.computed_tokens == plain.prompt_tokens + decoded
    assert cached.computed_tokens == plain.prompt_tokens + decoded - cached.hit_tokens
    assert cached.computed_tokens < plain.computed_tokens
    # Hits end on a checkpoint: the shared prefix with the earlier request, down to a multiple of the spacing.
    # a2 shares a1's system prompt but is admitted with it, before any checkpoint exists: no hit.
    step = every * BLOCK
    hits = {r: engine.requests[r].hit for r in PROMPTS}
    expected = {"a1": 0, "a2": 0, "b1": 0}
    for request, earlier in (("a3", "a1"), ("b2", "b1"), ("a4", "a3")):
        expected[request] = _common(PROMPTS[request], PROMPTS[earlier]) // step * step
    assert hits == expected and all(hits[r] > 0 for r in ("a3", "b2", "a4"))


def test_a_hit_restores_exactly_the_state_checkpointed_at_its_end(plain: tiny.Run) -> None:
    restored: list[tuple[str, int]] = []

    def check(engine, plan) -> None:
        manager = engine.manager
        for request in engine.running:
            r = engine.requests[request]
            if r.admitted_at != engine.steps or not r.hit:
                continue
            slot = manager.state_slot(request, tiny.RECURRENT)
            (op,) = [op for op in plan if op.dst == slot]
            assert op.src >= SLOTS  # restored from a checkpoint
            dense = MODEL.dense_states(r.prompt[: r.hit])
            for i, layer in enumerate(MODEL.config.group_layers(tiny.RECURRENT)):
                for name, tensor in engine.pool.layer(i).items():
                    assert torch.equal(tensor[slot], tensor[op.src])
                    assert torch.allclose(tensor[slot], dense[layer][name], atol=1e-5)
            restored.append((request, r.hit))

    engine = _engine()
    engine.after_plan = check
    assert _same_logits(plain, _serve(engine))
    assert [request for request, _ in restored] == ["a3", "b2", "a4"]


def _poison_new_slots(engine, plan) -> None:
    """NaN into every running slot but those of sequences admitted in an earlier step: the free ones
    (freed slots keep their last sequence's state) and those admitted now."""
    manager = engine.manager
    kept = {
        manager.state_slot(request, tiny.RECURRENT)
        for request in engine.running
        if engine.requests[request].admitted_at < engine.steps
    }
    for slot in set(range(SLOTS)) - kept:
        for tensor in engine.pool.tensors.values():
            tensor[slot] = NAN


def _saves_then_reuses(plan, slots: int) -> bool:
    """Whether ``plan`` saves a slot into a checkpoint and later zeroes or restores into that slot."""
    saved = set()
    for op in plan:
        if op.dst < slots and op.dst in saved:
            return True
        if op.src is not None and op.src < slots <= op.dst:
            saved.add(op.src)
    return False


def test_stale_slots_are_cleared_by_the_plan(plain: tiny.Run) -> None:
    order_dependent = []

    def poison(engine, plan) -> None:
        order_dependent.append(_saves_then_reuses(plan, SLOTS))
        _poison_new_slots(engine, plan)

    engine = _engine()
    engine.before_plan = poison
    assert _same_logits(plain, _serve(engine))
    assert any(order_dependent)  # a freed slot's last save and its reuse ran in one plan, in order


def test_without_the_zero_the_poison_reaches_the_logits() -> None:
    """The control: the same poison, with the plan's zero operations dropped."""

    def poison(engine, plan) -> None:
        _poison_new_slots(engine, plan)
        plan[:] = [op for op in plan if op.src is not None]

    engine = _engine()
    engine.before_plan = poison
    run = _serve(engine)
    assert not all(bool(torch.isfinite(x).all()) for x in run.logits["a1"])


class _CheckpointPoison:
    """Before each plan (taken: the checkpoints it saves are not findable yet), NaN into every checkpoint
    that is not cached -- never used, evicted, or about to be written by this plan's saves -- or, with
    ``sources``, into those the plan restores from."""

    def __init__(self, sources: bool = False) -> None:
        self.sources = sources
        self.cached: set[int] = set()  # checkpoints seen cached at an earlier plan
        self.evicted_then_poisoned: set[int] = set()

    def __call__(self, engine, plan) -> None:
        if self.sources:
            targets = {op.src for op in plan if op.src is not None and op.src >= SLOTS}
        else:
            pool = engine.manager.group_pool(tiny.RECURRENT)
            cached = {c for c in range(pool.num_blocks) if pool.is_cached(c)}
            targets = {SLOTS + c for c in range(pool.num_blocks) if c not in cached}
            self.evicted_then_poisoned |= self.cached - cached
            self.cached |= cached
        for state in targets:
            for tensor in engine.pool.tensors.values():
                tensor[state] = NAN


def test_checkpoints_not_cached_are_never_read(plain: tiny.Run) -> None:
    poison = _CheckpointPoison()
    engine = _engine(num_checkpoints=6)  # fewer than the prompts' boundaries: checkpoints are evicted
    engine.before_plan = poison
    run = _serve(engine)
    assert poison.evicted_then_poisoned  # checkpoints were evicted, and poisoned from then on
    assert run.hit_tokens > 0
    assert _same_logits(plain, run)


def test_poisoning_a_restore_source_reaches_the_logits() -> None:
    engine = _engine()
    engine.before_plan = _CheckpointPoison(sources=True)
    run = _serve(engine)
    assert not all(bool(torch.isfinite(x).all()) for x in run.logits["a3"])


def test_a_request_admitted_in_the_step_whose_plan_saves_a_checkpoint_does_not_take_it() -> None:
    """The first request commits 4, 8, 12, ... one chunk per step (commits at the end of step t, saved by
    plan t + 1). A second request with the same prompt, admitted in step 3 -- whose plan saves the state
    at 12 -- does not take it, though the full-attention blocks up to 12 are cached. It starts from 4:
    plan t is known to have run only at the next take (step t + 1, after that step's admissions), so
    by step 3's admissions only plan 1 (the save at 4) is. One admitted in step 5 takes 12."""
    prompt = PROMPTS["a4"]
    engine = _engine(num_slots=3)
    engine.submit("first", prompt)
    for _ in range(3):
        engine.step()
    assert engine.requests["first"].done == 3 * BLOCK  # committed: the save at 12 is in the next step's plan
    saving: list[list[tuple[int | None, int]]] = []
    engine.before_plan = lambda e, plan: saving.append([(op.src, op.dst) for op in plan])
    engine.submit("second", prompt)
    engine.step()
    slot = engine.manager.state_slot("first", tiny.RECURRENT)
    assert any(src == slot and dst >= 3 for src, dst in saving[0])  # this step's plan saves first's state at 12
    assert engine.manager.tree.match_length(engine.manager.block_hashes("second"), 10) >= 3
    second = engine.requests["second"].hit
    assert second == BLOCK
    engine.before_plan = None
    engine.step()
    engine.submit("third", prompt)
    run = engine.drain()
    assert engine.requests["third"].hit == 3 * BLOCK
    dense = tiny.reference(MODEL, run)
    assert _same_logits(dense, run)
    assert run.hit_tokens == second + engine.requests["third"].hit


def test_example_main_prints_the_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    tiny.main()
    out = capsys.readouterr().out
    assert "same generated tokens: True" in out
    assert "cached: " in out and "0 restored" in out
