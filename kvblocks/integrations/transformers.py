"""Run a Hugging Face transformers CausalLM on kvblocks' paged KV cache (``pip install "kvblocks[transformers]"``).

:class:`PagedGenerator` serves greedy generation the way an engine does: continuous batching
(every step is one forward pass over the running sequences' new tokens -- prefill chunks and
decode tokens packed into one row, positions given explicitly), prefix caching across requests
and across calls, and preemption with recomputation when the pool runs short::

    step     packed tokens (positions)           what each sequence does
    1        a0..a5 | b0..b3                      a and b prefill (b hit 4 cached tokens: b4..b7 run)
    2        a6 | b8 | c4..c9                     a and b decode, c is admitted and prefills

The model's attention modules call the attention function registered here as ``"kvblocks"``
(transformers' ``AttentionInterface``): it writes the step's new K/V into their slots of a
kvblocks ``KVCache`` and attends over each sequence's context read back through its block
table -- the step's tensors from :class:`~kvblocks.attention.StepMetadataBuilder`, the K/V
through :func:`~kvblocks.attention.write_kv` and :func:`~kvblocks.attention.gather_kv`. Everything else -- projections,
rotary embeddings, q/k norms, biases, GQA, the MLP -- stays the model's own code, so the
outputs are the model's.

Layers follow the config: full attention, or a sliding window (Mistral's ``sliding_window``,
``layer_types`` of Qwen2/Qwen3/Gemma-like models). A model whose layers all share one kind keeps
one cache (every block kept; the window is applied when attending); a model mixing full and
sliding layers gets a :class:`~kvblocks.hybrid.HybridKVCacheManager` with a sliding-window
group whose blocks are released once no later token attends to them. Other layer kinds (linear
attention, chunked attention), encoder-decoder models and models whose attention does not go
through the attention interface are refused with :class:`~kvblocks.errors.ConfigError`.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvblocks.errors import (
    BackendUnavailableError,
    ConfigError,
    InvalidArgumentError,
    InvalidTokenError,
)

try:
    import torch
    from transformers import AttentionInterface
except ImportError as missing:  # one message naming the extra, as the torch backends give
    raise BackendUnavailableError(
        f'kvblocks.integrations.transformers needs torch and transformers: pip install "kvblocks[transformers]" '
        f"({missing})"
    ) from missing

from kvblocks.attention import StepMetadata, StepMetadataBuilder, gather_kv, write_kv
from kvblocks.backends import KVCacheSpec, get_backend
from kvblocks.backends.cache import KVCache
from kvblocks.hybrid import HybridKVCacheManager, LocalGroup
from kvblocks.manager import KVCacheManager

__all__ = ["ATTENTION_NAME", "PagedGenerator"]

ATTENTION_NAME = "kvblocks"
"""The name the paged attention function is registered under in transformers' ``AttentionInterface``."""

STEP_KWARG = "kvblocks_step"
"""The keyword argument that carries a step's metadata from ``model(...)`` to the attention function."""

FULL_GROUP, WINDOW_GROUP = 0, 1


# ---------------------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class _Layout:
    """Which cache and which layer of it each model layer uses, and each layer's window (None: full)."""

    windows: tuple[int | None, ...]
    num_kv_heads: int
    head_dim: int
    dtype: str

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

    @classmethod
    def of(cls, config: Any, dtype: torch.dtype) -> _Layout:
        """The layout a model config asks for; a ConfigError for what the integration cannot serve."""
        if getattr(config, "is_encoder_decoder", False):
            raise ConfigError("PagedGenerator serves decoder-only models; this one is an encoder-decoder")
        layers = config.num_hidden_layers
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(_windows(config, layers), kv_heads, head_dim, str(dtype).removeprefix("torch."))


