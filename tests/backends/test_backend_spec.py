"""KVCacheSpec: the byte arithmetic against worked examples, layouts, and refusals."""

from __future__ import annotations

import pytest

from kvblocks.backends import KVCacheSpec
from kvblocks.errors import ConfigError


def llama_like(**overrides) -> KVCacheSpec:
    fields = {"num_layers": 2, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16", "block_size": 16}
    fields.update(overrides)
    return KVCacheSpec(**fields)


def test_worked_example_bf16() -> None:
    spec = llama_like()
    assert spec.bytes_per_block == 131_072  # 16 tokens * 8 heads * 128 * 2 bytes * (K + V) * 2 layers
    assert spec.bytes_per_layer_block == 65_536
    assert spec.bytes_per_token == 8192
    assert spec.has_values


def test_worked_example_mla() -> None:
    spec = KVCacheSpec.mla(num_layers=1, kv_lora_rank=512, qk_rope_head_dim=64, dtype="bfloat16", block_size=16)
    assert spec.bytes_per_block == 18_432  # 16 tokens * (512 + 64) * 2 bytes, no V
    assert not spec.has_values
    assert [p.role for p in spec.planes()] == ["k"]


def test_worked_example_fp8_with_scales() -> None:
    spec = llama_like(dtype="float8_e4m3fn", scale_dtype="float32")
    per_layer = 2 * (16 * 8 * 128 * 1) + 2 * (16 * 8 * 4)  # K and V in fp8, one float32 scale per token per head each
    assert spec.bytes_per_layer_block == per_layer == 33_792
    assert spec.bytes_per_block == 2 * per_layer
    assert [p.role for p in spec.planes()[:4]] == ["k", "v", "k_scale", "v_scale"]


def test_planes_tile_the_block_in_order() -> None:
    spec = llama_like(scale_dtype="float32")
    offset = 0
    for plane in spec.planes():
        assert plane.offset == offset
        offset += plane.nbytes
    assert offset == spec.bytes_per_block


def test_layouts_give_the_kernel_shapes() -> None:
    assert llama_like().block_shape == (16, 8, 128)  # NHD
    assert llama_like(layout="HND").block_shape == (8, 16, 128)
    assert llama_like(layout="HND", scale_dtype="float32").scale_block_shape == (8, 16)


def test_num_blocks_for_memory_with_reserves() -> None:
    spec = llama_like()
    assert spec.num_blocks_for(1 << 30) == 8192
    assert spec.num_blocks_for(1 << 30, reserve=0.25) == 6144
    assert spec.num_blocks_for(1 << 30, reserve=1 << 29) == 4096
    assert spec.num_blocks_for(100, reserve=1000) == 0
    assert spec.num_blocks_for(131_071) == 0


@pytest.mark.parametrize(
    "kwargs, reserve",
    [
        ({"memory_bytes": -1}, 0),
        ({"memory_bytes": 1.5}, 0),
        ({"memory_bytes": 10}, 1.0),
        ({"memory_bytes": 10}, -1),
        ({"memory_bytes": 10}, -0.5),
        ({"memory_bytes": 10}, True),
        ({"memory_bytes": 10}, "1"),
    ],
)
def test_num_blocks_for_refuses_nonsense(kwargs, reserve) -> None:
    with pytest.raises(ConfigError):
        llama_like().num_blocks_for(kwargs["memory_bytes"], reserve=reserve)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_kv_heads": -1}, "num_kv_heads"),
        ({"head_dim": 0}, "head_dim"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": 16.0}, "block_size"),
        ({"dtype": "float64"}, "not a KV cache dtype"),
        ({"dtype": "bf16"}, "not a KV cache dtype"),
        ({"scale_dtype": "float99"}, "scale_dtype"),
        ({"layout": "NDH"}, "layout"),
        ({"kind": "latent"}, "kind"),
        ({"kind": "mla"}, "num_kv_heads must be 1"),
        ({"block_major": 1}, "block_major"),
    ],
)
def test_invalid_specs_say_what_is_wrong(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        llama_like(**overrides)


def test_torch_dtype_names_are_accepted() -> None:
    import torch

    assert llama_like(dtype=torch.bfloat16).dtype == "bfloat16"
    assert llama_like().torch_dtype() is torch.bfloat16
