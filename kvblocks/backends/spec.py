"""KVCacheSpec: the shape of a model's KV cache, and the bytes it costs.

A spec is plain arithmetic and imports no torch. Each layer holds, per block:

* ``kind="kv"``: a K and a V tensor of ``block_size x num_kv_heads x head_dim`` elements;
* ``kind="mla"``: one latent per token (MLA: ``kv_lora_rank + qk_rope_head_dim`` wide,
  ``num_kv_heads == 1``), no V;
* with ``scale_dtype`` (fp8 KV), a scale per token per head for K (and V): ``block_size x
  num_kv_heads`` elements of ``scale_dtype``.

Worked example (checked in the tests): 2 layers, 8 KV heads, head_dim 128, block 16, bf16 ->
16 * 8 * 128 elements * 2 bytes * 2 (K and V) = 65,536 bytes per layer, 131,072 per block.

Layouts give the per-layer tensor shapes the attention kernel expects::

    NHD: [num_blocks, block_size, num_kv_heads, head_dim]
    HND: [num_blocks, num_kv_heads, block_size, head_dim]

``block_major`` chooses how those tensors sit in memory. True (the default): one block's
bytes for every layer are contiguous (``[num_blocks, bytes_per_block]``), so moving a block
is one memcpy-sized run; per-layer tensors are views strided on the block dimension. False:
every per-layer tensor is contiguous, for kernels that require it; moving a block then
touches one run per layer tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvblocks.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["DTYPE_SIZES", "KVCacheSpec", "Layout", "Kind", "Plane"]

Layout = Literal["NHD", "HND"]
Kind = Literal["kv", "mla"]

DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
"""Element sizes in bytes of the dtypes a KV cache may hold (names as in ``torch``)."""


def _dtype_name(value: object, what: str) -> str:
    name = str(value).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ConfigError(f"{what} {value!r} is not a KV cache dtype; known: {', '.join(DTYPE_SIZES)}")
    return name


def _positive(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{what} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class Plane:
    """One per-layer tensor's place in a block: which layer, which role, its bytes within the block."""

    layer: int
    role: Literal["k", "v", "k_scale", "v_scale"]
    offset: int  # bytes from the start of the block (block-major) / of the layer's stripe order
    nbytes: int  # bytes per block
    dtype: str
    shape: tuple[int, ...]  # per-block shape in the spec's layout (without the leading num_blocks)


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV cache of one model: layers, heads, head size, dtype, block size, layout and kind.

    >>> spec = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16)
    >>> spec.bytes_per_block, spec.bytes_per_layer_block
    (131072, 65536)
    >>> spec.num_blocks_for(1 << 30)
    8192
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    layout: Layout = "NHD"
    kind: Kind = "kv"
    scale_dtype: str | None = None
    block_major: bool = True

    def __post_init__(self) -> None:
        _positive(self.num_layers, "num_layers")
        _positive(self.num_kv_heads, "num_kv_heads")
        _positive(self.head_dim, "head_dim")
        _positive(self.block_size, "block_size")  # any: vLLM sizes hybrid models' attention blocks to fit their state
        object.__setattr__(self, "dtype", _dtype_name(self.dtype, "dtype"))
        if self.scale_dtype is not None:
            object.__setattr__(self, "scale_dtype", _dtype_name(self.scale_dtype, "scale_dtype"))
        if self.layout not in ("NHD", "HND"):
            raise ConfigError(f"layout must be 'NHD' or 'HND', got {self.layout!r}")
        if self.kind not in ("kv", "mla"):
            raise ConfigError(f"kind must be 'kv' or 'mla', got {self.kind!r}")
        if self.kind == "mla" and self.num_kv_heads != 1:
            raise ConfigError(
                f"an MLA cache holds one latent per token: num_kv_heads must be 1, got {self.num_kv_heads}"
            )
        if not isinstance(self.block_major, bool):
            raise ConfigError(f"block_major must be a bool, got {self.block_major!r}")

    @classmethod
    def mla(
        cls, *, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype: str, block_size: int, **kwargs: object
    ) -> KVCacheSpec:
        """An MLA cache: one latent of ``kv_lora_rank + qk_rope_head_dim`` elements per token, no V."""
        _positive(kv_lora_rank, "kv_lora_rank")
        _positive(qk_rope_head_dim, "qk_rope_head_dim")
        return cls(
            num_layers=num_layers,
            num_kv_heads=1,
            head_dim=kv_lora_rank + qk_rope_head_dim,
            dtype=dtype,
            block_size=block_size,
            kind="mla",
            **kwargs,  # type: ignore[arg-type]
        )

    # ---------------------------------------------------------------- arithmetic

    @property
    def element_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def has_values(self) -> bool:
        """False for MLA: the latent serves as both K and V."""
        return self.kind == "kv"

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Per-block shape of one K (or V, or latent) tensor in this layout."""
        if self.layout == "NHD":
            return (self.block_size, self.num_kv_heads, self.head_dim)
        return (self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def scale_block_shape(self) -> tuple[int, ...]:
        """Per-block shape of one scale tensor: a scale per token per head, in this layout's order."""
        if self.layout == "NHD":
            return (self.block_size, self.num_kv_heads)
        return (self.num_kv_heads, self.block_size)

    def planes(self) -> list[Plane]:
        """Every per-layer tensor of one block, in storage order: layer by layer, K, V, K scales, V scales."""
        roles: list[tuple[Literal["k", "v", "k_scale", "v_scale"], str, tuple[int, ...]]] = [
            ("k", self.dtype, self.block_shape)
        ]
        if self.has_values:
            roles.append(("v", self.dtype, self.block_shape))
        if self.scale_dtype is not None:
            roles.append(("k_scale", self.scale_dtype, self.scale_block_shape))
            if self.has_values:
                roles.append(("v_scale", self.scale_dtype, self.scale_block_shape))
        out = []
        offset = 0
        for layer in range(self.num_layers):
            for role, dtype, shape in roles:
                nbytes = DTYPE_SIZES[dtype]
                for dim in shape:
                    nbytes *= dim
                out.append(Plane(layer, role, offset, nbytes, dtype, shape))
                offset += nbytes
        return out

    @property
    def bytes_per_layer_block(self) -> int:
        """Bytes one block takes in one layer (K, V and their scales)."""
        return self.bytes_per_block // self.num_layers

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes over all layers."""
        return sum(p.nbytes for p in self.planes())

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    def num_blocks_for(self, memory_bytes: int, reserve: int | float = 0) -> int:
        """How many blocks fit in ``memory_bytes`` after holding back ``reserve``.

        ``reserve`` is bytes when an int, a fraction of ``memory_bytes`` when a float in [0, 1).

        >>> spec = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16)
        >>> spec.num_blocks_for(1 << 30, reserve=0.25), spec.num_blocks_for(1 << 30, reserve=1 << 29)
        (6144, 4096)
        """
        if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes < 0:
            raise ConfigError(f"memory_bytes must be an int >= 0, got {memory_bytes!r}")
        if isinstance(reserve, bool) or not isinstance(reserve, (int, float)):
            raise ConfigError(f"reserve must be bytes (int) or a fraction (float), got {reserve!r}")
        if isinstance(reserve, float):
            if not 0.0 <= reserve < 1.0:
                raise ConfigError(f"a fractional reserve must be in [0, 1), got {reserve}")
            held_back = int(memory_bytes * reserve)
        else:
            if reserve < 0:
                raise ConfigError(f"reserve must be >= 0 bytes, got {reserve}")
            held_back = reserve
        return max(0, memory_bytes - held_back) // self.bytes_per_block

    def torch_dtype(self, name: str | None = None) -> torch.dtype:
        """The torch dtype of ``name`` (default: the KV dtype). Imports torch."""
        from kvblocks.backends._torch import torch

        dtype = getattr(torch, name or self.dtype, None)
        if dtype is None:
            raise ConfigError(f"this torch build has no dtype {name or self.dtype!r}")
        return dtype  # type: ignore[no-any-return]
