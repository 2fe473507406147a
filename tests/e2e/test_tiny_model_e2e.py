"""End to end: a real (tiny) transformer keeps its K/V in kvblocks blocks.

Prefix caching must not change a single logit beyond float noise while computing far fewer
tokens; and the KV must survive every way a block can move -- to a host cache and back,
through a gathered payload (and raw bytes) and back, to other blocks and back -- which
proves kvblocks manages real KV, not just ids.
"""

from __future__ import annotations

import pytest
import torch

from kvblocks.backends import CPUBackend
from tests.support.examples import load_example

tiny = load_example("tiny_model")

MODEL = tiny.TinyModel()
PROMPTS = tiny.shared_prefix_prompts()
TOLERANCE = 1e-4  # float32 logits; the runs differ only in how tokens are batched into matmuls
ARRANGEMENTS = [("NHD", True), ("NHD", False), ("HND", True), ("HND", False)]


@pytest.fixture(scope="module")
def reference():
    """The uncached run: every token computed from scratch."""
    return {arrangement: _run(False, *arrangement) for arrangement in ARRANGEMENTS}


def _run(caching: bool, layout: str, block_major: bool, **kwargs):
    return tiny.generate(MODEL, PROMPTS, caching=caching, layout=layout, block_major=block_major, **kwargs)


def _held_blocks(manager) -> list[int]:
    """Every block holding KV right now: in use or cached idle."""
    pool = manager.pool
    return [b for b in range(pool.num_blocks) if pool.ref_count(b) or pool.is_cached(b)]


@pytest.mark.parametrize("layout, block_major", ARRANGEMENTS)
def test_prefix_caching_matches_full_recompute(reference, layout: str, block_major: bool) -> None:
    plain = reference[(layout, block_major)]
    cached = _run(True, layout, block_major)
    assert tiny.max_logit_difference(plain, cached) < TOLERANCE
    assert cached.tokens == plain.tokens
    assert plain.computed_tokens == plain.prompt_tokens + 4 * len(PROMPTS)
    assert cached.computed_tokens < 0.65 * plain.computed_tokens  # the shared prefixes were not recomputed


def test_the_logits_really_come_from_the_cache(reference) -> None:
    """Corrupting the cached KV must change the logits; otherwise the comparisons above prove nothing."""

    def corrupt(request, step, manager, backend, cache):
        if step == 2:
            cache.key(0).mul_(-1.0)  # every K of layer 0, in place through the strided view

    broken = _run(True, "NHD", True, after_step=corrupt)
    assert tiny.max_logit_difference(reference[("NHD", True)], broken) > 1e-2


def _via_host(request, step, manager, backend, cache):
    """Move every block holding KV out to a host cache, wipe the device copy, bring it back."""
    blocks = _held_blocks(manager)
    host = CPUBackend().allocate(cache.spec, len(blocks), pin_memory=False)
    backend.transfer(cache, host, blocks, list(range(len(blocks))), non_blocking=True).wait()
    backend.zero(cache, blocks)
    assert torch.count_nonzero(cache.key(0)[blocks]) == 0
    backend.transfer(host, cache, list(range(len(blocks))), blocks)


def _via_payload_bytes(request, step, manager, backend, cache):
    """Gather every held block into one payload, turn it into raw bytes and back, scatter it."""
    blocks = _held_blocks(manager)
    raw = backend.gather(cache, blocks).numpy().tobytes()  # what storage writes or a network sends
    backend.zero(cache, blocks)
    payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(len(blocks), cache.spec.bytes_per_block)
    backend.scatter(cache, blocks, payload)


def _via_other_blocks(request, step, manager, backend, cache):
    """Copy every held block into free blocks, wipe the originals, copy them back."""
    blocks = _held_blocks(manager)
    spare = [b for b in range(cache.num_blocks) if b not in set(blocks)][: len(blocks)]
    if len(spare) < len(blocks):
        return
    backend.copy_blocks(cache, blocks, spare)
    backend.zero(cache, blocks)
    backend.copy_blocks(cache, spare, blocks)


@pytest.mark.parametrize("move", [_via_host, _via_payload_bytes, _via_other_blocks], ids=lambda f: f.__name__)
@pytest.mark.parametrize("layout, block_major", [("NHD", True), ("HND", False)])
def test_kv_survives_every_movement(reference, move, layout: str, block_major: bool) -> None:
    moved = _run(True, layout, block_major, after_step=move, num_blocks=96)
    assert tiny.max_logit_difference(reference[(layout, block_major)], moved) < TOLERANCE
    assert moved.tokens == reference[(layout, block_major)].tokens


def test_example_main_prints_the_comparison(capsys) -> None:
    tiny.main()
    out = capsys.readouterr().out
    assert "same generated tokens: True" in out
