"""A kvblocks Router indexes a vLLM fleet from the fleet's own ZMQ event streams, recorded from vLLM 0.33.

``tests/data/vllm_event_stream.json`` holds the frames vLLM's own ``ZmqEventPublisher`` sent for three
workers (made by ``tools/vectors/record_engine_event_streams.py``, whose docstring gives the commands),
with the scripted prompts whose block hashes vLLM computed (sha256, its default seed). Here a small
engine stand-in serves those recorded frames on 127.0.0.1 -- a PUB socket and a ROUTER replay socket that
answers as vLLM's does -- and the router recomputes every hash from the prompts' token ids with
``hash_scheme="vllm-sha256"``, as llm-d's indexer does: nothing here was produced by kvblocks' encoder.

What the workers hold at the end of their scripts (block size 4; the tier weights 1, 0.5, 0.25)::

    vllm-0, vllm-2   device: A0 A1 B2 C0 C1 (C with the sql-adapter LoRA)   host: B3   storage: D0
                     (A2 and B3 left the GPU; the sliding-window group's A0..A2 are not the prefix)
    vllm-1           the same, then AllBlocksCleared, then A0 A1 again on the GPU
"""

from __future__ import annotations

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from kvblocks.events import EventConsumer  # noqa: E402
from kvblocks.hashing import BlockExtras  # noqa: E402
from kvblocks.interop.zmq_events import ZmqEventSubscriber, pump_subscriber  # noqa: E402
from kvblocks.routing import Router, RouterConfig  # noqa: E402
from tests.support.recorded_engine import RecordedEngine, _connected, _load  # noqa: E402

DATA = _load("vllm")
SGLANG = _load("sglang")
PROMPTS = DATA["prompts"]
SQL = BlockExtras(lora="sql-adapter", lora_path="/adapters/sql")


def _follow(
    engines: dict[str, RecordedEngine], router: Router, drop: dict[str, set[int]], data: dict = DATA
) -> dict[str, object]:
    """Subscribe the router to every engine; publish each stream live, leaving out the ``drop`` ped frames."""
    consumer = EventConsumer(on_events=router.apply_events, on_snapshot=router.replace_index)
    dialect = data["engine"]
    subscribers = {
        name: ZmqEventSubscriber(e.endpoint, e.replay_endpoint, worker=name, topic=data["topic"], dialect=dialect)
        for name, e in engines.items()
    }
    try:
        for name, engine in engines.items():
            sub = subscribers[name]
            _connected(sub, engine)  # ZMQ's slow joiner: frame 0 goes live until the SUB has it
            for seq in range(len(engine.frames)):
                engine.advance(live=seq not in drop.get(name, set()))
            while sub.last_seq != len(engine.frames) - 1:
                assert pump_subscriber(sub, consumer, timeout_s=2.0) or sub.last_seq == len(engine.frames) - 1
        assert consumer.gaps == 0 and consumer.needs_resync == set()
        return {name: (s.gaps, s.replays, s.replayed, s.resets, s.malformed) for name, s in subscribers.items()}
    finally:
        for sub in subscribers.values():
            sub.close()


def _engines(names: list[str], data: dict = DATA) -> dict[str, RecordedEngine]:
    by_name = {w["name"]: w for w in data["workers"]}
    return {name: RecordedEngine(by_name[name], data["topic"]) for name in names}


def _expected_overlaps(router: Router) -> dict[str, dict[str, float]]:
    a, b = router.prompt_hashes(PROMPTS["A"]), router.prompt_hashes(PROMPTS["B"])
    c, d = router.prompt_hashes(PROMPTS["C"], SQL), router.prompt_hashes(PROMPTS["D"])
    return {"A": router.overlaps(a), "B": router.overlaps(b), "C": router.overlaps(c), "D": router.overlaps(d)}


@pytest.mark.parametrize("data", [DATA, SGLANG], ids=["vllm", "sglang"])
def test_the_stand_in_answers_a_replay_as_the_engine_did_when_recorded(data: dict) -> None:
    for worker in data["workers"]:
        engine = RecordedEngine(worker, data["topic"])
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        try:
            for _ in engine.frames:
                engine.advance(live=False)  # the replay was asked for after the whole stream was published
            dealer.connect(engine.replay_endpoint)
            dealer.send_multipart([b"", worker["replay_from"].to_bytes(8, "big")])
            answer = []
            while not answer or answer[-1][2] != (-1).to_bytes(8, "big", signed=True):
                assert dealer.poll(5000)
                answer.append(dealer.recv_multipart())
        finally:
            dealer.close(linger=0)
            engine.close()
        assert answer == [[bytes.fromhex(part) for part in frame] for frame in worker["replay"]]


