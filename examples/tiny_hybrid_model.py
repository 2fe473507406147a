"""A tiny transformer whose layers alternate sliding-window and full attention, over hybrid kvblocks.

Four layers: even ones attend to the last ``window`` tokens (Gemma 3 / gpt-oss style), odd ones
to every token. Each kind of layer is a group with its own ``KVCache`` and block table from a
:class:`~kvblocks.KVCacheManager` with groups: group 0 (full) keeps every block, group 1 (the
window) releases blocks once no later token attends to them, leaving ``PLACEHOLDER`` in its table::

    block size 4, window 6; the next token is 14 (it attends to 9..14)
    positions           0    1    2    3
    full table          5    6    7    8
    window table        -1   -1   3    9       blocks of positions 0-1 were released

A released block stays cached and may be handed to another sequence, so a sliding-window layer
must never read one: :meth:`TinyHybridModel.forward` raises :class:`ReleasedBlockRead` if a key
it attends to maps to a ``PLACEHOLDER``. ``forward_dense`` is the same model with no cache at all
(every K/V recomputed, the same masks): the reference the paged runs are compared with.

Run:  python examples/tiny_hybrid_model.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvblocks import KVCacheManager
from kvblocks.backends import KVCacheSpec, get_backend
from kvblocks.backends.cache import KVCache
from kvblocks.hybrid import PLACEHOLDER, LocalGroup

if str(Path(__file__).resolve().parent) not in sys.path:  # the sibling example, imported as a module
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_model  # its weights, RoPE, norm, prompts and comparison serve this model too
from tiny_model import max_logit_difference, shared_prefix_prompts  # re-exported

FULL, WINDOW = 0, 1  # group indices in the manager: the base (full) group, then the one local group


class ReleasedBlockRead(RuntimeError):
    """A layer was about to read (or write) a position whose block its group has released."""


@dataclass(frozen=True)
class TinyHybridConfig:
    vocab: int = 256
    dim: int = 64
    num_layers: int = 4  # even layers: sliding window; odd layers: full attention
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    ffn_dim: int = 128
    window: int = 6  # a token attends to itself and the window - 1 tokens before it
    rope_theta: float = 10_000.0
    seed: int = 0

    def group_of(self, layer: int) -> int:
        return WINDOW if layer % 2 == 0 else FULL

    def group_layers(self, group: int) -> list[int]:
        return [layer for layer in range(self.num_layers) if self.group_of(layer) == group]

    def cache_spec(self, group: int, block_size: int) -> KVCacheSpec:
        return KVCacheSpec(
            num_layers=len(self.group_layers(group)),
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype="float32",
            block_size=block_size,
        )


# (layer, query positions, new K, new V) -> (K, V, key positions) the layer attends over
KVSource = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class TinyHybridModel(tiny_model.TinyModel):
    """TinyModel's weights (the same seed gives the same ones), RoPE and norm; a forward pass over each group's
    paged KV with per-layer windows, and a dense reference."""

    def __init__(self, config: TinyHybridConfig = TinyHybridConfig()) -> None:
        super().__init__(config)  # type: ignore[arg-type]  # the same fields, plus the window
        self.config: TinyHybridConfig = config  # type: ignore[assignment]
        self.tokens_computed = 0  # every token a forward pass computed, counted by the model itself

    def first_key(self, layer: int, position: int) -> int:
        """The oldest position a query at ``position`` attends to in ``layer``."""
        return max(0, position - self.config.window + 1) if self.config.group_of(layer) == WINDOW else 0

    def _layers(self, tokens: list[int], start: int, kv: KVSource) -> torch.Tensor:
        c = self.config
        count = len(tokens)
        positions = torch.arange(start, start + count)
        x = self.embed[torch.tensor(tokens)]
        for layer, w in enumerate(self.layers):
            h = self._norm(x)
            q = self._rope((h @ w["wq"]).view(count, c.num_heads, c.head_dim), positions)
            k = self._rope((h @ w["wk"]).view(count, c.num_kv_heads, c.head_dim), positions)
            v = (h @ w["wv"]).view(count, c.num_kv_heads, c.head_dim)
            k_all, v_all, key_positions = kv(layer, positions, k, v)
            visible = positions[:, None] >= key_positions[None, :]  # causal
            if c.group_of(layer) == WINDOW:
                visible &= key_positions[None, :] > positions[:, None] - c.window
            group = c.num_heads // c.num_kv_heads
            k_all = k_all.repeat_interleave(group, dim=1)
            v_all = v_all.repeat_interleave(group, dim=1)
            scores = torch.einsum("thd,shd->hts", q, k_all) / c.head_dim**0.5
            scores = scores.masked_fill(~visible[None], float("-inf"))
            attended = torch.einsum("hts,shd->thd", scores.softmax(-1), v_all).reshape(count, -1)
            x = x + attended @ w["wo"]
            x = x + torch.nn.functional.silu(self._norm(x) @ w["w1"]) @ w["w2"]
        self.tokens_computed += count
        return self._norm(x) @ self.lm_head

    def forward_dense(self, tokens: list[int]) -> torch.Tensor:
        """Logits of every position of ``tokens``, no cache: the reference."""

        def own(
            layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return k, v, positions

        return self._layers(tokens, 0, own)

    def forward(
        self, tokens: list[int], start: int, caches: dict[int, KVCache], tables: dict[int, list[int]]
    ) -> torch.Tensor:
        """Logits for ``tokens`` at positions ``start ..``; earlier positions come from the group caches.

        Each layer writes its new K/V through its group's table and reads back only the keys it
        attends to; a ``PLACEHOLDER`` among them raises :class:`ReleasedBlockRead`.
        """
        c = self.config

        def paged(
            layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            group = c.group_of(layer)
            cache, table = caches[group], tables[group]
            size = cache.spec.block_size
            index = c.group_layers(group).index(layer)
            keys, values = cache.key(index), cache.value(index)
            blocks, offsets = _slots(table, positions, size)
            keys[blocks, offsets] = k
            values[blocks, offsets] = v
            key_positions = torch.arange(self.first_key(layer, int(positions[0])), int(positions[-1]) + 1)
            blocks, offsets = _slots(table, key_positions, size)
            return keys[blocks, offsets], values[blocks, offsets], key_positions

        return self._layers(tokens, start, paged)


def _slots(table: list[int], positions: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block and offset of every position; raises if one lies in a released (or missing) block."""
    ids = []
    for p in positions.tolist():
        block = table[p // size] if p // size < len(table) else PLACEHOLDER
        if block == PLACEHOLDER:
            raise ReleasedBlockRead(f"position {p} has no block in this group's table (released or not allocated)")
        ids.append(block)
    return torch.tensor(ids), positions % size


@dataclass
class Run(tiny_model.Run):
    """TinyModel's run record (computed_tokens as counted by the model), plus the tokens hits skipped."""

    hit_tokens: int = 0


Hook = Callable[[str, int, KVCacheManager, dict[int, KVCache]], None]


def generate(
    model: TinyHybridModel,
    prompts: dict[str, list[int]],
    *,
    caching: bool,
    decode_steps: int = 6,
    block_size: int = 4,
    num_blocks: int = 64,
    window_blocks: int = 64,
    after_step: Hook | None = None,
    before_free: Hook | None = None,
) -> Run:
    """Serve ``prompts`` one after another (lookup, allocate from the hit, commit, decode by ``step``, free).

    ``after_step(request, step, manager, caches)`` runs after the prefill's commit (step 0) and
    after every decode ``step`` call (its commit done, its slot granted, the forward pass not yet
    run); ``before_free`` once the last token is committed.
    """
    c = model.config
    backend = get_backend("cpu")
    caches = {
        FULL: backend.allocate(c.cache_spec(FULL, block_size), num_blocks),
        WINDOW: backend.allocate(c.cache_spec(WINDOW, block_size), window_blocks),
    }
    manager = KVCacheManager(
        num_blocks,
        block_size,
        groups=[LocalGroup("sliding_window", span=c.window, num_blocks=window_blocks)],
        enable_prefix_caching=caching,
    )
    run = Run()
    before = model.tokens_computed
    for request, prompt in prompts.items():
        _serve(model, manager, caches, run, request, prompt, decode_steps, after_step, before_free)
    run.computed_tokens = model.tokens_computed - before
    manager.check_integrity()
    return run


def _tables(manager: KVCacheManager, request: str) -> dict[int, list[int]]:
    return {group: manager.group_block_table(request, group) for group in (FULL, WINDOW)}


def _serve(
    model: TinyHybridModel,
    manager: KVCacheManager,
    caches: dict[int, KVCache],
    run: Run,
    request: str,
    prompt: list[int],
    decode_steps: int,
    after_step: Hook | None,
    before_free: Hook | None,
) -> None:
    manager.add_sequence(request, prompt)
    seen = manager.lookup(request).device
    if manager.allocate(request, len(prompt) - seen, num_cached_tokens=seen) is None:
        raise RuntimeError("the tiny pools are too small for this prompt")
    logits = model.forward(prompt[seen:], seen, caches, _tables(manager, request))
    manager.commit(request, len(prompt))
    run.prompt_tokens += len(prompt)
    run.hit_tokens += seen
    run.logits[request] = [logits[-1]]
    tokens = list(prompt)
    if after_step is not None:
        after_step(request, 0, manager, caches)
    for step in range(1, decode_steps + 1):
        token = int(run.logits[request][-1].argmax())
        if manager.step([request], [len(tokens)], [[token]]):  # commit the last token, append the new one
            raise RuntimeError("the tiny pools are too small to decode")
        if after_step is not None:
            after_step(request, step, manager, caches)
        logits = model.forward([token], len(tokens), caches, _tables(manager, request))
        tokens.append(token)
        run.logits[request].append(logits[-1])
    manager.commit(request, len(tokens))
    if before_free is not None:
        before_free(request, decode_steps + 1, manager, caches)
    run.tokens[request] = tokens
    manager.free(request)


def reference(model: TinyHybridModel, run: Run) -> Run:
    """``run``'s logits recomputed densely from each request's tokens: no cache, the same masks."""
    ref = Run()
    for request, tokens in run.tokens.items():
        steps = len(run.logits[request])
        prompt = len(tokens) - steps + 1
        ref.tokens[request] = tokens
        ref.logits[request] = list(model.forward_dense(tokens)[prompt - 1 :])
    return ref


def main() -> None:
    model = TinyHybridModel()
    prompts = shared_prefix_prompts()
    plain = generate(model, prompts, caching=False)
    cached = generate(model, prompts, caching=True)
    dense = reference(model, cached)
    print(
        f"prompt tokens {plain.prompt_tokens}; "
        f"computed without caching {plain.computed_tokens}, with {cached.computed_tokens}"
    )
    print(f"largest logit difference, cached vs uncached: {max_logit_difference(plain, cached):.2e}")
    print(f"largest logit difference, cached vs dense reference: {max_logit_difference(dense, cached):.2e}")
    print(f"same generated tokens: {plain.tokens == cached.tokens}")


if __name__ == "__main__":
    main()
