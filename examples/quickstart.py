"""Drive a KVCacheManager the way an engine's scheduler does, and print what was cached.

Three chat requests share a system prompt; the third continues the first's
conversation. Each goes through lookup -> allocate -> commit (prefill) -> a few
decode steps -> free, exactly as an engine would call them.

Run:  python examples/quickstart.py
"""

from __future__ import annotations

import random

import kvblocks

BLOCK_SIZE = 16


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32_000) for _ in range(n)]


def serve(manager: kvblocks.KVCacheManager, seq_id: str, prompt: list[int], decode_steps: int) -> list[int]:
    """One request's whole life; returns the tokens it ends with (prompt + generated)."""
    manager.add_sequence(seq_id, prompt)
    cached = manager.lookup(seq_id)  # pure: the scheduler may ask as often as it likes
    table = manager.allocate(seq_id, len(prompt) - cached.device)
    if table is None:
        raise SystemExit(f"{seq_id}: not enough free blocks")
    # ... the engine runs prefill for tokens [cached.device, len(prompt)) into `table` ...
    manager.commit(seq_id, len(prompt))
    rng = random.Random(seq_id)
    for _ in range(decode_steps):
        manager.append_tokens(seq_id, [rng.randrange(32_000)])  # the token just sampled
        manager.allocate(seq_id, 1)
        # ... the engine computes that token's KV ...
        manager.commit(seq_id, manager.num_tokens(seq_id))
    final = manager.token_ids(seq_id)
    assert final is not None
    print(
        f"{seq_id:>7}: prompt {len(prompt):4d} tokens, cached {cached.device:4d} "
        f"({cached.device / len(prompt):5.1%}), blocks {list(table)[:6]}{'...' if len(table) > 6 else ''}"
    )
    manager.free(seq_id)
    return list(final)


def main() -> None:
    rng = random.Random(0)
    manager = kvblocks.KVCacheManager(num_blocks=256, block_size=BLOCK_SIZE)
    system_prompt = tokens(rng, 200)

    turn1 = serve(manager, "alice-1", system_prompt + tokens(rng, 40), decode_steps=30)
    serve(manager, "bob-1", system_prompt + tokens(rng, 60), decode_steps=20)
    serve(manager, "alice-2", turn1 + tokens(rng, 25), decode_steps=10)  # the conversation continues

    stats = manager.stats
    print(
        f"\nadmitted {stats.admissions} requests, {stats.queried_tokens} prompt tokens, "
        f"{stats.hit_tokens} served from cache: hit rate {stats.hit_rate:.1%}"
    )
    print(
        f"blocks: {stats.blocks_cached} cached, {stats.blocks_in_use} in use, "
        f"{stats.blocks_fresh} fresh of {stats.num_blocks}; evicted {stats.evicted_blocks}"
    )
    manager.check_integrity()


if __name__ == "__main__":
    main()
