"""KVCache: one allocation of raw bytes, seen as the per-layer tensors an attention kernel wants.

Block-major (the default) -- block ``b``'s bytes for every layer form one row::

    storage  [num_blocks, bytes_per_block] uint8
    row b    | L0.K | L0.V | L1.K | L1.V | ... |      (then scales, layer by layer, if any)
    key(l)   = storage[:, off:off+n].view(dtype).view(num_blocks, *block_shape)   strided on blocks

Layer-major -- each per-layer tensor is its own contiguous region of the same allocation::

    storage  | L0.K: [num_blocks, n] | L0.V: [num_blocks, n] | L1.K ... |
    key(l)   = region.view(dtype).view(num_blocks, *block_shape)                  contiguous

Either way a block's *payload* (what ``gather`` returns and ``scatter`` takes) is the same
byte string: the planes of :meth:`KVCacheSpec.planes` in order. Caches of one spec but
different arrangements exchange blocks freely.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from kvblocks.backends._torch import torch
from kvblocks.backends.spec import DTYPE_SIZES, KVCacheSpec, Plane
from kvblocks.errors import ConfigError

__all__ = ["KVCache", "LayerKV", "build_cache"]

# Movement copies whole words; wider words mean fewer elements for the index kernels, which are
# bound by per-element work (16-byte words move scattered 64 KiB blocks ~30% faster than 8-byte).
# complex128 is just a 16-byte container here: index_select / index_copy_ copy its bits unchanged.
_WORD_TYPES = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


class LayerKV(NamedTuple):
    """One layer's tensors. ``value`` is None for MLA; the scales are None without ``scale_dtype``."""

    key: torch.Tensor
    value: torch.Tensor | None
    key_scale: torch.Tensor | None
    value_scale: torch.Tensor | None


