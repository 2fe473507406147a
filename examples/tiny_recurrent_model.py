"""A tiny model with full-attention layers beside gated linear recurrences, over hybrid kvblocks.

Four layers: even ones are full attention (their K/V paged in a ``KVCache``, group 0 of a
:class:`~kvblocks.KVCacheManager` with groups), odd ones a gated linear recurrence per channel
(Mamba-like, much simpler): a causal depthwise conv over the layer's input, then
``h_t = a_t * h_{t-1} + (1 - a_t) * u_t``. A recurrent layer keeps no blocks, only a fixed-size
state per sequence -- the conv's last inputs and ``h`` -- in a
:class:`~kvblocks.hybrid.StatePool` (group 1, the manager's recurrent group)::

    state ids   0 .. slots-1                running slots: a forward pass reads and writes its sequence's
                slots .. slots+checkpoints  checkpoints: a slot copied out at a block boundary, cached

The manager plans every state copy; :class:`Engine` runs the plan (``take_state_plan`` ->
``apply_state_plan``) before each forward pass, so a new sequence's slot is zeroed or restored from
a checkpoint, and a prompt's states are saved at the checkpoints its prefill chunks end on
(``next_checkpoint``). A prefix hit then needs both the full group's blocks and a checkpoint
exactly at the hit. ``forward_dense`` recomputes everything from a zero state: the reference.

Run:  python examples/tiny_recurrent_model.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvblocks import KVCacheManager
from kvblocks.backends import get_backend
from kvblocks.backends.cache import KVCache
from kvblocks.backends.group_caches import StatePool, apply_state_plan
from kvblocks.hybrid import CacheGroup, RecurrentGroup, RecurrentState, StateCopy, StateTensor

if str(Path(__file__).resolve().parent) not in sys.path:  # the sibling example, imported as a module
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_hybrid_model import (
    Run,
    TinyHybridConfig,
    TinyHybridModel,
    _slots,
    max_logit_difference,
    reference,
    shared_prefix_prompts,
)

FULL, RECURRENT = 0, 1  # group indices in the manager: the base (full) group, then the one recurrent group

State = dict[str, torch.Tensor]  # one recurrent layer's state of one sequence: "conv" and "h"


@dataclass(frozen=True)
class TinyRecurrentConfig(TinyHybridConfig):
    channels: int = 32  # state channels of each recurrence
    conv: int = 3  # causal conv kernel; its state keeps the last conv - 1 inputs

    def group_of(self, layer: int) -> int:
        return FULL if layer % 2 == 0 else RECURRENT

    def state_group(self) -> CacheGroup:
        """The recurrent layers as one group: its state tensors are this model's, in float32."""
        state = RecurrentState(
            (
                StateTensor("conv", (self.conv - 1, self.channels), "float32"),
                StateTensor("h", (self.channels,), "float32"),
            )
        )
        return CacheGroup.recurrent(self.group_layers(RECURRENT), state)


