"""PagedGenerator on families built unlike Llama: the outputs are still the model's own, or the model is refused.

GPT-2 and GPT-BigCode drop extra keyword arguments before their attention call (the step reaches it
through a context variable), OPT builds a causal mask of its own, GPT-BigCode shares one K/V head,
GPT-BigCode and BioGPT do not declare ``_supports_attention_backend``; all use learned absolute
positions. The reference is ``model.generate`` (greedy, EOS disabled), as in test_integration_transformers.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
import transformers

from kvblocks.errors import ConfigError, InvalidTokenError
from kvblocks.integrations.transformers import ATTENTION_NAME, PagedGenerator
from tests.support.transformers_models import (
    FAMILIES as ATTENTION_KWARGS_FAMILIES,
)
from tests.support.transformers_models import (
    LEARNED_POSITIONS,
    VOCAB,
    assert_matches_reference,
    model,
    reference,
    shared_prefix_prompts,
)

FAMILIES = sorted(LEARNED_POSITIONS)


def fresh(family: str) -> Any:
    """A new model of ``family`` (its own config), for tests that alter it."""
    torch.manual_seed(0)
    return {**ATTENTION_KWARGS_FAMILIES, **LEARNED_POSITIONS}[family]().eval()


def attention_module(built: Any, layer: int) -> torch.nn.Module:
    """The attention module of ``layer`` (the one whose calls reach the attention function)."""
    for module in built.modules():
        if "Attention" in type(module).__name__ and getattr(module, "layer_idx", None) == layer:
            return module  # type: ignore[no-any-return]
    raise LookupError(f"no attention module of layer {layer}")


# ---------------------------------------------------------------------------------------------- outputs
# (generate with shared prefixes and under capacity pressure: test_integration_transformers.py, parametrized
# over these families too)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_vocabulary_check_refuses_before_any_work_and_the_last_token_id_runs(family: str) -> None:
    gen = PagedGenerator(model(family), num_blocks=16, block_size=4)
    assert gen.vocab_size == VOCAB
    with pytest.raises(InvalidTokenError, match="outside the vocabulary"):
        gen.generate([[1, 2], [3, VOCAB]], max_new_tokens=2)
    assert gen.computed_tokens == 0 and gen.manager.num_sequences == 0 and gen.manager.stats.admissions == 0
    prompt = [VOCAB - 1, 0, VOCAB - 1]
    assert_matches_reference(family, gen, [prompt], gen.generate([prompt], max_new_tokens=3))


def test_gpt2_scales_as_its_eager_attention_with_an_inverse_layer_scale() -> None:
    """GPT-2 hands the attention function no scale: the module's rule applies (and it changes the tokens)."""
    prompts = shared_prefix_prompts()[:3]
    gen = PagedGenerator(model("gpt2-inverse-layer-scale"), num_blocks=32, block_size=4)
    outs = gen.generate(prompts, max_new_tokens=5)
    assert model("gpt2-inverse-layer-scale").config._attn_implementation == "eager"  # restored; the reference's
    assert_matches_reference("gpt2-inverse-layer-scale", gen, prompts, outs)
    plain = [reference("gpt2", tuple(p), 5)[0] for p in prompts]  # the same weights without that scale
    assert outs != plain


def test_multi_query_attention_keeps_one_kv_head_per_layer() -> None:
    gen = PagedGenerator(model("gpt_bigcode"), num_blocks=8, block_size=4)
    assert gen.layout.num_kv_heads == 1 and gen.layout.head_dim == 8
    assert gen.caches[0].spec.num_kv_heads == 1


# ---------------------------------------------------------------------------------------------- the step's context