def test_a_router_indexes_a_vllm_fleet_from_its_recorded_streams_recovering_a_gap_by_replay() -> None:
    engines = _engines(["vllm-0", "vllm-1"])
    router = Router(
        ["vllm-0", "vllm-1"],
        RouterConfig(block_size=DATA["block_size"], hash_scheme="vllm-sha256", hash_form="vllm-int64"),
    )
    try:
        # C's store never reaches the router live; vllm-1 loses 2..5, more than its 3-batch buffer reaches back
        counters = _follow(engines, router, drop={"vllm-0": {3}, "vllm-1": {2, 3, 4, 5}})
    finally:
        for engine in engines.values():
            engine.close()
    # the gap was seen and filled from vLLM's replay buffer: nothing was reset
    gaps, replays, replayed, resets, malformed = counters["vllm-0"]  # type: ignore[misc]
    assert gaps == 1 and replays == 1 and replayed >= 1 and resets == 0 and malformed == 0
    assert engines["vllm-0"].requests == [3]
    # vllm-1: the replay from 2 finds only 5..7 in its 3-batch buffer: the worker is reset at 5 -- its view
    # forgets what it cannot know, promising less, never more -- and its own AllBlocksCleared (6) follows
    gaps, replays, replayed, resets, malformed = counters["vllm-1"]  # type: ignore[misc]
    assert gaps == 1 and replays == 1 and resets == 1 and malformed == 0
    assert engines["vllm-1"].requests == [2]
    assert _expected_overlaps(router) == {
        "A": {"vllm-0": 2.0, "vllm-1": 2.0},  # A2 left both GPUs
        "B": {"vllm-0": 3.5, "vllm-1": 2.0},  # B3 is on vllm-0's host tier (0.5)
        "C": {"vllm-0": 2.0},  # recovered through the replay
        "D": {"vllm-0": 0.25},  # storage
    }
    # without its LoRA, C is another prompt: vLLM hashes the adapter into every block
    assert router.overlaps(router.prompt_hashes(PROMPTS["C"])) == {}
    # routing: B's cached prefix wins on vllm-0; A ties on device blocks and goes to the less loaded worker
    with router.route(PROMPTS["B"]) as lease:
        assert lease.worker == "vllm-0" and lease.overlap_blocks == 3.0  # the last-token rule scores 3 blocks
        assert router.route(PROMPTS["A"]).worker == "vllm-1"


def test_a_router_reads_a_vllm_worker_that_publishes_byte_hashes() -> None:
    """``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``: the events carry the 32-byte digests themselves."""
    engines = _engines(["vllm-2"])
    router = Router(["vllm-2"], RouterConfig(block_size=DATA["block_size"], hash_scheme="vllm-sha256"))
    try:
        counters = _follow(engines, router, drop={"vllm-2": {1, 2}})
    finally:
        engines["vllm-2"].close()
    assert counters["vllm-2"][0] == 1 and counters["vllm-2"][3] == 0  # type: ignore[index]
    assert _expected_overlaps(router) == {
        "A": {"vllm-2": 2.0},
        "B": {"vllm-2": 3.5},
        "C": {"vllm-2": 2.0},
        "D": {"vllm-2": 0.25},
    }


def test_a_router_indexes_an_sglang_fleet_from_its_recorded_streams() -> None:
    """SGLang 0.5.23's wire where it differs from vLLM's: signed int64 hashes (``hash_str_to_int64``), its
    media (``CPU_PINNED``, ``DISK``, ``EXTERNAL``), ``attn_dp_rank``; the hashes recomputed from tokens with
    ``sglang-sha256``. sglang-0 ends with A0 A1 B2 on the GPU, B3 pinned on the host and E0 E1 on disk and
    an external pool (both storage); sglang-1 (a 3-batch buffer) then clears and stores A0 A1 again."""
    engines = _engines(["sglang-0", "sglang-1"], SGLANG)
    config = RouterConfig(block_size=SGLANG["block_size"], hash_scheme="sglang-sha256", hash_form="sglang-int64")
    router = Router(["sglang-0", "sglang-1"], config)
    try:
        counters = _follow(engines, router, drop={"sglang-0": {1}, "sglang-1": {1, 2, 3}}, data=SGLANG)
    finally:
        for engine in engines.values():
            engine.close()
    gaps, replays, replayed, resets, malformed = counters["sglang-0"]  # type: ignore[misc]
    assert gaps == 1 and replays == 1 and replayed >= 1 and resets == 0 and malformed == 0
    assert counters["sglang-1"][3] == 1  # type: ignore[index]  # beyond its buffer: reset
    prompts = SGLANG["prompts"]
    assert {name: router.overlaps(router.prompt_hashes(prompts[name])) for name in prompts} == {
        "A": {"sglang-0": 2.0, "sglang-1": 2.0},
        "B": {"sglang-0": 3.5, "sglang-1": 2.0},
        "E": {"sglang-0": 0.5},
    }