@dataclass(eq=False)
class KVCache:
    """The KV tensors of ``num_blocks`` blocks on one device, views over a single allocation.

    ``rows`` are the byte rows that movement works on: one ``[num_blocks, bytes_per_block]``
    tensor (block-major) or one ``[num_blocks, plane bytes]`` tensor per plane (layer-major),
    each viewed with the widest integer type its width allows, so that copies move words, not
    bytes. ``row_offsets[i]`` is where row tensor ``i`` sits in a block's payload.
    """

    spec: KVCacheSpec
    num_blocks: int
    storage: torch.Tensor
    layers: tuple[LayerKV, ...]
    rows: tuple[torch.Tensor, ...]
    row_offsets: tuple[int, ...]
    pinned: bool

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def nbytes(self) -> int:
        return self.storage.numel()

    def key(self, layer: int) -> torch.Tensor:
        return self.layers[layer].key

    def value(self, layer: int) -> torch.Tensor:
        value = self.layers[layer].value
        if value is None:
            raise ConfigError("an MLA cache has no V tensor: the latent (key) serves both")
        return value

    def flat_key(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K as ``(num_blocks * block_size, num_kv_heads, head_dim)``: slot ``b * block_size + o``
        is token ``o`` of block ``b``. A view that aliases the cache, or a :class:`ConfigError`.

        Only a layer-major NHD cache has one: on a block-major cache (the default) ``key(l)`` is strided on
        blocks, so ``key(l).reshape(-1, H, D)`` silently *copies* and a write into it is lost. Write slots
        there with :func:`kvblocks.attention.write_kv`, which indexes the 4-D view in place.
        """
        return self._flat(self.key(layer), layer, "key")

    def flat_value(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s V as a flat slot view (see :meth:`flat_key`); MLA has no V (:class:`ConfigError`)."""
        return self._flat(self.value(layer), layer, "value")

    def _flat(self, tensor: torch.Tensor, layer: int, what: str) -> torch.Tensor:
        spec = self.spec
        if spec.block_major:
            raise ConfigError(
                f"layer {layer}'s {what} of a block-major cache is strided on blocks: a flat slot view would be a "
                "copy, and writes into it would be lost. Use kvblocks.attention.write_kv, or allocate the cache "
                "with KVCacheSpec(block_major=False)"
            )
        if spec.layout != "NHD":
            raise ConfigError(
                f"an {spec.layout} cache keeps a block's tokens apart per head: no flat slot view of layer "
                f"{layer}'s {what}; use kvblocks.attention.write_kv or an NHD cache"
            )
        return tensor.view(self.num_blocks * spec.block_size, *tensor.shape[2:])  # view(): never a copy

    def __repr__(self) -> str:
        arrangement = "block-major" if self.spec.block_major else "layer-major"
        return (
            f"KVCache({self.num_blocks} blocks x {self.spec.bytes_per_block} bytes, {arrangement}, "
            f"{self.spec.dtype} {self.spec.layout}, device={self.device}, pinned={self.pinned})"
        )


def _word_view(rows: torch.Tensor, alignment: int) -> torch.Tensor:
    """``rows`` (uint8) viewed with the widest integer word that divides ``alignment``.

    ``alignment`` must divide the row width, the row's place in a payload and the payload
    width, so that the same word view also applies to the matching payload columns.
    """
    for size, dtype in _WORD_TYPES:
        if alignment % size == 0:
            return rows.view(dtype)
    return rows  # pragma: no cover - uint8 always qualifies


def _typed_view(rows: torch.Tensor, plane: Plane, num_blocks: int) -> torch.Tensor:
    """The ``[num_blocks, *plane.shape]`` tensor of ``plane`` inside byte rows ``[num_blocks, plane.nbytes]``."""
    dtype = getattr(torch, plane.dtype)
    return rows.view(dtype).view(num_blocks, *plane.shape)


def _check_alignment(spec: KVCacheSpec, planes: list[Plane]) -> None:
    widest = max(DTYPE_SIZES[p.dtype] for p in planes)
    for plane in planes:
        size = DTYPE_SIZES[plane.dtype]
        if plane.offset % size or (spec.block_major and spec.bytes_per_block % size):
            raise ConfigError(
                f"layer {plane.layer} {plane.role} ({plane.dtype}) would start at byte {plane.offset} of a "
                f"{spec.bytes_per_block}-byte block: not aligned to {size} bytes; a larger block_size or "
                f"head_dim makes the planes line up (elements up to {widest} bytes)"
            )


def build_cache(spec: KVCacheSpec, num_blocks: int, storage: torch.Tensor, *, pinned: bool) -> KVCache:
    """Wrap ``storage`` (uint8, ``num_blocks * bytes_per_block`` elements) as a :class:`KVCache` of ``spec``."""
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
        raise ConfigError(f"num_blocks must be a positive int, got {num_blocks!r}")
    planes = spec.planes()
    _check_alignment(spec, planes)
    bpb = spec.bytes_per_block
    if storage.dtype != torch.uint8 or storage.numel() != num_blocks * bpb or not storage.is_contiguous():
        raise ConfigError(f"storage must be a contiguous uint8 tensor of {num_blocks * bpb} bytes")
    flat = storage.view(-1)
    views: dict[tuple[int, str], torch.Tensor] = {}
    if spec.block_major:
        block_rows = flat.view(num_blocks, bpb)
        for plane in planes:
            views[(plane.layer, plane.role)] = _typed_view(
                block_rows[:, plane.offset : plane.offset + plane.nbytes], plane, num_blocks
            )
        rows: tuple[torch.Tensor, ...] = (_word_view(block_rows, bpb),)
        offsets: tuple[int, ...] = (0,)
    else:
        row_list = []
        for plane in planes:
            region = flat[plane.offset * num_blocks : (plane.offset + plane.nbytes) * num_blocks]
            plane_rows = region.view(num_blocks, plane.nbytes)
            views[(plane.layer, plane.role)] = _typed_view(plane_rows, plane, num_blocks)
            row_list.append(_word_view(plane_rows, math.gcd(plane.nbytes, plane.offset, bpb)))
        rows = tuple(row_list)
        offsets = tuple(plane.offset for plane in planes)
    layers = tuple(
        LayerKV(
            views[(layer, "k")],
            views.get((layer, "v")),
            views.get((layer, "k_scale")),
            views.get((layer, "v_scale")),
        )
        for layer in range(spec.num_layers)
    )
    return KVCache(spec, num_blocks, storage, layers, rows, offsets, pinned)


def payload_words(cache: KVCache, data: torch.Tensor, row: int) -> torch.Tensor:
    """The columns of a ``[k, bytes_per_block]`` uint8 payload that row tensor ``row`` covers, as words."""
    rows = cache.rows[row]
    start = cache.row_offsets[row]
    width = rows.shape[1] * rows.element_size()
    return data[:, start : start + width].view(rows.dtype)
