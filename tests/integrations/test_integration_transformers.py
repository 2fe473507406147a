"""kvblocks as the paged KV cache of real transformers models: the outputs are the model's own.

Tiny models built from configs with random weights (fixed seed, float32, CPU, no downloads).
The reference is ``model.generate`` (greedy, EOS disabled) with transformers' own cache.
"""

from __future__ import annotations

import contextvars
import dataclasses
import random
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks.errors import ConfigError, InvalidArgumentError, InvalidTokenError
from kvblocks.hybrid import HybridKVCacheManager
from kvblocks.integrations.transformers import ATTENTION_NAME, PagedGenerator, entry_format
from kvblocks.tiers import FileStorage, LoadResult, MemoryStorage, TierConfig
from kvblocks.tiers.executor import TransferExecutor
from tests.support.transformers_models import (
    FAMILIES,
    LEARNED_POSITIONS,
    SIZES,
    VOCAB,
    WINDOW,
    assert_matches_reference,
    model,
    reference,
    shared_prefix_prompts,
)


def checked(family: str, **kwargs: Any) -> tuple[PagedGenerator, list[int]]:
    """A generator whose manager is checked after every step; the step count it saw."""
    steps = [0]

    def after(gen: PagedGenerator) -> None:
        gen.manager.check_integrity()
        steps[0] += 1

    return PagedGenerator(model(family), after_step=after, **kwargs), steps


def work(prompts: list[list[int]], max_new_tokens: int) -> int:
    """Tokens whose K/V a run without any cache hit computes: every prompt token and every new one but the last."""
    return sum(len(p) + max_new_tokens - 1 for p in prompts)


# ---------------------------------------------------------------------------------------------- outputs


@pytest.mark.parametrize("family", sorted(FAMILIES) + sorted(LEARNED_POSITIONS))
def test_greedy_tokens_and_logits_match_generate_with_hits_equal_to_skipped_tokens(family: str) -> None:
    prompts = shared_prefix_prompts()
    gen, steps = checked(family, num_blocks=64, block_size=4, max_running=2, max_batch_tokens=16)
    outs = gen.generate(prompts, max_new_tokens=5)
    assert_matches_reference(family, gen, prompts, outs)
    stats = gen.manager.stats
    assert stats.hit_tokens > 0  # later prompts found the shared system prompts
    assert gen.computed_tokens == work(prompts, 5) - stats.hit_tokens
    assert steps[0] > len(prompts)  # batched steps, checked after each
    assert stats.blocks_in_use == 0 and gen.manager.num_sequences == 0
    # a second call on the same generator: hits across calls, the same tokens
    before, hits_before = gen.computed_tokens, stats.hit_tokens
    again = gen.generate(prompts[:2], max_new_tokens=5)
    assert again == outs[:2]
    hits = gen.manager.stats.hit_tokens - hits_before
    assert hits >= sum(len(p) // 4 * 4 - 4 for p in prompts[:2])  # whole blocks of each prompt (model-dependent)
    assert gen.computed_tokens - before == work(prompts[:2], 5) - hits


def test_the_layer_kinds_pick_the_manager() -> None:
    assert isinstance(PagedGenerator(model("qwen2"), num_blocks=8, block_size=4).manager, HybridKVCacheManager)
    assert isinstance(PagedGenerator(model("gemma2"), num_blocks=8, block_size=4).manager, HybridKVCacheManager)
    for family in ("llama", "mistral", "qwen3"):
        assert not isinstance(PagedGenerator(model(family), num_blocks=8, block_size=4).manager, HybridKVCacheManager)


@pytest.mark.parametrize("family", ["llama", "qwen2", *sorted(LEARNED_POSITIONS)])
def test_a_pool_that_holds_one_request_but_not_all_gives_the_same_tokens(family: str) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(9, 14))] for _ in range(4)]
    # 6 blocks of 4: one request (at most 14 + 7 tokens) fits, two prefills fit, two decoding ones do not
    gen, _ = checked(family, num_blocks=6, block_size=4, max_running=4, window_blocks=8)
    outs = gen.generate(prompts, max_new_tokens=8)
    assert_matches_reference(family, gen, prompts, outs)
    assert gen.manager.stats.preemptions > 0  # the pressure made it preempt and recompute
    assert gen.manager.stats.blocks_in_use == 0