# (layer, query positions, new K, new V) -> (K, V) of every position up to the last query
Keys = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class TinyRecurrentModel:
    """Attention weights, embedding and head from :class:`TinyHybridModel` (same seed); recurrences of its own."""

    def __init__(self, config: TinyRecurrentConfig = TinyRecurrentConfig()) -> None:
        self.config = config
        self.base = TinyHybridModel(config)
        self.tokens_computed = 0  # every token a forward pass computed
        g = torch.Generator().manual_seed(config.seed + 1)
        dim, width = config.dim, config.channels
        self.mixers = {
            layer: {
                "wu": torch.randn(dim, width, generator=g) / dim**0.5,
                "wa": torch.randn(dim, width, generator=g) / dim**0.5,
                "wg": torch.randn(dim, width, generator=g) / dim**0.5,
                "wo": torch.randn(width, dim, generator=g) / width**0.5,
                "kernel": torch.randn(config.conv, width, generator=g) / config.conv**0.5,
            }
            for layer in config.group_layers(RECURRENT)
        }

    def zero_states(self) -> dict[int, State]:
        c = self.config
        return {
            layer: {"conv": torch.zeros(c.conv - 1, c.channels), "h": torch.zeros(c.channels)} for layer in self.mixers
        }

    def _recur(self, layer: int, x: torch.Tensor, state: State) -> torch.Tensor:
        """The layer's output for ``x`` (normed, ``[T, dim]``); ``state`` is advanced past the T tokens."""
        m = self.mixers[layer]
        count = len(x)
        inputs = torch.cat((state["conv"], x @ m["wu"]))  # the conv's window: earlier inputs, then these
        u = sum(m["kernel"][i] * inputs[i : i + count] for i in range(self.config.conv))
        decay = torch.sigmoid(x @ m["wa"] + 1.0)
        h = state["h"]
        seen = []
        for t in range(count):
            h = decay[t] * h + (1 - decay[t]) * u[t]
            seen.append(h)
        state["conv"], state["h"] = inputs[count:], h
        out = torch.stack(seen) * torch.nn.functional.silu(x @ m["wg"])
        return out @ m["wo"]

    def _attend(self, layer: int, x: torch.Tensor, positions: torch.Tensor, keys: Keys) -> torch.Tensor:
        c, base = self.config, self.base
        w = base.layers[layer]
        count = len(x)
        q = base._rope((x @ w["wq"]).view(count, c.num_heads, c.head_dim), positions).transpose(0, 1)
        k_new = base._rope((x @ w["wk"]).view(count, c.num_kv_heads, c.head_dim), positions)
        k, v = keys(layer, positions, k_new, (x @ w["wv"]).view(count, c.num_kv_heads, c.head_dim))
        repeat = c.num_heads // c.num_kv_heads
        k, v = (t.repeat_interleave(repeat, dim=1).transpose(0, 1) for t in (k, v))
        causal = positions[:, None] >= torch.arange(len(k[0]))[None, :]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        return out.transpose(0, 1).reshape(count, -1) @ w["wo"]

    def _run(self, tokens: list[int], start: int, keys: Keys, states: dict[int, State]) -> torch.Tensor:
        base = self.base
        positions = torch.arange(start, start + len(tokens))
        x = base.embed[torch.tensor(tokens)]
        for layer, w in enumerate(base.layers):
            h = base._norm(x)
            x = x + (
                self._recur(layer, h, states[layer]) if layer in states else self._attend(layer, h, positions, keys)
            )
            x = x + torch.nn.functional.silu(base._norm(x) @ w["w1"]) @ w["w2"]
        self.tokens_computed += len(tokens)
        return base._norm(x) @ base.lm_head

    def forward_dense(self, tokens: list[int]) -> torch.Tensor:
        """Logits of every position of ``tokens`` from a zero state, no cache: the reference."""
        return self._run(tokens, 0, _own_keys, self.zero_states())

    def dense_states(self, tokens: list[int]) -> dict[int, State]:
        """Every recurrent layer's state after ``tokens``, recomputed from scratch."""
        states = self.zero_states()
        self._run(tokens, 0, _own_keys, states)
        return states

    def forward(
        self, tokens: list[int], start: int, cache: KVCache, table: list[int], pool: StatePool, slot: int
    ) -> torch.Tensor:
        """Logits for ``tokens`` at ``start ..``: K/V of earlier positions from ``cache`` through ``table``,
        the recurrences' state from ``pool``'s state ``slot``, which is left holding the state after them."""
        c = self.config
        size = cache.spec.block_size
        layers = c.group_layers(FULL)

        def paged(
            layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = cache.key(layers.index(layer)), cache.value(layers.index(layer))
            blocks, offsets = _slots(table, positions, size)
            keys[blocks, offsets], values[blocks, offsets] = k, v
            blocks, offsets = _slots(table, torch.arange(int(positions[-1]) + 1), size)
            return keys[blocks, offsets], values[blocks, offsets]

        views = {layer: pool.layer(i) for i, layer in enumerate(c.group_layers(RECURRENT))}
        states = {layer: {name: t[slot].clone() for name, t in view.items()} for layer, view in views.items()}
        logits = self._run(tokens, start, paged, states)
        for layer, view in views.items():
            for name, tensor in view.items():
                tensor[slot] = states[layer][name]
        return logits


def _own_keys(
    layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return k, v


@dataclass
class Request:
    """One request in the engine: its tokens, how many are computed, the chunk scheduled now."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    done: int = 0  # tokens whose K/V and state are computed
    end: int = 0  # this step computes tokens [done, end)
    hit: int = 0
    admitted_at: int = -1  # the engine step that admitted it


Hook = Callable[["Engine", list[StateCopy]], None]


class Engine:
    """Continuous batching over one manager, one ``KVCache`` (full layers) and one ``StatePool`` (recurrences).

    Each :meth:`step`: admit waiting requests (lookup, then allocate taking that hit), give every
    prefilling request a chunk ending at its next checkpoint (or its prompt's end), decode the others
    through ``manager.step``, run the state plan, then one forward pass per request and the commits.
    ``before_plan(engine, plan)`` and ``after_plan(engine, plan)`` run around the plan.
    """

    def __init__(
        self,
        model: TinyRecurrentModel,
        *,
        caching: bool = True,
        block_size: int = 4,
        num_blocks: int = 96,
        num_slots: int = 2,
        num_checkpoints: int = 32,
        checkpoint_every: int = 1,
        decode_steps: int = 4,
    ) -> None:
        c = model.config
        self.model = model
        self.decode_steps = decode_steps
        self.cache = get_backend("cpu").allocate(c.cache_spec(FULL, block_size), num_blocks)
        self.pool = StatePool(c.state_group(), num_slots + num_checkpoints)
        group = RecurrentGroup(num_slots, num_checkpoints, checkpoint_every)
        self.manager = KVCacheManager(num_blocks, block_size, groups=[group], enable_prefix_caching=caching)
        self.waiting: list[str] = []
        self.requests: dict[str, Request] = {}
        self.running: list[str] = []
        self.steps = 0
        self.run = Run()
        self.before_plan: Hook | None = None
        self.after_plan: Hook | None = None

    def submit(self, request: str, prompt: list[int]) -> None:
        self.requests[request] = Request(list(prompt), list(prompt))
        self.waiting.append(request)
        self.manager.add_sequence(request, prompt)

    def step(self) -> None:
        self._admit()
        self._schedule()
        plan = self.manager.take_state_plan()
        if self.before_plan is not None:
            self.before_plan(self, plan)
        apply_state_plan(plan, {RECURRENT: self.pool})
        if self.after_plan is not None:
            self.after_plan(self, plan)
        for request in list(self.running):
            self._forward(request)
        self.steps += 1

    def drain(self) -> Run:
        while self.waiting or self.running:
            self.step()
        self.manager.check_integrity()
        return self.run

    def _admit(self) -> None:
        manager = self.manager
        while self.waiting:
            request = self.waiting[0]
            seen = manager.lookup(request).device
            if manager.allocate(request, 0, num_cached_tokens=seen) is None:
                return  # no free running slot (or blocks): it waits, in order
            self.waiting.pop(0)
            r = self.requests[request]
            r.done = r.hit = seen
            r.admitted_at = self.steps
            self.run.hit_tokens += seen
            self.run.prompt_tokens += len(r.prompt)
            self.running.append(request)

    def _schedule(self) -> None:
        manager = self.manager
        decoding = []
        for request in self.running:
            r = self.requests[request]
            if r.done < len(r.prompt):  # prefill: a chunk ending where a checkpoint is taken
                r.end = min(len(r.prompt), manager.next_checkpoint(request) or len(r.prompt))
                if manager.allocate(request, r.end - r.done) is None:
                    raise RuntimeError("the tiny pools are too small for these prompts")
            else:
                decoding.append(request)
        if decoding:  # commit what the last pass computed, append the sampled token, a slot for it
            done = [self.requests[q].done for q in decoding]
            news = [[self.requests[q].tokens[-1]] for q in decoding]
            if manager.step(decoding, done, news):
                raise RuntimeError("the tiny pools are too small to decode")
            for request in decoding:
                self.requests[request].end = self.requests[request].done + 1

    def _forward(self, request: str) -> None:
        r = self.requests[request]
        manager = self.manager
        table = list(manager.block_table(request))
        slot = manager.state_slot(request, RECURRENT)
        logits = self.model.forward(r.tokens[r.done : r.end], r.done, self.cache, table, self.pool, slot)
        self.run.computed_tokens += r.end - r.done
        r.done = r.end
        if r.done < len(r.prompt):
            manager.commit(request, r.done)  # a checkpoint boundary: the state there is saved by the next plan
            return
        self.run.logits.setdefault(request, []).append(logits[-1])
        if len(r.tokens) - len(r.prompt) < self.decode_steps:
            r.tokens.append(int(logits[-1].argmax()))  # sampled: computed (and committed) next step
            if r.done == len(r.prompt):
                manager.commit(request, r.done)
            return
        manager.commit(request, r.done)  # the last token: a save planned here runs before the slot is reused
        manager.free(request)
        self.running.remove(request)
        self.run.tokens[request] = r.tokens


def generate(model: TinyRecurrentModel, prompts: dict[str, list[int]], **engine: object) -> Run:
    """Submit every prompt at once and step until all are done (``engine``: :class:`Engine`'s options)."""
    e = Engine(model, **engine)  # type: ignore[arg-type]
    for request, prompt in prompts.items():
        e.submit(request, prompt)
    return e.drain()


def main() -> None:
    torch.set_num_threads(1)  # tiny matrices: more threads only contend
    model = TinyRecurrentModel()
    prompts = shared_prefix_prompts()
    runs = {"uncached": generate(model, prompts, caching=False), "cached": generate(model, prompts, caching=True)}
    for name, run in runs.items():
        print(f"{name}: {run.computed_tokens} tokens computed, {run.hit_tokens} restored from checkpoints")
    cached = runs["cached"]
    for name, other in (("uncached", runs["uncached"]), ("dense reference", reference(model, cached))):
        print(f"largest logit difference, cached vs {name}: {max_logit_difference(other, cached):.2e}")
    print(f"same generated tokens: {runs['uncached'].tokens == cached.tokens}")


if __name__ == "__main__":
    main()
