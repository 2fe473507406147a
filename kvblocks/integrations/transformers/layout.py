"""Which cache, which layer of it and which window each model layer uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvblocks.backends import KVCacheSpec
from kvblocks.errors import ConfigError

FULL_GROUP, WINDOW_GROUP = 0, 1


@dataclass(frozen=True)
class Layout:
    """Each layer's window (None: full), the K/V shape the layers' attention calls showed, and whether the
    model builds a causal mask of its own (which the paged attention ignores: positions decide)."""

    windows: tuple[int | None, ...]
    num_kv_heads: int
    head_dim: int
    dtype: str
    own_mask: bool = False

    @property
    def hybrid(self) -> bool:
        """Full and sliding layers mixed: two groups, each with its own cache and table."""
        return len(set(self.windows)) > 1

    @property
    def window(self) -> int | None:
        """The one sliding window of the model (None: no sliding layer)."""
        sizes = {w for w in self.windows if w is not None}
        return sizes.pop() if sizes else None

    def group_of(self, layer: int) -> int:
        return WINDOW_GROUP if self.hybrid and self.windows[layer] is not None else FULL_GROUP

    def group_layers(self, group: int) -> list[int]:
        return [layer for layer in range(len(self.windows)) if self.group_of(layer) == group]

    def index_in_group(self, layer: int) -> int:
        return self.group_layers(self.group_of(layer)).index(layer)

    @property
    def groups(self) -> list[int]:
        return [FULL_GROUP, WINDOW_GROUP] if self.hybrid else [FULL_GROUP]

    def spec(self, group: int, block_size: int) -> KVCacheSpec:
        return KVCacheSpec(
            num_layers=len(self.group_layers(group)),
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            block_size=block_size,
            layout="NHD",
        )


def windows_of(config: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window from ``layer_types`` (or one ``sliding_window`` for every layer); a
    ConfigError for what the integration cannot serve."""
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError("PagedGenerator serves decoder-only models; this one is an encoder-decoder")
    layers: int = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not types:
        return (window,) * layers
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ConfigError(f"PagedGenerator serves full and sliding-window attention layers, not {unknown}")
    if "sliding_attention" in types and not window:
        raise ConfigError("the config has sliding_attention layers but no sliding_window")
    return tuple(window if kind == "sliding_attention" else None for kind in types[:layers])
