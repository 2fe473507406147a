"""End to end: a tiny transformer alternating sliding-window and full layers over one KVCacheManager with groups.

Prefix caching must leave every logit equal (to float noise) to an uncached run and to a dense
recomputation while computing fewer tokens; a running sequence holds at most ceil(W / B) + 1
window blocks; and the model never reads a block its window group released (NaN written into
released blocks leaves the logits unchanged, while NaN in a block still in the window does not).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvblocks.hybrid import PLACEHOLDER
from tests.support.examples import load_example

tiny = load_example("tiny_hybrid_model")

MODEL = tiny.TinyHybridModel()
PROMPTS = tiny.shared_prefix_prompts()
BLOCK = 4
WINDOW = MODEL.config.window
DECODE = 6
TOLERANCE = 1e-4  # float32; the runs differ only in how tokens are batched into matmuls
BOUND = math.ceil(WINDOW / BLOCK) + 1


def _run(caching: bool, **kwargs):
    return tiny.generate(MODEL, PROMPTS, caching=caching, decode_steps=DECODE, block_size=BLOCK, **kwargs)


@pytest.fixture(scope="module")
def plain():
    """Prefix caching disabled: every prompt token computed."""
    return _run(False)


def test_windows_are_smaller_than_the_prompts() -> None:
    assert WINDOW < BLOCK * 2 < min(len(p) for p in PROMPTS.values())


@pytest.mark.parametrize("window_blocks", [64, 14], ids=["roomy", "reusing"])
def test_cached_logits_equal_uncached_and_dense(plain, window_blocks: int) -> None:
    """14 window blocks: released blocks are evicted and reused by later sequences, hits still served."""
    fresh: list[int] = []  # never-used blocks left in the window pool, after every step

    def count_fresh(request, step, manager, caches):
        fresh.append(manager.group_pool(tiny.WINDOW).num_fresh)

    cached = _run(True, window_blocks=window_blocks, after_step=count_fresh)
    assert (min(fresh) == 0) == (window_blocks == 14)  # the small pool evicted cached window blocks
    dense = tiny.reference(MODEL, cached)
    assert tiny.max_logit_difference(plain, cached) < TOLERANCE
    assert tiny.max_logit_difference(dense, cached) < TOLERANCE
    assert tiny.max_logit_difference(tiny.reference(MODEL, plain), plain) < TOLERANCE
    assert cached.tokens == plain.tokens
    decoded = DECODE * len(PROMPTS)
    assert plain.hit_tokens == 0 and plain.computed_tokens == plain.prompt_tokens + decoded
    assert cached.hit_tokens > 0
    assert cached.computed_tokens == plain.prompt_tokens + decoded - cached.hit_tokens
    assert cached.computed_tokens < plain.computed_tokens


def test_window_group_holds_at_most_its_bound_per_running_sequence() -> None:
    held: list[tuple[int, int, int, int]] = []  # (step, window entries, window blocks in use, full entries)

    def measure(request, step, manager, caches):
        table = manager.group_block_table(request, tiny.WINDOW)
        pool = manager.group_pool(tiny.WINDOW)
        in_use = sum(1 for b in range(pool.num_blocks) if pool.ref_count(b))
        full = manager.group_block_table(request, tiny.FULL)
        held.append((step, sum(b != PLACEHOLDER for b in table), in_use, len(full)))
        assert len(table) == len(full)

    _run(True, window_blocks=14, after_step=measure)
    decode = [h for h in held if h[0] >= 1]
    assert len(decode) == DECODE * len(PROMPTS)
    assert all(entries <= BOUND and in_use <= BOUND for _, entries, in_use, _ in held)  # one sequence runs at a time
    assert max(full for *_, full in decode) > 3 * BOUND  # the full group keeps far more: the bound is not vacuous
    assert max(entries for _, entries, _, _ in decode) == BOUND  # reached when the window straddles blocks


class _Corrupter:
    """Writes NaN into window-group blocks while a sequence runs, restoring them before it is freed.

    ``outside``: every block of the window pool that the running sequence's table does not hold
    now -- those it released, and every other sequence's cached blocks; ``oldest``: the oldest
    block still in its window (a read the model must do). A block the sequence takes later (fresh
    or evicted) is overwritten by it and is not restored.
    """

    def __init__(self, target: str) -> None:
        self.target = target
        self.saved: dict[int, tuple[torch.Tensor, ...]] = {}
        self.seen: set[int] = set()  # window blocks the running sequence held at some hook
        self.corrupted = 0
        self.released_while_running = 0

    def _corrupt(self, cache, block: int) -> None:
        if block not in self.saved:
            layers = range(cache.spec.num_layers)
            self.saved[block] = tuple(t(i)[block].clone() for i in layers for t in (cache.key, cache.value))
        for i in range(cache.spec.num_layers):
            cache.key(i)[block] = float("nan")
            cache.value(i)[block] = float("nan")
        self.corrupted += 1

    def after_step(self, request, step, manager, caches) -> None:
        live = {b for b in manager.group_block_table(request, tiny.WINDOW) if b != PLACEHOLDER}
        for block in live - self.seen:  # newly taken: its old content is nobody's now
            self.saved.pop(block, None)
        if self.target == "outside":
            outside = set(range(manager.group_pool(tiny.WINDOW).num_blocks)) - live - set(self.saved)
            self.released_while_running += len(outside & self.seen)
            for block in outside:
                self._corrupt(caches[tiny.WINDOW], block)
        elif step >= 1:
            self._corrupt(caches[tiny.WINDOW], min(live, key=manager.group_block_table(request, tiny.WINDOW).index))
        self.seen |= live

    def before_free(self, request, step, manager, caches) -> None:
        cache = caches[tiny.WINDOW]
        for block, tensors in self.saved.items():
            it = iter(tensors)
            for i in range(cache.spec.num_layers):
                cache.key(i)[block] = next(it)
                cache.value(i)[block] = next(it)
        self.saved.clear()
        self.seen.clear()


def test_released_blocks_are_never_read(plain) -> None:
    corrupter = _Corrupter("outside")
    run = _run(True, window_blocks=14, after_step=corrupter.after_step, before_free=corrupter.before_free)
    assert corrupter.released_while_running >= len(PROMPTS)  # each sequence released blocks during its decode
    assert all(bool(torch.isfinite(x).all()) for logits in run.logits.values() for x in logits)
    assert tiny.max_logit_difference(plain, run) < TOLERANCE


def test_corrupting_a_block_in_the_window_changes_the_logits(plain) -> None:
    """The control: the same corruption where the model must read reaches the logits."""
    corrupter = _Corrupter("oldest")
    run = _run(True, after_step=corrupter.after_step, before_free=corrupter.before_free)
    assert corrupter.corrupted == DECODE * len(PROMPTS)
    assert not all(bool(torch.isfinite(x).all()) for logits in run.logits.values() for x in logits)


def test_a_placeholder_inside_the_window_is_refused() -> None:
    """The model's guard: a key it attends to in a released block raises instead of reading stale KV."""
    manager = tiny.KVCacheManager(16, BLOCK, groups=[tiny.LocalGroup("sliding_window", span=WINDOW, num_blocks=16)])
    backend = tiny.get_backend("cpu")
    caches = {g: backend.allocate(MODEL.config.cache_spec(g, BLOCK), 16) for g in (tiny.FULL, tiny.WINDOW)}
    prompt = PROMPTS["a1"][:17]
    manager.add_sequence("r", prompt)
    manager.allocate("r", 17)
    tables = tiny._tables(manager, "r")
    MODEL.forward(prompt, 0, caches, tables)
    manager.commit("r", 17)  # the next token (17) attends to 12..17: positions 0-11 released
    tables = tiny._tables(manager, "r")
    assert tables[tiny.WINDOW][:3] == [PLACEHOLDER] * 3 and PLACEHOLDER not in tables[tiny.WINDOW][3:]
    manager.allocate("r", 1)
    tables = tiny._tables(manager, "r")
    MODEL.forward([1], 17, caches, tables)  # reads 12..17 only: fine
    with pytest.raises(tiny.ReleasedBlockRead, match="position 11"):
        MODEL.forward([1], 16, caches, tables)  # position 16 attends to 11, whose block was released


def test_example_main_prints_the_comparison(capsys) -> None:
    tiny.main()
    out = capsys.readouterr().out
    assert "same generated tokens: True" in out
