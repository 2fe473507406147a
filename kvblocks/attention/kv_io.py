"""Writing a step's new K/V into their slots, and reading a sequence's context back (a plain torch reference).

A slot is ``block_id * block_size + offset``: what :attr:`StepMetadata.slot_mapping` holds and what vLLM's
``reshape_and_cache`` takes. :func:`write_kv` writes through the cache's 4-D per-layer views, indexed by
block and offset, so the write lands in the cache's memory in every arrangement -- block-major (the
default, where ``key(l)`` is strided on blocks and ``key(l).reshape(-1, H, D)`` would silently copy)
and layer-major, NHD and HND. :meth:`KVCache.flat_key` gives the flat ``(num_slots, H, D)`` view where
one exists (layer-major NHD) and raises :class:`~kvblocks.errors.ConfigError` where it would be a copy.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvblocks.backends._torch import torch
from kvblocks.backends.cache import KVCache
from kvblocks.errors import ConfigError, InvalidArgumentError, InvalidBlockIdError

__all__ = ["gather_kv", "write_kv"]


def write_kv(
    cache: KVCache, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None
) -> None:
    """Write ``key`` and ``value`` (``[num_tokens, num_kv_heads, head_dim]``) into slots ``slot_mapping``, in place.

    ``value`` is None for an MLA cache (the latent is the key). The tensors must be on the cache's device
    in its dtype (fp8 caches: already quantized; the scale planes are not written here). Slots are checked
    against the cache's size when ``slot_mapping`` is on the CPU; on an accelerator the check would cost a
    synchronisation, and an out-of-range slot fails in the indexing kernel instead.
    """
    spec = cache.spec
    _check_layer(cache, layer)
    slots = _check_slots(cache, slot_mapping)
    _check_tokens(cache, key, slots.shape[0], "key")
    if spec.has_values:
        if value is None:
            raise InvalidArgumentError("this cache holds V: value must be a tensor")
        _check_tokens(cache, value, slots.shape[0], "value")
    elif value is not None:
        raise ConfigError("an MLA cache has no V tensor: pass value=None (the latent is the key)")
    pairs = [(cache.key(layer), key)]
    if value is not None:
        pairs.append((cache.value(layer), value))
    if not spec.block_major and spec.layout == "NHD":  # one contiguous tensor per layer: a flat, aliasing view
        for target, source in pairs:
            target.view(-1, *target.shape[2:]).index_copy_(0, slots, source)
        return
    blocks = torch.div(slots, spec.block_size, rounding_mode="floor")
    offsets = slots - blocks * spec.block_size
    for target, source in pairs:  # advanced indexing on the 4-D view writes through to the cache's storage
        if spec.layout == "NHD":
            target[blocks, offsets] = source
        else:  # HND: [block, head, offset, dim]; the indexed dims come first: [token, head, dim]
            target[blocks, :, offsets] = source


def gather_kv(
    cache: KVCache,
    layer: int,
    block_ids: Sequence[int] | torch.Tensor,
    seq_len: int,
    *,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens ``[start, seq_len)`` of a sequence's K and V (None for MLA), each ``[seq_len - start, H, D]``.

    ``block_ids`` is the sequence's table (a row of :attr:`StepMetadata.block_tables`; trailing padding is
    ignored). A plain torch reference for tests and for engines without a paged kernel: it copies. A block
    the range needs must be a valid id -- a window group's released positions (-1) lie before ``start``.
    """
    _check_layer(cache, layer)
    size = cache.spec.block_size
    if (
        isinstance(seq_len, bool)
        or not isinstance(seq_len, int)
        or isinstance(start, bool)
        or not isinstance(start, int)
    ):
        raise InvalidArgumentError(f"seq_len and start must be ints, got {seq_len!r} and {start!r}")
    if not 0 <= start <= seq_len:
        raise InvalidArgumentError(f"need 0 <= start <= seq_len, got start {start}, seq_len {seq_len}")
    first, stop = start // size, -(-seq_len // size)
    ids = torch.as_tensor(block_ids, dtype=torch.int64).reshape(-1)
    if stop > ids.shape[0]:
        raise InvalidArgumentError(f"{seq_len} tokens need {stop} blocks; the table has {ids.shape[0]}")
    needed = ids[first:stop].to(cache.device)
    if needed.numel() and (int(needed.min()) < 0 or int(needed.max()) >= cache.num_blocks):
        raise InvalidBlockIdError(
            f"blocks {needed.tolist()} for tokens [{start}, {seq_len}): outside 0..{cache.num_blocks - 1}"
        )
    keep = slice(start - first * size, seq_len - first * size)
    key = _tokens(cache.key(layer), needed, cache.spec.layout)[keep]
    value = _tokens(cache.value(layer), needed, cache.spec.layout)[keep] if cache.spec.has_values else None
    return key, value


def _tokens(tensor: torch.Tensor, ids: torch.Tensor, layout: str) -> torch.Tensor:
    """Blocks ``ids`` of a per-layer tensor as ``[len(ids) * block_size, H, D]`` tokens (a copy)."""
    blocks = tensor.index_select(0, ids)
    if layout == "HND":
        blocks = blocks.transpose(1, 2)
    return blocks.reshape(-1, *blocks.shape[2:])


def _check_layer(cache: KVCache, layer: int) -> None:
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < cache.spec.num_layers:
        raise InvalidArgumentError(f"layer must be an int in 0..{cache.spec.num_layers - 1}, got {layer!r}")


def _check_slots(cache: KVCache, slot_mapping: torch.Tensor) -> torch.Tensor:
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
        raise InvalidArgumentError("slot_mapping must be a 1-D tensor of slots")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise InvalidArgumentError(f"slot_mapping must hold int64 or int32 slots, got {slot_mapping.dtype}")
    if slot_mapping.device != cache.device:
        raise InvalidArgumentError(f"slot_mapping is on {slot_mapping.device}, the cache on {cache.device}")
    slots = slot_mapping.to(torch.int64)
    limit = cache.num_blocks * cache.spec.block_size
    if slots.device.type == "cpu" and slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= limit):
        raise InvalidBlockIdError(f"slots must be in 0..{limit - 1} (num_blocks * block_size)")
    return slots


def _check_tokens(cache: KVCache, tensor: torch.Tensor, count: int, what: str) -> None:
    spec = cache.spec
    shape = (count, spec.num_kv_heads, spec.head_dim)
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape:
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise InvalidArgumentError(f"{what} must be a tensor of shape {shape} (one row per slot), got {got}")
    if tensor.dtype != spec.torch_dtype():
        raise InvalidArgumentError(f"{what} is {tensor.dtype}; the cache holds {spec.dtype}")
    if tensor.device != cache.device:
        raise InvalidArgumentError(f"{what} is on {tensor.device}, the cache on {cache.device}")