@settings(max_examples=12, deadline=None)
@given(
    st.data(),
    st.sampled_from(["llama", "qwen2", "mistral"]),
    st.integers(min_value=6, max_value=24),
    st.sampled_from([2, 4]),
    st.integers(min_value=1, max_value=4),
    st.integers(min_value=3, max_value=24),
)
def test_random_arrivals_and_pool_sizes_give_the_models_tokens(
    data: st.DataObject, family: str, num_blocks: int, block_size: int, max_running: int, max_batch_tokens: int
) -> None:
    """Batches of requests over shared prefixes arrive call after call on one generator; any pool that
    holds one request alone (waiting, preemption, chunked prefill as they come) gives the model's tokens."""
    pool = shared_prefix_prompts(seed=2)
    max_new = data.draw(st.integers(min_value=1, max_value=4), label="max_new_tokens")
    longest = (num_blocks * block_size) - max_new + 1
    pool = [p for p in pool if len(p) <= longest] or [[5, 6, 7]]
    gen, _ = checked(
        family,
        num_blocks=num_blocks,
        block_size=block_size,
        max_running=max_running,
        max_batch_tokens=max_batch_tokens,
        window_blocks=num_blocks,
    )
    hits = 0
    for _ in range(data.draw(st.integers(min_value=1, max_value=3), label="arrivals")):
        prompts = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4), label="prompts")
        before, hits_before = gen.computed_tokens, gen.manager.stats
        outs = gen.generate(prompts, max_new_tokens=max_new)
        assert_matches_reference(family, gen, prompts, outs)
        stats = gen.manager.stats
        hits = stats.hit_tokens - hits_before.hit_tokens
        computed = gen.computed_tokens - before
        if stats.preemptions == hits_before.preemptions:
            assert computed == work(prompts, max_new) - hits
        else:  # a readmission may hit blocks another sequence computed meanwhile, or recompute its own
            readmission_hits = stats.readmission_hit_tokens - hits_before.readmission_hit_tokens
            assert computed >= work(prompts, max_new) - hits - readmission_hits
        assert stats.blocks_in_use == 0 and gen.manager.num_sequences == 0


# ---------------------------------------------------------------------------------------------- tiers


def test_a_host_tier_under_a_small_pool_serves_evicted_prefixes_with_the_same_tokens() -> None:
    prompts = shared_prefix_prompts()
    # 8 blocks of 4: one request at a time fits; the other system prompt's blocks are evicted to host
    gen, steps = checked("llama", num_blocks=8, block_size=4, max_running=1, tiers=TierConfig(num_host_blocks=32))
    outs = gen.generate(prompts, max_new_tokens=5)
    assert_matches_reference("llama", gen, prompts, outs)
    again = gen.generate(prompts, max_new_tokens=5)
    assert again == outs
    assert_matches_reference("llama", gen, prompts, again)
    stats, tiers = gen.manager.stats, gen.manager.tier_stats
    assert tiers.swap_outs > 0 and tiers.swap_ins > 0
    assert stats.hit_tokens_host > 0  # the blocks the small pool evicted came back from host
    assert stats.preemptions == 0 and gen.computed_tokens == 2 * work(prompts, 5) - stats.hit_tokens
    assert stats.blocks_in_use == 0 and gen.manager.num_sequences == 0
    assert steps[0] > 2 * len(prompts)


def storage_tiers(directory: Any, family: str, **kwargs: Any) -> TierConfig:
    """A host tier and a ``FileStorage`` on ``directory``: every committed block is written through."""
    return TierConfig(
        num_host_blocks=16,
        storage=FileStorage(directory),
        entry_format=entry_format(model(family), block_size=4),
        storage_policy="write-through",
        storage_timeout_s=30.0,  # a busy test machine: a slow read is not a miss
        **kwargs,
    )


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_a_restarted_generator_on_the_same_directory_gets_storage_hits_and_the_same_tokens(
    family: str, tmp_path: Any
) -> None:
    prompts = shared_prefix_prompts()
    first, _ = checked(family, num_blocks=16, block_size=4, max_running=2, tiers=storage_tiers(tmp_path, family))
    with first:
        outs = first.generate(prompts, max_new_tokens=4)
        assert_matches_reference(family, first, prompts, outs)
        written = first.manager.tier_stats.writer.written
    assert written > 0 and any(path.is_file() for path in tmp_path.rglob("*"))
    assert first.manager.stats.hit_tokens_storage == 0  # nothing was stored before it

    # a new generator: a fresh manager and caches, the same model and directory
    second, _ = checked(family, num_blocks=16, block_size=4, max_running=2, tiers=storage_tiers(tmp_path, family))
    with second:
        again = second.generate(prompts, max_new_tokens=4)
    assert again == outs
    assert_matches_reference(family, second, prompts, again)
    stats, storage = second.manager.stats, second.manager.tier_stats.storage
    assert stats.hit_tokens_storage > 0 and storage.loads_hit > 0 and storage.loads_corrupt == 0
    assert_computed(second.computed_tokens, work(prompts, 4), stats)
    assert second.computed_tokens < first.computed_tokens
    assert stats.blocks_in_use == 0 and second.manager.num_sequences == 0