def _windows(config: Any, layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window from ``layer_types`` (or one ``sliding_window`` for every layer)."""
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


# ---------------------------------------------------------------------------------------------- attention


@dataclass(frozen=True, eq=False)
class _Step:
    """What every layer's attention call of one forward pass shares: the step's kvblocks metadata
    (valid for this step only), the caches, and the per-sequence offsets as host ints (no device sync per layer)."""

    layout: _Layout
    caches: Sequence[KVCache]
    meta: StepMetadata
    starts: list[int]  # each sequence's first new position (its committed line)
    query_starts: list[int]  # where each sequence's new tokens start in the packed row; num_seqs + 1


def _paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature over paged KV: write the new K/V, attend over each context.

    ``query`` is ``[1, heads, tokens, head_dim]``, ``key``/``value`` ``[1, kv_heads, tokens,
    head_dim]`` for the packed tokens of every sequence; the output is ``[1, tokens, heads, head_dim]``.
    """
    step = kwargs.get(STEP_KWARG)
    if not isinstance(step, _Step):
        raise ConfigError(
            f"the {ATTENTION_NAME!r} attention runs inside PagedGenerator (no {STEP_KWARG} reached it); "
            "set the model's attention implementation back to call the model directly"
        )
    if attention_mask is not None:
        raise ConfigError("transformers built an attention mask for the kvblocks attention; it relies on none")
    layer: int = module.layer_idx  # type: ignore[assignment]
    layout = step.layout
    window = layout.windows[layer]
    if (kwargs.get("sliding_window") or None) != window:
        raise ConfigError(
            f"layer {layer} attends with sliding_window={kwargs.get('sliding_window')!r}, "
            f"but its config says {window!r}"
        )
    group = layout.group_of(layer)  # the builder's groups are (0,) or (0, 1): FULL_GROUP, WINDOW_GROUP
    cache = step.caches[group]
    index = layout.index_in_group(layer)
    dtype = cache.spec.torch_dtype()
    new_keys, new_values = key[0].transpose(0, 1).to(dtype), value[0].transpose(0, 1).to(dtype)
    write_kv(cache, index, step.meta.slot_mappings[group], new_keys, new_values)
    table = step.meta.block_tables[group]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])
    for seq, start in enumerate(step.starts):
        lo, hi = step.query_starts[seq], step.query_starts[seq + 1]
        first = max(0, start - window + 1) if window else 0
        keys, values = gather_kv(cache, index, table[seq], start + hi - lo, start=first)
        context = torch.arange(first, start + hi - lo, device=query.device)
        positions = step.meta.positions[lo:hi]
        out[lo:hi] = _attend(query[0, :, lo:hi], keys, values, context, positions, window, scale, kwargs.get("softcap"))
    return out.unsqueeze(0), None


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor | None,
    key_positions: torch.Tensor,
    positions: torch.Tensor,
    window: int | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """One sequence's attention: ``query`` ``[heads, n, dim]`` at ``positions`` over its context ``keys``/``values``
    ``[context, kv_heads, dim]`` at ``key_positions``; ``[n, heads, dim]``."""
    if values is None:  # pragma: no cover - the generator's caches always hold V
        raise ConfigError("the kvblocks attention needs a cache with values")
    repeat = query.shape[0] // keys.shape[1]
    k = keys.transpose(0, 1).repeat_interleave(repeat, dim=0).to(query.dtype)
    v = values.transpose(0, 1).repeat_interleave(repeat, dim=0).to(query.dtype)
    scores = torch.matmul(query, k.transpose(1, 2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    visible = key_positions[None, :] <= positions[:, None]
    if window:
        visible &= key_positions[None, :] > positions[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, v).transpose(0, 1)


AttentionInterface.register(ATTENTION_NAME, _paged_attention)


# ---------------------------------------------------------------------------------------------- generator


@dataclass(eq=False)
class _Request:
    seq_id: tuple[str, int]
    tokens: list[int]
    max_new_tokens: int
    prompt_length: int
    computed: int = 0  # tokens whose K/V the forward passes wrote (the next one to compute)
    known: int = 0  # tokens the manager holds for it (the newest sampled token may not be there yet)
    registered: bool = False
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_length

    @property
    def done(self) -> bool:
        return self.generated >= self.max_new_tokens


StepHook = Callable[["PagedGenerator"], None]


class PagedGenerator:
    """Greedy generation for a transformers CausalLM, its K/V in kvblocks blocks.

    ``num_blocks`` blocks of ``block_size`` tokens; ``max_running`` sequences and
    ``max_batch_tokens`` new tokens per forward pass at most (a longer prompt is prefilled in
    chunks); ``window_blocks`` sizes the sliding-window group's pool of a model mixing full and
    sliding layers (default ``num_blocks``). ``after_step(generator)`` runs after every step.
    The model keeps its own attention implementation outside :meth:`generate`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int = 16,
        *,
        max_running: int = 64,
        max_batch_tokens: int = 512,
        window_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        after_step: StepHook | None = None,
    ) -> None:
        config = getattr(model, "config", None)
        if not isinstance(model, torch.nn.Module) or config is None:
            raise ConfigError(f"PagedGenerator needs a transformers model, got {type(model).__name__}")
        if not getattr(type(model), "_supports_attention_backend", False):
            raise ConfigError(
                f"{type(model).__name__}'s attention does not go through transformers' attention interface"
            )
        for name, value in (("max_running", max_running), ("max_batch_tokens", max_batch_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        parameter = next(model.parameters())
        self.model = model
        self._config: Any = config
        self.layout = _Layout.of(config, parameter.dtype)
        self.device = parameter.device
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.after_step = after_step
        self.vocab_size: int = model.get_input_embeddings().num_embeddings  # type: ignore[operator]
        self.manager = self._manager(num_blocks, block_size, window_blocks, enable_prefix_caching)
        backend = get_backend(str(self.device))
        self.caches: list[KVCache] = [
            backend.allocate(self.layout.spec(g, block_size), self._group_blocks(g)) for g in self.layout.groups
        ]
        self.computed_tokens = 0
        """Tokens the forward passes computed so far (prefix-cache hits are not computed)."""
        self.last_logits: list[torch.Tensor] = []
        """Per prompt of the last :meth:`generate` call: the logits each new token was picked from."""
        self._ids = itertools.count()
        self._builder = StepMetadataBuilder(self.manager, self.device)

    def _manager(self, num_blocks: int, block_size: int, window_blocks: int | None, caching: bool) -> KVCacheManager:
        layout = self.layout
        if not layout.hybrid:
            return KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
        window = layout.window
        if window is None:  # pragma: no cover - hybrid means a window exists
            raise ConfigError("a hybrid layout needs a sliding window")
        group = LocalGroup("sliding_window", span=window, num_blocks=window_blocks or num_blocks)
        return HybridKVCacheManager(num_blocks, block_size, local_groups=[group], enable_prefix_caching=caching)

    def _group_blocks(self, group: int) -> int:
        manager = self.manager
        if isinstance(manager, HybridKVCacheManager):
            return manager.group_pool(group).num_blocks
        return manager.num_blocks

    # ------------------------------------------------------------------ public

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16) -> list[list[int]]:
        """The ``max_new_tokens`` greedy tokens after each prompt (no stop token), in prompt order."""
        requests = self._requests(prompts, max_new_tokens)
        config = self._config
        previous = config._attn_implementation
        config._attn_implementation = ATTENTION_NAME
        waiting: deque[_Request] = deque(requests)
        running: list[_Request] = []
        try:
            with torch.inference_mode():
                while waiting or running:
                    chunks = self._schedule(running, waiting)
                    self._forward(running, chunks)
                    if self.after_step is not None:
                        self.after_step(self)
        finally:
            config._attn_implementation = previous
            for request in requests:  # an error mid-way: give every block back
                if request.registered:
                    self.manager.free(request.seq_id)
        self.last_logits = [torch.stack(r.logits) for r in requests]
        return [r.tokens[r.prompt_length :] for r in requests]

    # ------------------------------------------------------------------ input

    def _requests(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[_Request]:
        """Checked requests; any bad input raises before a block or a forward pass is spent."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise InvalidArgumentError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
        checked = [self._prompt(i, prompt, max_new_tokens) for i, prompt in enumerate(prompts)]
        return [_Request(("kvblocks-generate", next(self._ids)), p, max_new_tokens, len(p)) for p in checked]

    def _prompt(self, number: int, prompt: object, max_new_tokens: int) -> list[int]:
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise InvalidArgumentError(f"prompt {number} must be a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise InvalidTokenError(f"prompt {number} is empty; a prompt needs at least one token")
        tokens = list(prompt)
        for position, token in enumerate(tokens):
            if isinstance(token, bool) or not isinstance(token, int):
                raise InvalidTokenError(f"prompt {number}, position {position}: {token!r} is not a token id")
            if not 0 <= token < self.vocab_size:
                raise InvalidTokenError(
                    f"prompt {number}, position {position}: token {token} is outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        need = math.ceil((len(tokens) + max_new_tokens - 1) / self.manager.block_size)
        if need > self.manager.num_blocks:
            raise ConfigError(
                f"prompt {number} needs {need} blocks with its new tokens; the pool has {self.manager.num_blocks}"
            )
        return tokens

    # ------------------------------------------------------------------ scheduling

    def _schedule(self, running: list[_Request], waiting: deque[_Request]) -> dict[int, int]:
        """Slots for this step: the running sequences' next chunks (one ``step`` call), then admissions.

        Returns the number of new tokens per request (by ``id``). A sequence that cannot grow
        preempts the newest running one (which is recomputed later) until it can.
        """
        budget = self.max_batch_tokens
        chunks: dict[int, int] = {}
        for request in running:
            chunks[id(request)] = n = min(len(request.tokens) - request.computed, budget)
            budget -= n
        self._grow(running, waiting, chunks)
        budget = self.max_batch_tokens - sum(chunks.values())
        while waiting and len(running) < self.max_running and budget > 0:
            request = waiting[0]
            admitted = self._admit(request, budget)
            if admitted is None:
                break
            waiting.popleft()
            running.append(request)
            chunks[id(request)] = admitted
            budget -= admitted
        if not running:
            raise ConfigError("the pool cannot hold even one waiting request; give PagedGenerator more blocks")
        return chunks

    def _grow(self, running: list[_Request], waiting: deque[_Request], chunks: dict[int, int]) -> None:
        """One ``manager.step`` for the running sequences: commit last step's tokens, append, grow."""
        pending = list(running)
        while pending:
            failed = set(
                self.manager.step(
                    [r.seq_id for r in pending],
                    [r.computed for r in pending],
                    [r.tokens[r.known :] for r in pending],
                    [chunks[id(r)] for r in pending],
                )
            )
            for request in pending:
                if request.seq_id not in failed:
                    request.known = len(request.tokens)
            pending = [r for r in pending if r.seq_id in failed]
            if pending:
                victim = running.pop()
                self._preempt(victim, waiting, chunks)
                pending = [r for r in pending if r is not victim]

    def _preempt(self, request: _Request, waiting: deque[_Request], chunks: dict[int, int]) -> None:
        self.manager.preempt(request.seq_id)
        request.computed = 0
        chunks.pop(id(request), None)
        waiting.appendleft(request)

    def _admit(self, request: _Request, budget: int) -> int | None:
        """Admit ``request`` with its cached prefix and a first chunk; None (nothing changed) if no room."""
        manager = self.manager
        if not request.registered:
            manager.add_sequence(request.seq_id, request.tokens)
            request.registered = True
        elif request.known < len(request.tokens):
            manager.append_tokens(request.seq_id, request.tokens[request.known :])
        request.known = len(request.tokens)
        hit = manager.lookup(request.seq_id).device
        n = min(len(request.tokens) - hit, budget)
        if manager.allocate(request.seq_id, n, num_cached_tokens=hit) is None:
            return None
        request.computed = hit
        return n

    # ------------------------------------------------------------------ forward

    def _forward(self, running: list[_Request], chunks: dict[int, int]) -> None:
        """One forward pass over every scheduled chunk; sample where a sequence caught up; retire finished ones."""
        batch = [r for r in running if chunks.get(id(r), 0) > 0]
        if not batch:
            return
        counts = [chunks[id(r)] for r in batch]
        starts = [r.computed for r in batch]
        meta = self._builder.build([r.seq_id for r in batch], counts)
        query_starts = list(itertools.accumulate(counts, initial=0))
        step = _Step(self.layout, self.caches, meta, starts, query_starts)
        tokens = [t for r, s, n in zip(batch, starts, counts) for t in r.tokens[s : s + n]]
        output = self.model(
            input_ids=torch.tensor([tokens], device=self.device),
            position_ids=meta.positions.unsqueeze(0),
            use_cache=False,
            **{STEP_KWARG: step},
        )
        logits = output.logits[0]
        self.computed_tokens += len(tokens)
        for request, n, end in zip(batch, counts, query_starts[1:]):
            request.computed += n
            if request.computed == len(request.tokens):
                row = logits[end - 1].float()
                request.logits.append(row)
                request.tokens.append(int(row.argmax()))
                if request.done:
                    self.manager.commit(request.seq_id, request.computed)
                    self.manager.free(request.seq_id)
                    request.registered = False
                    running.remove(request)
