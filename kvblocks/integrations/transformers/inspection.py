"""Whether a model can run on the kvblocks attention, found by running it: each model is probed once.

Families differ in what reaches the attention function (GPT-2 drops extra keyword arguments, OPT
builds its own causal mask, GPT-J and Falcon never call the interface, GPT-BigCode shares one K/V
head): rather than a list of families, the generator runs the model on three tokens with a
:class:`~kvblocks.integrations.transformers.attention.Probe` in place of the step and checks what
every layer's call received. What it cannot serve is refused before any block is allocated, with one
line naming the model class.
"""

from __future__ import annotations

from typing import Any

import torch

from kvblocks.errors import ConfigError
from kvblocks.hashing import DEFAULT_SCHEME
from kvblocks.integrations.transformers.attention import Call, Probe, kvblocks_attention, step_scope
from kvblocks.integrations.transformers.layout import FULL_GROUP, Layout, windows_of
from kvblocks.tiers import EntryFormat

PROBE_POSITIONS = ([0, 1, 2], [0, 1, 3])
"""Two probe passes over the same three tokens: the last one moved by one position must change its query or key."""


def model_layout(model: Any) -> Layout:
    """The layout the model's config and attention calls show; a ConfigError naming its class if it cannot run."""
    config = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module) or config is None:
        raise ConfigError(f"PagedGenerator needs a transformers model, got {type(model).__name__}")
    windows = windows_of(config)
    first, moved = (_probe(model, config, positions) for positions in PROBE_POSITIONS)
    kv_heads, head_dim, own_mask = _check(type(model).__name__, windows, first, moved)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return Layout(windows, kv_heads, head_dim, dtype, own_mask)


def entry_format(model: torch.nn.Module, block_size: int = 16) -> EntryFormat:
    """The header of ``model``'s stored blocks: ``TierConfig(entry_format=...)`` for a generator with storage.

    Derived from the model's layout (layers, KV heads, head size, dtype) and the block size, as the
    generator's cache; a stored entry of another model shape fails it and is a miss.
    """
    layout = model_layout(model)
    if layout.hybrid:
        raise ConfigError("PagedGenerator serves tiers only for models whose layers are all of one kind")
    return EntryFormat.for_spec(layout.spec(FULL_GROUP, block_size), DEFAULT_SCHEME)


def _probe(model: torch.nn.Module, config: Any, positions: list[int]) -> list[Call]:
    """The attention calls of one forward pass over three tokens at ``positions``."""
    device = next(model.parameters()).device
    vocab: int = model.get_input_embeddings().num_embeddings  # type: ignore[operator]
    ids = torch.tensor([[token % vocab for token in (1, 2, 3)]], device=device)
    probe = Probe()
    try:
        with torch.inference_mode(), kvblocks_attention(config), step_scope(probe):
            model(input_ids=ids, position_ids=torch.tensor([positions], device=device), use_cache=False)
    except Exception as error:  # any failure of a foreign forward pass: this model cannot be served
        reason = str(error).splitlines()[0] if str(error) else ""
        raise ConfigError(
            f"{type(model).__name__} cannot run on PagedGenerator: its forward pass with the kvblocks attention "
            f"failed ({type(error).__name__}: {reason})"
        ) from error
    return probe.calls


def _check(name: str, windows: tuple[int | None, ...], calls: list[Call], moved: list[Call]) -> tuple[int, int, bool]:
    """``(kv_heads, head_dim, own_mask)`` of calls a paged attention can serve; else a one-line ConfigError."""

    def refuse(reason: str) -> ConfigError:
        return ConfigError(f"{name} cannot run on PagedGenerator: {reason}")

    if not calls:
        raise refuse("its attention does not go through transformers' attention interface")
    layers = [call.layer for call in calls]
    if layers != list(range(len(windows))) or len(moved) != len(calls):
        raise refuse(f"its attention calls came from layers {layers}, not once from each of 0..{len(windows) - 1}")
    if not all(call.causal for call in calls):
        raise refuse("its attention is not causal")
    shapes = sorted({(call.key.shape[1], call.key.shape[-1], call.value_dim) for call in calls})
    kv_heads, head_dim, value_dim = shapes[0]
    if len(shapes) > 1 or value_dim != head_dim:
        raise refuse(f"its layers' (kv heads, key size, value size) are {shapes}, not one shape with K and V alike")
    if any(call.query.shape[-1] != head_dim or call.query.shape[1] % kv_heads for call in calls):
        raise refuse(f"its queries' heads or size do not fit {kv_heads} K/V heads of size {head_dim}")
    seen = tuple(call.window for call in calls)
    if seen != windows:
        raise refuse(f"its layers attend with sliding windows {seen}, but its config says {windows}")
    masks = [call.mask for call in calls if call.mask is not None]
    if not all(_plain_causal(mask, calls[0].query.shape[2]) for mask in masks):
        raise refuse(
            "it builds an attention mask that is not plain causal (a bias or padding the paged attention lacks)"
        )
    if all(_same_last(a.query, b.query) and _same_last(a.key, b.key) for a, b in zip(calls, moved)):
        raise refuse("its attention does not follow the position_ids it is given")
    return kv_heads, head_dim, bool(masks)


def _same_last(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a[..., -1, :], b[..., -1, :])


def _plain_causal(mask: torch.Tensor, tokens: int) -> bool:
    """Whether ``mask`` (``[batch, heads or 1, tokens, keys]``, boolean or additive) only hides later tokens."""
    if mask.ndim != 4 or mask.shape[-2] != tokens or mask.shape[-1] < tokens:
        return False
    part = mask[..., :tokens]
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=mask.device).tril().expand(part.shape)
    if part.dtype == torch.bool:
        return torch.equal(part, causal)
    visible, hidden = part == 0, part <= torch.finfo(part.dtype).min / 2
    return torch.equal(visible, causal) and bool((visible | hidden).all())