def test_a_forward_that_raises_leaves_no_step_behind() -> None:
    """After an error mid-forward the attention outside a generator refuses again, and the generator recovers."""
    gpt2 = model("gpt2")
    prompts = shared_prefix_prompts()[:2]
    gen = PagedGenerator(gpt2, num_blocks=32, block_size=4)
    calls = [0]

    def fail_on_third_step(module: Any, args: Any) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("a layer failed")

    hook = attention_module(gpt2, 1).register_forward_pre_hook(fail_on_third_step)
    try:
        with pytest.raises(RuntimeError, match="a layer failed"):
            gen.generate(prompts, max_new_tokens=4)
    finally:
        hook.remove()
    previous = gpt2.config._attn_implementation
    assert previous != ATTENTION_NAME
    assert gen.manager.num_sequences == 0 and gen.manager.stats.blocks_in_use == 0
    gpt2.config._attn_implementation = ATTENTION_NAME
    try:  # a step left in the context would let this forward write into the generator's caches
        with pytest.raises(ConfigError, match="inside PagedGenerator"), torch.inference_mode():
            gpt2(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    finally:
        gpt2.config._attn_implementation = previous
    assert_matches_reference("gpt2", gen, prompts, gen.generate(prompts, max_new_tokens=4))


def test_two_generators_in_two_threads_each_see_their_own_step() -> None:
    """Both forward passes stand at layer 1 at once: each layer's call must read its own thread's step
    (GPT-2: 4 K/V heads, learned positions; Llama: 2 K/V heads, rotary)."""
    families = ("gpt2", "llama")
    prompts = shared_prefix_prompts()[:3]
    barrier = threading.Barrier(len(families), timeout=60)
    gens = [PagedGenerator(model(f), num_blocks=32, block_size=4) for f in families]
    results: dict[str, Any] = {}

    def meet_once() -> Callable[[Any, Any], None]:
        met = [False]

        def hook(module: Any, args: Any) -> None:
            if not met[0]:
                met[0] = True
                barrier.wait()  # the other thread's step is set now, its forward pass under way

        return hook

    def run(family: str, gen: PagedGenerator) -> None:
        try:
            results[family] = gen.generate(prompts, max_new_tokens=4)
        except BaseException as error:  # reported below, in the test's thread
            results[family] = error
            barrier.abort()

    hooks = [attention_module(model(f), 1).register_forward_pre_hook(meet_once()) for f in families]
    threads = [threading.Thread(target=run, args=(f, g)) for f, g in zip(families, gens)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
    finally:
        for hook in hooks:
            hook.remove()
    for family, gen in zip(families, gens):
        outs = results[family]
        assert not isinstance(outs, BaseException), outs
        assert_matches_reference(family, gen, prompts, outs)


# ---------------------------------------------------------------------------------------------- refused


def assert_refused_in_one_line(built: Any, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason) as raised:
        PagedGenerator(built, num_blocks=8, block_size=4)
    message = str(raised.value)
    assert message.startswith(type(built).__name__ + " ") and "\n" not in message


TINY = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, n_inner=64)
NO_INTERFACE: dict[str, Callable[[], Any]] = {
    "gptj": lambda: transformers.GPTJForCausalLM(transformers.GPTJConfig(**TINY, rotary_dim=4)),
    "gpt_neo": lambda: transformers.GPTNeoForCausalLM(
        transformers.GPTNeoConfig(
            vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global"], 2]]
        )
    ),
    "falcon": lambda: transformers.FalconForCausalLM(
        transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    ),
    "bloom": lambda: transformers.BloomForCausalLM(
        transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
    ),
}


@pytest.mark.parametrize("family", sorted(NO_INTERFACE))
def test_families_whose_attention_skips_the_interface_are_refused_at_construction(family: str) -> None:
    torch.manual_seed(0)
    built = NO_INTERFACE[family]().eval()
    assert_refused_in_one_line(built, "does not go through transformers' attention interface")
    assert built.config._attn_implementation != ATTENTION_NAME


def test_a_model_that_ignores_the_given_positions_is_refused() -> None:
    """Packed rows restart positions per sequence: a model deriving positions itself would attend wrongly."""
    built = fresh("llama")
    rotary = built.model.rotary_emb
    original = rotary.forward

    def from_the_row(x: torch.Tensor, position_ids: torch.Tensor) -> Any:
        return original(x, torch.arange(position_ids.shape[-1], device=x.device)[None])

    rotary.forward = from_the_row
    assert_refused_in_one_line(built, "does not follow the position_ids")


def test_a_model_with_a_biased_mask_is_refused() -> None:
    """OPT's own causal mask is ignored (positions decide), but not a mask that adds a bias to the scores."""
    built = fresh("opt")
    decoder = built.model.decoder
    causal = decoder._update_causal_mask

    def biased(*args: Any, **kwargs: Any) -> Any:
        mask = causal(*args, **kwargs)
        return None if mask is None else mask - 0.5 * torch.tril(torch.ones_like(mask), diagonal=-1)

    decoder._update_causal_mask = biased
    assert_refused_in_one_line(built, "mask that is not plain causal")


def test_a_bidirectional_model_is_refused() -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    assert_refused_in_one_line(transformers.BertLMHeadModel(config).eval(), "not causal")


def test_two_layers_reporting_one_layer_index_are_refused() -> None:
    """Each layer's K/V goes to the cache layer its ``layer_idx`` names: two alike would overwrite each other."""
    built = fresh("gpt2")
    attention_module(built, 1).layer_idx = 0
    assert_refused_in_one_line(built, r"layers \[0, 0\]")