def assert_computed(computed: int, uncached: int, stats: Any) -> None:
    """Computed tokens == uncached tokens - hits; after a preemption (which storage waits make timing-dependent
    here) a readmission may also recompute its own tokens or hit blocks another sequence computed meanwhile."""
    if not stats.preemptions:
        assert computed == uncached - stats.hit_tokens
    else:
        assert computed >= uncached - stats.hit_tokens - stats.readmission_hit_tokens


def test_corrupt_stored_entries_are_recomputed_and_zeroed_loads_would_show(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A damaged entry cuts the loaded prefix short (the rest is computed, same tokens); and the comparison has
    teeth: loads written as zeros change the logits."""
    prompts = shared_prefix_prompts()
    with PagedGenerator(model("llama"), num_blocks=16, block_size=4, tiers=storage_tiers(tmp_path, "llama")) as first:
        outs = first.generate(prompts, max_new_tokens=4)
    entries = sorted(path for path in tmp_path.rglob("*") if path.is_file())
    for path in entries[::2]:  # every other entry's last payload byte flipped: its checksum fails
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x5A
        path.write_bytes(bytes(data))
    damaged, _ = checked("llama", num_blocks=16, block_size=4, tiers=storage_tiers(tmp_path, "llama"))
    with damaged:
        assert damaged.generate(prompts, max_new_tokens=4) == outs
    assert_matches_reference("llama", damaged, prompts, outs)
    stats, storage = damaged.manager.stats, damaged.manager.tier_stats.storage
    assert storage.loads_corrupt > 0
    assert_computed(damaged.computed_tokens, work(prompts, 4), stats)

    def zeroed(self: TransferExecutor, loads: list[LoadResult]) -> None:
        for result in loads:
            payloads = tuple(tuple(memoryview(bytes(len(p))) for p in parts) for parts in result.payloads)
            original(self, [dataclasses.replace(result, payloads=payloads)])

    original = TransferExecutor.apply
    monkeypatch.setattr(TransferExecutor, "apply", zeroed)
    with PagedGenerator(model("llama"), num_blocks=16, block_size=4, tiers=storage_tiers(tmp_path, "llama")) as broken:
        broken.generate(prompts, max_new_tokens=4)
    assert broken.manager.tier_stats.storage.loads_hit > 0
    ref = [reference("llama", tuple(p), 4)[1] for p in prompts]
    assert max(float((got - want).abs().max()) for got, want in zip(broken.last_logits, ref)) > 1e-2


def test_tiers_under_capacity_pressure_with_preemption_snapshots_give_the_same_tokens() -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(9, 14))] for _ in range(4)]
    tiers = TierConfig(
        num_host_blocks=4,  # smaller than the working set too: host evictions go to storage
        storage=MemoryStorage(),
        entry_format=entry_format(model("llama"), block_size=4),
        save_on_preempt=True,
        storage_timeout_s=30.0,
    )
    gen, _ = checked("llama", num_blocks=6, block_size=4, max_running=4, tiers=tiers)
    with gen:
        outs = gen.generate(prompts, max_new_tokens=8)
        assert_matches_reference("llama", gen, prompts, outs)
        again = gen.generate(prompts[::-1], max_new_tokens=8)
    assert_matches_reference("llama", gen, prompts[::-1], again)
    stats, tier_stats = gen.manager.stats, gen.manager.tier_stats
    assert stats.preemptions > 0 and tier_stats.storage.saves_queued > 0
    assert stats.hit_tokens_host + stats.hit_tokens_storage > 0
    assert stats.blocks_in_use == 0 and gen.manager.num_sequences == 0


@settings(max_examples=10, deadline=None)
@given(
    st.data(),
    st.sampled_from(["llama", "mistral"]),
    st.integers(min_value=6, max_value=16),
    st.integers(min_value=0, max_value=12),
    st.sampled_from(["write-back", "write-through"]),
    st.booleans(),
)
def test_random_arrivals_over_tiers_give_the_models_tokens(
    data: st.DataObject, family: str, num_blocks: int, host_blocks: int, policy: str, save_on_preempt: bool
) -> None:
    """Calls after calls over shared prefixes, a small pool over a host tier and storage of any policy."""
    pool = [p for p in shared_prefix_prompts(seed=3) if len(p) <= num_blocks * 4 - 3] or [[5, 6, 7]]
    tiers = TierConfig(
        num_host_blocks=host_blocks,
        host_policy=policy,
        storage=MemoryStorage(),
        entry_format=entry_format(model(family), block_size=4),
        storage_policy=policy,
        save_on_preempt=save_on_preempt,
        storage_timeout_s=30.0,
    )
    max_running = data.draw(st.integers(min_value=1, max_value=3), label="max_running")
    gen, _ = checked(family, num_blocks=num_blocks, block_size=4, max_running=max_running, tiers=tiers)
    with gen:
        for _ in range(data.draw(st.integers(min_value=1, max_value=3), label="arrivals")):
            prompts = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3), label="prompts")
            outs = gen.generate(prompts, max_new_tokens=3)
            assert_matches_reference(family, gen, prompts, outs)
            assert gen.manager.stats.blocks_in_use == 0 and gen.manager.num_sequences == 0


def test_tiers_are_refused_for_mixed_layers_and_a_foreign_entry_format(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="mixes full and sliding"):
        PagedGenerator(model("qwen2"), num_blocks=8, block_size=4, tiers=TierConfig(num_host_blocks=8))
    with pytest.raises(ConfigError):
        entry_format(model("gemma2"), block_size=4)
    other = TierConfig(storage=MemoryStorage(), entry_format=entry_format(model("qwen3"), block_size=4))
    with pytest.raises(ConfigError, match="entry_format"):
        PagedGenerator(model("llama"), num_blocks=8, block_size=4, tiers=other)
    with pytest.raises(ConfigError, match="TierConfig"):
        PagedGenerator(model("llama"), num_blocks=8, block_size=4, tiers={"num_host_blocks": 8})  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("prompts", "max_new_tokens", "error"),
    [
        ([[1, 2], []], 4, InvalidTokenError),  # an empty prompt
        ([[1, VOCAB]], 4, InvalidTokenError),  # outside the vocabulary
        ([[1, -1]], 4, InvalidTokenError),
        ([[1, True]], 4, InvalidTokenError),
        ([[1, 2.0]], 4, InvalidTokenError),
        ([[1, 2]], 0, InvalidArgumentError),
        ([[1, 2]], 2.5, InvalidArgumentError),
        ("hello", 4, InvalidArgumentError),
        (["hello"], 4, InvalidArgumentError),
        ([[1, 2], 3], 4, InvalidArgumentError),
        ([[1] * 80], 4, ConfigError),  # more blocks than the pool has
    ],
)
def test_bad_input_raises_before_any_work(prompts: Any, max_new_tokens: Any, error: type[Exception]) -> None:
    gen = PagedGenerator(model("llama"), num_blocks=16, block_size=4)
    with pytest.raises(error):
        gen.generate(prompts, max_new_tokens=max_new_tokens)
    assert gen.computed_tokens == 0 and gen.manager.num_sequences == 0
    assert gen.manager.stats.admissions == 0
    assert model("llama").config._attn_implementation != ATTENTION_NAME


def test_unsupported_models_and_settings_are_refused() -> None:
    with pytest.raises(ConfigError):
        PagedGenerator(torch.nn.Linear(2, 2), num_blocks=8)
    with pytest.raises(ConfigError):
        PagedGenerator(model("llama"), num_blocks=8, max_running=0)
    torch.manual_seed(0)
    odd = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES))
    odd.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ConfigError, match="linear_attention"):
        PagedGenerator(odd, num_blocks=8)


def test_without_transformers_the_import_names_the_extra() -> None:
    code = (
        "import sys\n"
        "sys.modules['transformers'] = None  # as if transformers were not installed\n"
        "import kvblocks.integrations\n"
        "try:\n"
        "    import kvblocks.integrations.transformers\n"
        "except kvblocks.BackendUnavailableError as error:\n"
        "    print(error)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert 'pip install "kvblocks[transformers]"' in out


def test_the_paged_attention_refuses_a_forward_outside_the_generator() -> None:
    llama = model("llama")
    previous = llama.config._attn_implementation
    llama.config._attn_implementation = ATTENTION_NAME
    try:
        with pytest.raises(ConfigError, match="PagedGenerator"):
            llama(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    finally:
        llama.config._attn_implementation = previous


# ---------------------------------------------------------------------------------------------- canaries


CANARY_CONTEXT: contextvars.ContextVar[object] = contextvars.ContextVar("kvblocks_canary", default=None)


@pytest.fixture
def recorded() -> Any:
    """An attention implementation that records what each call received and defers to eager attention."""
    calls: list[dict[str, Any]] = []

    def record(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        calls.append(
            {
                "layer": module.layer_idx,
                "mask": attention_mask,
                "query": query.shape,
                "key": key.shape,
                "context": CANARY_CONTEXT.get(),
                **kwargs,
            }
        )
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, scaling=kwargs.get("scaling"))

    transformers.AttentionInterface.register("kvblocks_canary", record)
    yield calls


def run_with(family: str, implementation: str, **kwargs: Any) -> Any:
    built = model(family)
    previous = built.config._attn_implementation
    built.config._attn_implementation = implementation
    try:
        with torch.inference_mode():
            return built(input_ids=torch.tensor([[1, 2, 3, 4, 5]]), use_cache=False, **kwargs)
    finally:
        built.config._attn_implementation = previous


@pytest.mark.parametrize("family", sorted(FAMILIES) + sorted(LEARNED_POSITIONS))
def test_canary_a_context_variable_set_around_the_forward_reaches_every_layers_attention_call(
    family: str, recorded: Any
) -> None:
    """The step travels this way (GPT-2 and GPT-BigCode drop extra keyword arguments of ``model(...)``)."""
    marker = object()
    token = CANARY_CONTEXT.set(marker)
    try:
        run_with(family, "kvblocks_canary", position_ids=torch.tensor([[7, 8, 9, 10, 11]]))
    finally:
        CANARY_CONTEXT.reset(token)
    assert [c["layer"] for c in recorded] == [0, 1]
    assert all(c["context"] is marker for c in recorded)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_canary_no_mask_is_built_for_a_custom_implementation(family: str, recorded: Any) -> None:
    run_with(family, "kvblocks_canary")
    assert recorded and all(c["mask"] is None for c in recorded)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_canary_packed_queries_and_keys_arrive_as_batch_one_heads_first(family: str, recorded: Any) -> None:
    run_with(family, "kvblocks_canary")
    config = model(family).config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for call in recorded:
        assert tuple(call["query"]) == (1, config.num_attention_heads, 5, head_dim)
        assert tuple(call["key"]) == (1, config.num_key_value_heads, 5, head_dim)


def test_canary_each_layer_passes_its_window_and_the_config_lists_it(recorded: Any) -> None:
    for family, windows in (
        ("llama", [None, None]),
        ("mistral", [WINDOW, WINDOW]),
        ("qwen2", [None, WINDOW]),
        ("gemma2", [WINDOW, None]),
    ):
        recorded.clear()
        run_with(family, "kvblocks_canary")
        assert [c.get("sliding_window") for c in recorded] == windows, family
    config = model("qwen2").config
    assert config.layer_types == ["full_attention", "sliding_attention"]


def test_canary_explicit_position_ids_reach_the_rotary_embedding() -> None:
    """Packed sequences restart their positions: the model must use the given ones, not 0..T-1."""
    default = run_with("llama", "sdpa").logits[0]
    gapped = run_with("llama", "sdpa", position_ids=torch.tensor([[0, 1, 2, 3, 9]])).logits[0]
    assert torch.allclose(default[:4], gapped[:4], atol=1e-6)
    assert not torch.allclose(default[4], gapped[4], atol=1e-3)
