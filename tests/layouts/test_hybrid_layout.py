"""Hybrid layouts (issue 14, item 1): group kinds, bytes per block / state, the memory split, presets, `plan`.

Every expected byte figure below is worked out by hand in the test (layers x K,V x tokens x heads x
head_dim x element size, or the state's tensor shapes), never taken from the code under test.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks.backends.spec import KVCacheSpec
from kvblocks.cli import main
from kvblocks.errors import ConfigError
from kvblocks.hybrid import (
    HYBRID_PRESETS,
    CacheGroup,
    HybridLayout,
    RecurrentState,
    StateTensor,
    held_blocks,
    hybrid_preset,
)


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    status = main(list(argv), out=out)  # type: ignore[arg-type]
    return status, out.getvalue()


# ---------------------------------------------------------------- bytes per block / state, by hand


def test_full_attention_group_bytes_per_block_and_held_bytes() -> None:
    group = CacheGroup.attention("full", [0, 1, 2], num_kv_heads=4, head_dim=64, dtype="float16", block_size=8)
    assert group.bytes_per_block == 3 * 2 * 8 * 4 * 64 * 2 == 24_576
    assert group.bytes_per_state is None and group.unit == "block" and group.prefix_cacheable
    assert group.units_per_sequence(100) == 13  # ceil(100 / 8)
    assert group.held_bytes(100) == 13 * 24_576


def test_sliding_window_group_holds_at_most_ceil_w_over_b_plus_one_blocks() -> None:
    group = CacheGroup.attention("sliding_window", range(5), num_kv_heads=2, head_dim=128, window=1024)
    assert group.bytes_per_block == 5 * 2 * 16 * 2 * 128 * 2 == 81_920  # bf16, block 16 by default
    assert group.units_per_sequence(32_768) == 1024 // 16 + 1 == 65
    assert group.held_bytes(32_768) == 65 * 81_920 == 5_324_800
    assert group.units_per_sequence(500) == 32  # shorter than the window: ceil(500 / 16), as full attention
    odd = CacheGroup.attention("sliding_window", [0], num_kv_heads=1, head_dim=8, window=100)
    assert odd.units_per_sequence(10_000) == 7 + 1  # ceil(100 / 16) + 1


def test_chunked_local_group_holds_the_current_chunk() -> None:
    group = CacheGroup.attention("chunked_local", [0, 1], num_kv_heads=8, head_dim=128, chunk=8192)
    assert group.bytes_per_block == 2 * 2 * 16 * 8 * 128 * 2 == 131_072
    assert group.units_per_sequence(32_768) == 8192 // 16 == 512  # chunks start on block boundaries
    assert group.units_per_sequence(1000) == 63  # ceil(1000 / 16)
    unaligned = CacheGroup.attention("chunked_local", [0], num_kv_heads=1, head_dim=8, chunk=100)
    assert unaligned.units_per_sequence(10_000) == 7 + 1 and unaligned.units_per_sequence(50) == 4


def test_cross_attention_holds_the_encoder_tokens_and_is_never_prefix_cached() -> None:
    group = CacheGroup.attention("cross_attention", [3], num_kv_heads=8, head_dim=64, encoder_tokens=1601)
    assert group.bytes_per_block == 1 * 2 * 16 * 8 * 64 * 2 == 32_768
    assert group.units_per_sequence(10) == group.units_per_sequence(100_000) == 101  # ceil(1601 / 16)
    assert not group.prefix_cacheable


def test_mla_group_matches_the_spec_figure() -> None:
    spec = KVCacheSpec.mla(num_layers=4, kv_lora_rank=512, qk_rope_head_dim=64, dtype="bfloat16", block_size=64)
    group = CacheGroup("full", (0, 1, 2, 3), spec=spec)
    assert group.bytes_per_block == 4 * 1 * 64 * (512 + 64) * 2 == 294_912  # one latent, no V


def test_recurrent_state_bytes() -> None:
    mamba1 = RecurrentState.mamba1(d_inner=8192, d_state=16, d_conv=4)
    assert mamba1.bytes_per_layer == 3 * 8192 * 2 + 8192 * 16 * 2 == 311_296
    mamba2 = RecurrentState.mamba2(num_heads=128, head_dim=64, d_state=128, n_groups=8, d_conv=4, ssm_dtype="float32")
    conv_dim = 128 * 64 + 2 * 8 * 128  # x, B, C go through the conv
    assert mamba2.bytes_per_layer == 3 * conv_dim * 2 + 128 * 64 * 128 * 4 == 4_255_744
    gdn = RecurrentState.gated_delta_net(
        num_key_heads=16, num_value_heads=32, key_head_dim=128, value_head_dim=128, conv_kernel=4
    )
    assert gdn.bytes_per_layer == 3 * (2 * 16 * 128 + 32 * 128) * 2 + 32 * 128 * 128 * 2 == 1_097_728
    group = CacheGroup.recurrent([1, 2, 3], mamba1)
    assert group.bytes_per_state == 3 * 311_296 and group.bytes_per_block is None and group.block_size is None
    assert group.units_per_sequence(1) == group.units_per_sequence(1_000_000) == 1  # fixed size per sequence
    assert group.unit == "state"


def test_a_layout_s_held_bytes_and_the_gemma_like_ratio_against_all_full() -> None:
    layout = hybrid_preset("gemma-3-27b")
    per_layer_block = 2 * 16 * 16 * 128 * 2  # K,V x tokens x heads x dim x bf16
    hybrid = (52 * 65 + 10 * 2048) * per_layer_block
    all_full = 62 * 2048 * per_layer_block
    assert layout.held_bytes(32_768) == hybrid and layout.all_full().held_bytes(32_768) == all_full
    ratio = hybrid / all_full
    assert ratio == pytest.approx(1 / 6 + 5 / 6 * 1024 / 32_768, abs=0.01)  # the estimate
    assert [g.kind for g in layout.all_full().groups] == ["full", "full"]


# ---------------------------------------------------------------- the memory split


def small_layout() -> HybridLayout:
    return HybridLayout(
        (
            CacheGroup.attention("full", [1], num_kv_heads=2, head_dim=4),  # 512 bytes per block
            CacheGroup.attention("sliding_window", [0, 2], num_kv_heads=2, head_dim=4, window=32),  # 1,024
        )
    )


def test_split_by_hand() -> None:
    plan = small_layout().split(100_000, 1024)
    # per sequence: 64 full blocks x 512 + 3 sliding blocks x 1,024 = 35,840 bytes -> 2 sequences
    assert plan.bytes_per_sequence == 35_840 and plan.sequences == 2
    # full: 100,000 x 64 // 35,840 = 178; sliding: 100,000 x 3 // 35,840 = 8
    assert [g.units for g in plan.groups] == [178, 8]
    assert [g.units_per_sequence for g in plan.groups] == [64, 3]
    assert plan.used_bytes == 178 * 512 + 8 * 1024 == 99_328
    assert plan.share(0) == pytest.approx(91_136 / 100_000)


def test_one_full_group_uses_the_whole_budget_like_the_spec() -> None:
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16)
    layout = HybridLayout((CacheGroup("full", range(32), spec=spec),))
    for context in (1, 17, 32_768):
        assert layout.split(40 << 30, context).groups[0].units == spec.num_blocks_for(40 << 30) == 20_480


_KINDS = ("full", "sliding_window", "chunked_local", "cross_attention", "recurrent")


@st.composite
def layouts(draw: st.DrawFn) -> HybridLayout:
    groups = []
    next_layer = 0
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(_KINDS))
        layers = range(next_layer, next_layer + draw(st.integers(1, 8)))
        next_layer = layers.stop
        if kind == "recurrent":
            state = RecurrentState.mamba1(
                d_inner=draw(st.integers(1, 4096)), d_state=draw(st.integers(1, 64)), d_conv=draw(st.integers(2, 5))
            )
            groups.append(CacheGroup.recurrent(layers, state))
            continue
        span = draw(st.integers(1, 20_000))
        spans = {"sliding_window": "window", "chunked_local": "chunk", "cross_attention": "encoder_tokens"}
        groups.append(
            CacheGroup.attention(
                kind,  # type: ignore[arg-type]
                layers,
                num_kv_heads=draw(st.integers(1, 16)),
                head_dim=draw(st.sampled_from([8, 64, 128, 256])),
                dtype=draw(st.sampled_from(["bfloat16", "float8_e4m3fn", "float32"])),
                block_size=draw(st.sampled_from([1, 16, 64, 256])),
                **({spans[kind]: span} if kind in spans else {}),  # type: ignore[arg-type]
            )
        )
    return HybridLayout(tuple(groups))


@settings(max_examples=1500, deadline=None)
@given(layouts(), st.integers(1, 1 << 42), st.integers(1, 1 << 21))
def test_split_invariants(layout: HybridLayout, memory: int, context: int) -> None:
    plan = layout.split(memory, context)
    per_sequence = sum(g.held_bytes(context) for g in layout.groups)
    assert plan.bytes_per_sequence == per_sequence
    assert plan.sequences == memory // per_sequence
    assert all(g.units >= 0 for g in plan.groups)
    assert plan.used_bytes == sum(g.units * g.group.unit_bytes for g in plan.groups) <= memory
    for g in plan.groups:  # equal capacity: every group holds exactly the same number of running sequences
        assert g.units_per_sequence >= 1
        assert g.units // g.units_per_sequence == plan.sequences
    # and what is left over is less than one unit (block or state) per group
    assert memory - plan.used_bytes < sum(g.group.unit_bytes for g in plan.groups)


# ---------------------------------------------------------------- presets


EXPECTED_PRESETS = {
    # name: ((kind, layer count), ...), layers in all
    "gemma-3-27b": ((("sliding_window", 52), ("full", 10)), 62),
    "gpt-oss-20b": ((("sliding_window", 12), ("full", 12)), 24),
    "llama-4-scout": ((("chunked_local", 36), ("full", 12)), 48),
    "qwen3-next-80b-a3b": ((("recurrent", 36), ("full", 12)), 48),
    "jamba-v0.1": ((("recurrent", 28), ("full", 4)), 32),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_presets_layer_counts_add_up(name: str) -> None:
    layout = hybrid_preset(name)
    kinds, total = EXPECTED_PRESETS[name]
    assert [(g.kind, g.num_layers) for g in layout.groups] == list(kinds)
    indices = sorted(i for g in layout.groups for i in g.layers)
    assert indices == list(range(total)) and layout.num_layers == total


def test_presets_follow_the_published_layer_patterns_and_shapes() -> None:
    gemma = hybrid_preset("gemma-3-27b")
    assert gemma.groups[1].layers == tuple(range(5, 62, 6)) and gemma.groups[0].window == 1024
    assert gemma.groups[0].bytes_per_block == 52 * 2 * 16 * 16 * 128 * 2 == 6_815_744
    oss = hybrid_preset("gpt-oss-20b")
    assert oss.groups[1].layers == tuple(range(1, 24, 2)) and oss.groups[0].window == 128
    assert oss.groups[1].bytes_per_block == 12 * 2 * 16 * 8 * 64 * 2
    scout = hybrid_preset("llama-4-scout")
    assert scout.groups[1].layers == tuple(range(3, 48, 4)) and scout.groups[0].chunk == 8192
    assert scout.groups[0].bytes_per_block == 36 * 2 * 16 * 8 * 128 * 2
    qwen = hybrid_preset("qwen3-next-80b-a3b")
    assert qwen.groups[1].layers == tuple(range(3, 48, 4))
    assert qwen.groups[1].bytes_per_block == 12 * 2 * 16 * 2 * 256 * 2
    assert qwen.groups[0].bytes_per_state == 36 * (3 * 8192 * 2 + 32 * 128 * 128 * 2) == 39_518_208
    jamba = hybrid_preset("jamba-v0.1")
    assert jamba.groups[1].layers == (4, 12, 20, 28)
    assert jamba.groups[0].bytes_per_state == 28 * (3 * 8192 * 2 + 8192 * 16 * 2) == 8_716_288
    fp8 = hybrid_preset("gemma-3-27b", dtype="float8_e4m3fn", block_size=32)
    assert fp8.groups[1].bytes_per_block == 10 * 2 * 32 * 16 * 128 * 1
    assert set(HYBRID_PRESETS) == set(EXPECTED_PRESETS)


# ---------------------------------------------------------------- bad configs


def test_bad_configs_raise_config_error() -> None:
    spec2 = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, dtype="bfloat16", block_size=16)
    state = RecurrentState.mamba1(d_inner=8, d_state=4, d_conv=4)
    bad = [
        lambda: CacheGroup("bogus", (0, 1), spec=spec2),  # type: ignore[arg-type]
        lambda: CacheGroup("full", (), spec=spec2),
        lambda: CacheGroup("full", (0, 0), spec=spec2),
        lambda: CacheGroup("full", (0, -1), spec=spec2),
        lambda: CacheGroup("full", (0, True), spec=spec2),  # type: ignore[arg-type]
        lambda: CacheGroup("full", "01", spec=spec2),  # type: ignore[arg-type]
        lambda: CacheGroup("full", (0, 1, 2), spec=spec2),  # spec covers 2 layers
        lambda: CacheGroup("full", (0, 1)),
        lambda: CacheGroup("full", (0, 1), spec=spec2, window=4),
        lambda: CacheGroup("sliding_window", (0, 1), spec=spec2),
        lambda: CacheGroup("sliding_window", (0, 1), spec=spec2, window=0),
        lambda: CacheGroup("sliding_window", (0, 1), spec=spec2, chunk=4, window=4),
        lambda: CacheGroup("chunked_local", (0, 1), spec=spec2, window=4),
        lambda: CacheGroup("cross_attention", (0, 1), spec=spec2),
        lambda: CacheGroup("recurrent", (0,)),
        lambda: CacheGroup("recurrent", (0, 1), spec=spec2, state=state),
        lambda: CacheGroup("full", (0, 1), spec=spec2, state=state),
        lambda: CacheGroup.attention("full", [0], num_kv_heads=0, head_dim=8),
        lambda: CacheGroup.attention("full", [0], num_kv_heads=1, head_dim=8, block_size=0),
        lambda: HybridLayout(()),
        lambda: HybridLayout((CacheGroup("full", (0, 1), spec=spec2), CacheGroup.recurrent([1, 2], state))),
        lambda: HybridLayout(("full",)),  # type: ignore[arg-type]
        lambda: RecurrentState(()),
        lambda: RecurrentState((StateTensor("a", (1,), "bfloat16"), StateTensor("a", (2,), "bfloat16"))),
        lambda: StateTensor("x", (4, 0), "bfloat16"),
        lambda: StateTensor("x", (), "bfloat16"),
        lambda: StateTensor("x", (4,), "float64"),
        lambda: StateTensor("", (4,), "bfloat16"),
        lambda: RecurrentState.mamba1(d_inner=8, d_state=4, d_conv=1),
        lambda: RecurrentState.mamba2(num_heads=2, head_dim=4, d_state=4, n_groups=0, d_conv=4),
        lambda: RecurrentState.gated_delta_net(
            num_key_heads=1, num_value_heads=1, key_head_dim=0, value_head_dim=1, conv_kernel=4
        ),
        lambda: held_blocks("recurrent", 10, 16),
        lambda: held_blocks("sliding_window", 10, 16),
        lambda: held_blocks("full", -1, 16),
        lambda: small_layout().split(0, 10),
        lambda: small_layout().split(True, 10),  # type: ignore[arg-type]
        lambda: small_layout().split(1 << 20, 0),
        lambda: small_layout().groups[0].units_per_sequence(-5),
        lambda: hybrid_preset("gemma-4"),
        lambda: hybrid_preset("gemma-3-27b", dtype="float64"),
    ]
    for index, make in enumerate(bad):
        with pytest.raises(ConfigError):
            make()
            pytest.fail(f"case {index} did not raise")


def test_importing_kvblocks_hybrid_imports_no_torch() -> None:
    code = "import sys, kvblocks.hybrid; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# ---------------------------------------------------------------- kvblocks plan


def test_plan_prints_memory_per_group_for_a_hybrid_preset() -> None:
    status, text = run("plan", "--model", "gemma-3-27b", "--memory", "40G")
    assert status == 0
    memory = 40 * 2**30
    per_sequence = (52 * 65 + 10 * 2048) * 2 * 16 * 16 * 128 * 2  # sliding + full blocks x bytes per layer-block
    sequences = memory // per_sequence
    sliding_blocks = memory * 65 // per_sequence
    full_blocks = memory * 2048 // per_sequence
    assert sequences == 13 and (sliding_blocks, full_blocks) == (892, 28_126)
    lines = text.splitlines()
    assert "context          32,768 tokens per running sequence" in lines
    assert f"sequences        {sequences} running at that context, in every group" in lines
    (sliding,) = [line for line in lines if line.startswith("0 ")]
    (full,) = [line for line in lines if line.startswith("1 ")]
    assert sliding.split() == [
        "0", "sliding_window", "(window", "1,024)", "52", "6,815,744", "per", "block", "65", "blocks",
        "892", "blocks", f"{892 * 6_815_744:,}", "bytes", f"{100 * 892 * 6_815_744 / memory:.1f}%",
    ]  # fmt: skip
    assert full.split()[:4] == ["1", "full", "10", "1,310,720"] and "28,126 blocks" in full


def test_plan_json_for_a_recurrent_preset() -> None:
    status, text = run("plan", "--model", "qwen3-next-80b-a3b", "--memory", "10GB", "--context", "4096", "--json")
    plan = json.loads(text)
    state = 36 * 1_097_728
    block = 12 * 2 * 16 * 2 * 256 * 2
    per_sequence = state + 256 * block  # 4,096 / 16 blocks of full attention + one state
    assert status == 0 and plan["context_tokens"] == 4096 and plan["memory_bytes"] == 10**10
    assert plan["bytes_per_sequence"] == per_sequence and plan["sequences"] == 10**10 // per_sequence
    recurrent, full = plan["groups"]
    assert recurrent["kind"] == "recurrent" and recurrent["num_layers"] == 36
    assert recurrent["bytes_per_state"] == state and recurrent["states"] == plan["sequences"]
    assert recurrent["state_tensors"] == [
        {"name": "conv", "shape": [3, 8192], "dtype": "bfloat16"},
        {"name": "ssm", "shape": [32, 128, 128], "dtype": "bfloat16"},
    ]
    assert full["kind"] == "full" and full["bytes_per_block"] == block and full["blocks_per_sequence"] == 256
    assert full["blocks"] == 10**10 * 256 // per_sequence and full["layers"] == list(range(3, 48, 4))
    assert plan["used_bytes"] == recurrent["states"] * state + full["blocks"] * block <= 10**10
    assert full["share"] == pytest.approx(full["blocks"] * block / 10**10)


def test_plan_context_changes_the_split() -> None:
    _, text = run("plan", "--model", "gemma-3-27b", "--memory", "40G", "--context", "1024", "--json")
    sliding, full = json.loads(text)["groups"]
    # at 1,024 tokens a sliding layer holds as much as a full one: 64 blocks each
    assert sliding["blocks_per_sequence"] == full["blocks_per_sequence"] == 64
    assert sliding["blocks"] == full["blocks"] == 40 * 2**30 // ((52 + 10) * 2 * 16 * 16 * 128 * 2)


def test_plan_errors_for_hybrid_presets(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, fragment in [
        (["--model", "llama-3-8b", "--context", "100"], "--context sizes the per-group split"),
        (["--model", "gemma-3-27b", "--layers", "4"], "drop --layers"),
        (["--model", "gemma-3-27b", "--context", "0"], "argument --context: must be >= 1"),
        (["--model", "gemma-3-27b", "--context", str(1 << 28)], "argument --context: must be <="),
        (["--model", "gemma-3-27b", "--block-size", "0"], "argument --block-size: must be >= 1"),
    ]:
        assert main(["plan", *argv, "--memory", "1G"]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1 and fragment in captured.err, captured.err
