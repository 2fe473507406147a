"""KV tensors in vLLM's CPU layout, their block payloads and a storage tier for them (shared by the vLLM
connector's transfer and worker tests)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvblocks.hashing import Namespace  # noqa: E402
from kvblocks.integrations.vllm.block_copy import LayerBlocks  # noqa: E402
from kvblocks.integrations.vllm.kv_format import VllmKVFormat  # noqa: E402
from kvblocks.tiers.config import TierConfig  # noqa: E402
from kvblocks.tiers.storage_tier import StorageTier  # noqa: E402

LAYERS, NUM_BLOCKS, SHAPE = 3, 8, (2, 32, 8)  # [kv_heads, block_size, 2 * head_dim], vLLM's CPU layout
FMT = VllmKVFormat("test/llama", "bfloat16", LAYERS, SHAPE, 32)


def kv(seed: int) -> dict[str, torch.Tensor]:
    buffer = torch.randn((LAYERS, NUM_BLOCKS, *SHAPE), generator=torch.Generator().manual_seed(seed))
    buffer = buffer.to(torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": buffer[i] for i in range(LAYERS)}


def payload_of(tensors: dict[str, torch.Tensor], block: int) -> bytes:
    return b"".join(
        tensors[f"model.layers.{i}.self_attn.attn"][block].view(torch.uint8).numpy().tobytes() for i in range(LAYERS)
    )


def tier_on(storage: object) -> StorageTier:
    config = TierConfig(storage=storage, entry_format=FMT.entry_format)  # type: ignore[arg-type]
    return StorageTier(config, Namespace(FMT.model), FMT.scheme, FMT.block_size)


HASHES = [bytes([i + 1]) * 32 for i in range(4)]


def staged(blocks: LayerBlocks) -> LayerBlocks:
    """The same tensors moved the accelerator's way (torch gather/scatter through a host copy)."""
    blocks._host = None
    blocks._flat = None
    return blocks
