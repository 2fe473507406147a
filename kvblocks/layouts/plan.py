"""The cache layout of a hybrid model: groups of layers, each of one kind, and what they cost.

A model's cache is a set of :class:`CacheGroup` s. Every group holds layers of one kind:

* ``"full"``: full attention, every token's K and V for the whole context;
* ``"sliding_window"``: attention over the last ``window`` tokens only;
* ``"chunked_local"``: attention within the current ``chunk``-token chunk only (Llama 4);
* ``"recurrent"``: a fixed-size state per sequence (Mamba conv + SSM state, a linear-attention
  state), whatever the context length;
* ``"cross_attention"``: K and V of ``encoder_tokens`` encoder outputs per sequence, never
  prefix-cached.

Attention groups reuse :class:`~kvblocks.backends.spec.KVCacheSpec` (one spec over the group's
layers), so a group's ``bytes_per_block`` is exactly the spec's. Groups may have different block
sizes; aligning prefix hits to their least common multiple is a later concern.

:meth:`HybridLayout.split` turns a memory budget into blocks (or states) per group. The rule:
memory goes to each group in proportion to what one running sequence at the target context holds
there, so every group runs out at the same number of running sequences, and no group holds
blocks no other group could match. Integer arithmetic throughout; nothing here imports torch.

Worked example (checked in the tests): a Gemma-3-like layout at 32k tokens, block 16, holds
10 full layers x 2,048 blocks + 52 sliding layers x 65 blocks, about 0.19 of the all-full figure.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from kvblocks.backends.spec import DTYPE_SIZES, KVCacheSpec
from kvblocks.core.groups import kind_rules
from kvblocks.core.groups.rules import GROUP_KINDS, GroupKind
from kvblocks.errors import ConfigError

__all__ = [
    "ATTENTION_KINDS",
    "GROUP_KINDS",
    "CacheGroup",
    "GroupKind",
    "GroupPlan",
    "HybridLayout",
    "MemoryPlan",
    "RecurrentState",
    "StateTensor",
    "held_blocks",
]

ATTENTION_KINDS: frozenset[str] = frozenset({"full", "sliding_window", "chunked_local", "cross_attention"})


def _positive(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{what} must be a positive int, got {value!r}")
    return value


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def held_blocks(kind: str, context: int, block_size: int, span: int | None = None) -> int:
    """Blocks one running sequence of ``context`` tokens holds in a group of ``kind``.

    ``span`` is the window W (sliding) or the chunk C (chunked local); cross-attention holds
    ``span`` encoder tokens. Full holds ceil(L/B). Sliding holds at most ceil(W/B) + 1: the window
    rarely starts on a block boundary, and the block being written is held too (issue 14, item 4).
    Chunked local holds the current chunk: C/B blocks when B divides C (chunks start on block
    boundaries), else ceil(C/B) + 1. Both never hold more than full attention would.
    """
    _positive(block_size, "block_size")
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise ConfigError(f"context must be an int >= 0 tokens, got {context!r}")
    rules = kind_rules(kind)
    if not rules.has_blocks:
        return rules.held_blocks(context, block_size, span)  # raises: it holds no blocks
    if rules.spanned or not rules.prefix_cached:
        span = _positive(span, f"the {kind} span")
    return rules.held_blocks(context, block_size, span)


# ------------------------------------------------------------------ recurrent state


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a layer's recurrent state, per sequence (e.g. the conv window or the SSM state)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"a state tensor needs a name, got {self.name!r}")
        shape = tuple(self.shape) if isinstance(self.shape, (tuple, list)) else self.shape
        if not isinstance(shape, tuple) or not shape:
            raise ConfigError(f"state tensor {self.name!r}: shape must be a non-empty tuple, got {self.shape!r}")
        for dim in shape:
            _positive(dim, f"state tensor {self.name!r} dimension")
        object.__setattr__(self, "shape", shape)
        name = str(self.dtype).removeprefix("torch.")
        if name not in DTYPE_SIZES:
            raise ConfigError(
                f"state tensor {self.name!r}: dtype {self.dtype!r} unknown; known: {', '.join(DTYPE_SIZES)}"
            )
        object.__setattr__(self, "dtype", name)

    @property
    def nbytes(self) -> int:
        size = DTYPE_SIZES[self.dtype]
        for dim in self.shape:
            size *= dim
        return size


@dataclass(frozen=True)
class RecurrentState:
    """The fixed-size state one recurrent layer keeps per sequence: its tensors, in storage order.

    The constructors follow the shapes the public implementations keep (vLLM, transformers):

    >>> RecurrentState.mamba1(d_inner=8192, d_state=16, d_conv=4).bytes_per_layer
    311296
    """

    tensors: tuple[StateTensor, ...]

    def __post_init__(self) -> None:
        tensors = tuple(self.tensors) if isinstance(self.tensors, (tuple, list)) else self.tensors
        if not isinstance(tensors, tuple) or not tensors:
            raise ConfigError("a recurrent state needs at least one tensor")
        if not all(isinstance(t, StateTensor) for t in tensors):
            raise ConfigError("a recurrent state's tensors must be StateTensor")
        if len({t.name for t in tensors}) != len(tensors):
            raise ConfigError(f"state tensor names repeat: {[t.name for t in tensors]}")
        object.__setattr__(self, "tensors", tensors)

    @property
    def bytes_per_layer(self) -> int:
        """Bytes of one layer's state for one sequence."""
        return sum(t.nbytes for t in self.tensors)

    @classmethod
    def mamba1(
        cls, *, d_inner: int, d_state: int, d_conv: int, dtype: str = "bfloat16", ssm_dtype: str | None = None
    ) -> RecurrentState:
        """Mamba(-1): conv window (d_conv - 1) x d_inner, SSM state d_inner x d_state."""
        _conv_kernel(d_conv, "d_conv")
        return cls(
            (
                StateTensor("conv", (d_conv - 1, _positive(d_inner, "d_inner")), dtype),
                StateTensor("ssm", (d_inner, _positive(d_state, "d_state")), ssm_dtype or dtype),
            )
        )

    @classmethod
    def mamba2(
        cls,
        *,
        num_heads: int,
        head_dim: int,
        d_state: int,
        n_groups: int,
        d_conv: int,
        dtype: str = "bfloat16",
        ssm_dtype: str | None = None,
    ) -> RecurrentState:
        """Mamba-2: conv window (d_conv - 1) x (heads x head_dim + 2 x groups x d_state); SSM state
        heads x head_dim x d_state."""
        _conv_kernel(d_conv, "d_conv")
        inner = _positive(num_heads, "num_heads") * _positive(head_dim, "head_dim")
        conv_dim = inner + 2 * _positive(n_groups, "n_groups") * _positive(d_state, "d_state")
        return cls(
            (
                StateTensor("conv", (d_conv - 1, conv_dim), dtype),
                StateTensor("ssm", (num_heads, head_dim, d_state), ssm_dtype or dtype),
            )
        )

    @classmethod
    def gated_delta_net(
        cls,
        *,
        num_key_heads: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        conv_kernel: int,
        dtype: str = "bfloat16",
        ssm_dtype: str | None = None,
    ) -> RecurrentState:
        """Gated DeltaNet (linear attention): conv window (kernel - 1) x (2 x keys + values), state
        value heads x key_head_dim x value_head_dim."""
        _conv_kernel(conv_kernel, "conv_kernel")
        keys = _positive(num_key_heads, "num_key_heads") * _positive(key_head_dim, "key_head_dim")
        values = _positive(num_value_heads, "num_value_heads") * _positive(value_head_dim, "value_head_dim")
        return cls(
            (
                StateTensor("conv", (conv_kernel - 1, 2 * keys + values), dtype),
                StateTensor("ssm", (num_value_heads, key_head_dim, value_head_dim), ssm_dtype or dtype),
            )
        )


