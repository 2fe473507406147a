"""A tiny decoder-only transformer whose attention keeps its K/V in kvblocks-managed blocks.

Two layers, grouped-query attention with rotary positions, random weights from a fixed
seed. Every attention call writes the new tokens' K and V into their slots of a kvblocks
``KVCache`` -- slot ``p`` of a sequence is offset ``p % block_size`` of block
``table[p // block_size]`` -- and reads the whole context back through the same table::

    positions   0 1 2 3 | 4 5 6 7 | 8 9
    table       [  12   |   3     |  7 ]      K/V of position 9 live in block 7, offset 1

``generate`` serves a batch of prompts the way an engine does (lookup, allocate, compute
only the uncached suffix, commit, decode, free) and returns every logit it computed, so a
run with prefix caching can be compared with one without.

Run:  python examples/tiny_model.py
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import kvblocks
from kvblocks.backends import KVCacheSpec, get_backend
from kvblocks.backends.base import Backend
from kvblocks.backends.cache import KVCache


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 256
    dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    ffn_dim: int = 128
    rope_theta: float = 10_000.0
    seed: int = 0

    def cache_spec(self, block_size: int, *, layout: str = "NHD", block_major: bool = True) -> KVCacheSpec:
        return KVCacheSpec(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype="float32",
            block_size=block_size,
            layout=layout,  # type: ignore[arg-type]
            block_major=block_major,
        )


class TinyModel:
    """Weights and a forward pass over paged KV. Deterministic: same seed, same weights."""

    def __init__(self, config: TinyConfig = TinyConfig()) -> None:
        self.config = config
        g = torch.Generator().manual_seed(config.seed)

        def weight(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / shape[0] ** 0.5

        c = config
        self.embed = torch.randn(c.vocab, c.dim, generator=g)
        self.layers = [
            {
                "wq": weight(c.dim, c.num_heads * c.head_dim),
                "wk": weight(c.dim, c.num_kv_heads * c.head_dim),
                "wv": weight(c.dim, c.num_kv_heads * c.head_dim),
                "wo": weight(c.num_heads * c.head_dim, c.dim),
                "w1": weight(c.dim, c.ffn_dim),
                "w2": weight(c.ffn_dim, c.dim),
            }
            for _ in range(c.num_layers)
        ]
        self.lm_head = weight(c.dim, c.vocab)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self._inv_freq = inv

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions[:, None].float() * self._inv_freq[None, :]  # [T, hd/2]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def forward(self, tokens: list[int], start: int, cache: KVCache, table: list[int]) -> torch.Tensor:
        """Logits for ``tokens`` at positions ``start ..``; positions before ``start`` are read from the cache."""
        c = self.config
        spec = cache.spec
        size = spec.block_size
        count = len(tokens)
        positions = torch.arange(start, start + count)
        total = start + count
        blocks = torch.tensor([table[p // size] for p in range(start, total)])
        offsets = positions % size
        context = torch.tensor(table[: -(-total // size)])
        x = self.embed[torch.tensor(tokens)]
        causal = positions[:, None] >= torch.arange(total)[None, :]  # [T, total]
        for layer, w in enumerate(self.layers):
            h = self._norm(x)
            q = self._rope((h @ w["wq"]).view(count, c.num_heads, c.head_dim), positions)
            k = self._rope((h @ w["wk"]).view(count, c.num_kv_heads, c.head_dim), positions)
            v = (h @ w["wv"]).view(count, c.num_kv_heads, c.head_dim)
            keys, values = cache.key(layer), cache.value(layer)
            if spec.layout == "NHD":  # [N, block_size, heads, dim]
                keys[blocks, offsets] = k
                values[blocks, offsets] = v
                k_all = keys[context].reshape(-1, c.num_kv_heads, c.head_dim)[:total]
                v_all = values[context].reshape(-1, c.num_kv_heads, c.head_dim)[:total]
            else:  # HND: [N, heads, block_size, dim]
                keys[blocks, :, offsets] = k
                values[blocks, :, offsets] = v
                k_all = keys[context].transpose(1, 2).reshape(-1, c.num_kv_heads, c.head_dim)[:total]
                v_all = values[context].transpose(1, 2).reshape(-1, c.num_kv_heads, c.head_dim)[:total]
            group = c.num_heads // c.num_kv_heads
            k_all = k_all.repeat_interleave(group, dim=1)  # [total, heads, dim]
            v_all = v_all.repeat_interleave(group, dim=1)
            scores = torch.einsum("thd,shd->hts", q, k_all) / c.head_dim**0.5
            scores = scores.masked_fill(~causal[None], float("-inf"))
            attended = torch.einsum("hts,shd->thd", scores.softmax(-1), v_all).reshape(count, -1)
            x = x + attended @ w["wo"]
            x = x + torch.nn.functional.silu(self._norm(x) @ w["w1"]) @ w["w2"]
        return self._norm(x) @ self.lm_head


@dataclass
class Run:
    """What a generation run computed: per request, the logits of its last prompt token and of every decode step."""

    logits: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    computed_tokens: int = 0
    prompt_tokens: int = 0


Hook = Callable[[str, int, kvblocks.KVCacheManager, Backend, KVCache], None]


def generate(
    model: TinyModel,
    prompts: dict[str, list[int]],
    *,
    caching: bool,
    decode_steps: int = 4,
    block_size: int = 4,
    num_blocks: int = 64,
    backend: Backend | None = None,
    layout: str = "NHD",
    block_major: bool = True,
    after_step: Hook | None = None,
) -> Run:
    """Serve ``prompts`` one after another, greedy-decoding ``decode_steps`` tokens each.

    ``after_step(request, step, manager, backend, cache)`` runs after the prefill (step 0)
    and after every decode step, with the request's blocks held: a place to move them.
    """
    backend = backend or get_backend("cpu")
    spec = model.config.cache_spec(block_size, layout=layout, block_major=block_major)
    cache = backend.allocate(spec, num_blocks)
    manager = kvblocks.KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    run = Run()
    for request, prompt in prompts.items():
        manager.add_sequence(request, prompt)
        cached = manager.lookup(request).device
        table = manager.allocate(request, len(prompt) - cached)
        if table is None:
            raise RuntimeError("the tiny pool is too small for this batch")
        logits = model.forward(prompt[cached:], cached, cache, list(table))
        manager.commit(request, len(prompt))
        run.computed_tokens += len(prompt) - cached
        run.prompt_tokens += len(prompt)
        run.logits[request] = [logits[-1]]
        tokens = list(prompt)
        if after_step is not None:
            after_step(request, 0, manager, backend, cache)
        for step in range(1, decode_steps + 1):
            token = int(run.logits[request][-1].argmax())
            tokens.append(token)
            manager.append_tokens(request, [token])
            table = manager.allocate(request, 1)
            if table is None:
                raise RuntimeError("the tiny pool is too small for this batch")
            logits = model.forward([token], len(tokens) - 1, cache, list(table))
            manager.commit(request, len(tokens))
            run.computed_tokens += 1
            run.logits[request].append(logits[-1])
            if after_step is not None:
                after_step(request, step, manager, backend, cache)
        run.tokens[request] = tokens
        manager.free(request)
    manager.check_integrity()
    return run


def shared_prefix_prompts(seed: int = 0, vocab: int = 256) -> dict[str, list[int]]:
    """Prompts over two shared system prompts, one conversation continued with more turns."""
    rng = random.Random(seed)
    system_a = [rng.randrange(vocab) for _ in range(23)]
    system_b = [rng.randrange(vocab) for _ in range(17)]
    user = [[rng.randrange(vocab) for _ in range(rng.randint(3, 9))] for _ in range(6)]
    return {
        "a1": system_a + user[0],
        "a2": system_a + user[1],
        "b1": system_b + user[2],
        "a3": system_a + user[0] + user[3],
        "b2": system_b + user[4],
        "a4": system_a + user[0] + user[3] + user[5],
    }


def max_logit_difference(a: Run, b: Run) -> float:
    return max(float((x - y).abs().max()) for r in a.logits for x, y in zip(a.logits[r], b.logits[r], strict=True))


def main() -> None:
    model = TinyModel()
    prompts = shared_prefix_prompts()
    plain = generate(model, prompts, caching=False)
    cached = generate(model, prompts, caching=True)
    print(
        f"prompt tokens {plain.prompt_tokens}; "
        f"computed without caching {plain.computed_tokens}, with {cached.computed_tokens}"
    )
    print(f"largest logit difference between the runs: {max_logit_difference(plain, cached):.2e}")
    print(f"same generated tokens: {plain.tokens == cached.tokens}")


if __name__ == "__main__":
    main()