def _conv_kernel(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ConfigError(f"{what} must be an int >= 2 (a conv window keeps kernel - 1 tokens), got {value!r}")


# ------------------------------------------------------------------ groups


def _layer_tuple(layers: object) -> tuple[int, ...]:
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise ConfigError(f"layers must be a sequence of layer indices, got {layers!r}")
    out = tuple(layers)
    if not out:
        raise ConfigError("a group needs at least one layer")
    for index in out:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ConfigError(f"layer indices must be ints >= 0, got {index!r}")
    if len(set(out)) != len(out):
        raise ConfigError(f"a layer appears twice in one group: {sorted(out)}")
    return tuple(sorted(out))


@dataclass(frozen=True)
class CacheGroup:
    """Layers of one kind that share a block table (attention) or a state slot (recurrent).

    Attention kinds carry ``spec`` (its ``num_layers`` is the group's layer count); ``recurrent``
    carries ``state``. ``window`` belongs to ``sliding_window``, ``chunk`` to ``chunked_local``,
    ``encoder_tokens`` to ``cross_attention``; each is required there and refused elsewhere, so a
    misplaced figure cannot be silently ignored.
    """

    kind: GroupKind
    layers: tuple[int, ...]
    spec: KVCacheSpec | None = None
    state: RecurrentState | None = None
    window: int | None = None
    chunk: int | None = None
    encoder_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ConfigError(f"kind must be one of {', '.join(GROUP_KINDS)}; got {self.kind!r}")
        object.__setattr__(self, "layers", _layer_tuple(self.layers))
        if self.kind == "recurrent":
            if not isinstance(self.state, RecurrentState) or self.spec is not None:
                raise ConfigError("a recurrent group needs state=RecurrentState(...) and no spec")
        else:
            if not isinstance(self.spec, KVCacheSpec) or self.state is not None:
                raise ConfigError(f"a {self.kind} group needs spec=KVCacheSpec(...) and no state")
            if self.spec.num_layers != len(self.layers):
                raise ConfigError(f"the spec covers {self.spec.num_layers} layers but the group has {len(self.layers)}")
        for field, owner in (
            ("window", "sliding_window"),
            ("chunk", "chunked_local"),
            ("encoder_tokens", "cross_attention"),
        ):
            value = getattr(self, field)
            if self.kind == owner:
                _positive(value, f"{field} of a {owner} group")
            elif value is not None:
                raise ConfigError(f"{field} belongs to {owner} groups, not to a {self.kind} group")

    @classmethod
    def attention(
        cls,
        kind: GroupKind,
        layers: Iterable[int],
        *,
        num_kv_heads: int,
        head_dim: int,
        dtype: str = "bfloat16",
        block_size: int = 16,
        window: int | None = None,
        chunk: int | None = None,
        encoder_tokens: int | None = None,
    ) -> CacheGroup:
        """An attention group whose spec covers exactly its layers."""
        indices = _layer_tuple(layers)
        spec = KVCacheSpec(
            num_layers=len(indices), num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, block_size=block_size
        )
        return cls(kind, indices, spec=spec, window=window, chunk=chunk, encoder_tokens=encoder_tokens)

    @classmethod
    def recurrent(cls, layers: Iterable[int], state: RecurrentState) -> CacheGroup:
        return cls("recurrent", _layer_tuple(layers), state=state)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def block_size(self) -> int | None:
        """Tokens per block; None for a recurrent group (its state does not grow with tokens)."""
        return None if self.spec is None else self.spec.block_size

    @property
    def bytes_per_block(self) -> int | None:
        """Bytes of one block over the group's layers (the spec's figure); None for recurrent."""
        return None if self.spec is None else self.spec.bytes_per_block

    @property
    def bytes_per_state(self) -> int | None:
        """Bytes of one sequence's state over the group's layers; None for attention groups."""
        return None if self.state is None else self.state.bytes_per_layer * self.num_layers

    @property
    def unit_bytes(self) -> int:
        """Bytes of the group's unit of allocation: a block, or one sequence's state."""
        value = self.bytes_per_block if self.spec is not None else self.bytes_per_state
        return int(value or 0)

    @property
    def unit(self) -> str:
        return "state" if self.kind == "recurrent" else "block"

    @property
    def prefix_cacheable(self) -> bool:
        """Cross-attention KV depends on the encoder input, not the token prefix: never cached by prefix."""
        return self.kind != "cross_attention"

    def units_per_sequence(self, context: int) -> int:
        """Blocks (or states) one running sequence of ``context`` tokens holds in this group."""
        if self.kind == "recurrent":
            if isinstance(context, bool) or not isinstance(context, int) or context < 0:
                raise ConfigError(f"context must be an int >= 0 tokens, got {context!r}")
            return 1
        span = {"sliding_window": self.window, "chunked_local": self.chunk, "cross_attention": self.encoder_tokens}
        return held_blocks(self.kind, context, int(self.block_size or 0), span.get(self.kind))

    def held_bytes(self, context: int) -> int:
        """Bytes one running sequence of ``context`` tokens holds in this group."""
        return self.units_per_sequence(context) * self.unit_bytes


# ------------------------------------------------------------------ layout and memory split


@dataclass(frozen=True)
class GroupPlan:
    """One group's share of a memory budget."""

    index: int
    group: CacheGroup
    units: int  # blocks (attention) or states (recurrent)
    units_per_sequence: int

    @property
    def bytes(self) -> int:
        return self.units * self.group.unit_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """A budget split over a layout's groups so that each runs out at the same number of sequences."""

    layout: HybridLayout
    memory_bytes: int
    context: int
    bytes_per_sequence: int
    groups: tuple[GroupPlan, ...]

    @property
    def sequences(self) -> int:
        """Running sequences of ``context`` tokens the budget holds, in every group at once."""
        return self.memory_bytes // self.bytes_per_sequence

    @property
    def used_bytes(self) -> int:
        return sum(g.bytes for g in self.groups)

    def share(self, index: int) -> float:
        """The group's part of the budget (0..1)."""
        return self.groups[index].bytes / self.memory_bytes


@dataclass(frozen=True)
class HybridLayout:
    """A model's cache as groups of layers; no layer belongs to two groups.

    >>> layout = HybridLayout((
    ...     CacheGroup.attention("full", [1], num_kv_heads=2, head_dim=4),
    ...     CacheGroup.attention("sliding_window", [0, 2], num_kv_heads=2, head_dim=4, window=32),
    ... ))
    >>> layout.held_bytes(1024)  # 64 blocks of 512 B + 3 blocks of 1,024 B
    35840
    """

    groups: tuple[CacheGroup, ...]
    name: str = ""

    def __post_init__(self) -> None:
        groups = tuple(self.groups) if isinstance(self.groups, (tuple, list)) else self.groups
        if not isinstance(groups, tuple) or not groups:
            raise ConfigError("a layout needs at least one group")
        if not all(isinstance(g, CacheGroup) for g in groups):
            raise ConfigError("a layout's groups must be CacheGroup")
        seen: set[int] = set()
        for group in groups:
            twice = seen.intersection(group.layers)
            if twice:
                raise ConfigError(f"layers {sorted(twice)} belong to two groups")
            seen.update(group.layers)
        object.__setattr__(self, "groups", groups)

    @property
    def num_layers(self) -> int:
        return sum(g.num_layers for g in self.groups)

    def held_bytes(self, context: int) -> int:
        """Bytes one running sequence of ``context`` tokens holds over every group."""
        return sum(g.held_bytes(context) for g in self.groups)

    def all_full(self) -> HybridLayout:
        """The same layout with every sliding-window and chunked-local group made full attention: the
        baseline a hybrid layout saves against (recurrent and cross-attention groups stay)."""
        groups = tuple(
            replace(g, kind="full", window=None, chunk=None) if g.kind in ("sliding_window", "chunked_local") else g
            for g in self.groups
        )
        return HybridLayout(groups, self.name)

    def split(self, memory_bytes: int, context: int) -> MemoryPlan:
        """Blocks (or states) per group for ``memory_bytes``, sized for sequences of ``context`` tokens.

        Each group gets ``memory x its held bytes per sequence / all groups' held bytes per
        sequence``, rounded down to whole units. So with N = memory // bytes per sequence, every
        group holds exactly N running sequences (``units // units_per_sequence == N``), the total
        never exceeds the budget, and the remainder (under one sequence's worth) is spread in the
        same proportion: attention groups keep a few spare blocks (for cached prefixes), recurrent
        groups exactly N states (checkpoint states for prefix hits are planned separately).
        """
        if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes <= 0:
            raise ConfigError(f"memory_bytes must be an int > 0, got {memory_bytes!r}")
        _positive(context, "context")
        per_sequence = self.held_bytes(context)
        plans = tuple(
            GroupPlan(i, g, memory_bytes * g.units_per_sequence(context) // per_sequence, g.units_per_sequence(context))
            for i, g in enumerate(self.groups)
        )
        return MemoryPlan(self, memory_bytes, context, per_sequence, plans)
