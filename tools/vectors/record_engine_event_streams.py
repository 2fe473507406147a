"""Record KV event streams made by vLLM's and SGLang's own code, for kvblocks' tests (which never need either).

For each scripted worker the engine's own ``ZmqEventPublisher`` is started on loopback and fed the engine's own
``KVEventBatch`` / ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` objects; every frame a SUB socket
sees is recorded, then a DEALER asks the replay (ROUTER) socket for the batches from one sequence number and
the reply frames are recorded too. Hashes are the engine's: vLLM's ``hash_block_tokens`` with its default
``sha256`` (``init_none_hash``) and ``maybe_convert_block_hash`` (the 64-bit int form, vLLM's default; one
worker keeps the digest bytes, as with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``); SGLang's ``get_hash_str`` and
``hash_str_to_int64`` (signed int64). The JSON holds, per worker, the scripted prompts (token ids, so a router
can recompute the hashes), the scripted events as plain values (``script``: what was handed to the engine's
classes, bytes as ``{"hex": ...}``), the live frames and the replay frames, all frames as hex.

Commands that produced tests/data/vllm_event_stream.json and tests/data/sglang_event_stream.json::

    python -m venv /tmp/venv_vllm
    /tmp/venv_vllm/bin/pip install vllm==0.33.0 --no-deps
    /tmp/venv_vllm/bin/pip install torch==2.13.0 msgspec pyzmq cbor2 packaging psutil urllib3 regex numpy \\
        pydantic transformers aiohttp requests openai_harmony openai pillow pybase64 cachetools cloudpickle \\
        uvloop py-cpuinfo prometheus_client xgrammar fastapi partial_json_parser llguidance
    /tmp/venv_vllm/bin/python tools/vectors/record_engine_event_streams.py vllm tests/data/vllm_event_stream.json

    python -m venv /tmp/venv_sglang
    /tmp/venv_sglang/bin/pip install sglang==0.5.23 --no-deps
    /tmp/venv_sglang/bin/pip install torch==2.13.0 msgspec pyzmq   # then what `import
    #   sglang.srt.disaggregation.kv_events, sglang.srt.mem_cache.utils` still asks for (pydantic, requests, ...)
    /tmp/venv_sglang/bin/python tools/vectors/record_engine_event_streams.py sglang tests/data/sglang_event_stream.json

(The dependency lists are what those imports asked for with these versions; ``pip install`` of each missing
module until ``import`` succeeds gets the same.)
"""

from __future__ import annotations

import json
import socket
import sys
import time
from typing import Any

import msgspec
import zmq

BLOCK_SIZE = 4
TOPIC = "kv-events"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _plain(value: Any) -> Any:
    """An engine event (or a field of one) as plain JSON values: bytes as {"hex": ...}."""
    if isinstance(value, msgspec.Struct):
        out = {"type": type(value).__name__}
        out.update({k: _plain(v) for k, v in msgspec.structs.asdict(value).items()})
        return out
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "value") and isinstance(value.value, str):  # a str enum (SGLang's StorageMedium)
        return value.value
    return value


def _record(make_publisher: Any, batches: list[Any], replay_from: int) -> tuple[list[list[str]], list[list[str]]]:
    """Publish ``batches`` through a fresh engine publisher; return (live frames, replay frames) as hex."""
    pub_port, replay_port = _free_port(), _free_port()
    publisher = make_publisher(f"tcp://*:{pub_port}", f"tcp://*:{replay_port}")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    time.sleep(0.5)  # ZMQ's slow joiner: a SUB sees only what is published after it has connected
    for batch in batches:
        publisher.publish(batch)
    live: list[list[str]] = []
    while len(live) < len(batches):
        if not sub.poll(5000):
            raise RuntimeError(f"only {len(live)} of {len(batches)} batches arrived")
        live.append([part.hex() for part in sub.recv_multipart()])
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart([b"", replay_from.to_bytes(8, "big")])
    replay: list[list[str]] = []
    while True:
        if not dealer.poll(5000):
            raise RuntimeError("the replay socket did not answer")
        frames = dealer.recv_multipart()
        replay.append([part.hex() for part in frames])
        if frames[-2] == (-1).to_bytes(8, "big", signed=True):
            break
    for s in (sub, dealer):
        s.close(linger=0)
    publisher.shutdown()
    return live, replay


# ---------------------------------------------------------------------- vLLM


def _vllm_workers() -> dict[str, Any]:
    import vllm
    from vllm.distributed import kv_events as ke
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as ku

    ku.init_none_hash(sha256)

    def chain(tokens: list[int], extra: tuple[Any, ...] | None = None) -> list[bytes]:
        out: list[bytes] = []
        parent = None
        for k in range(0, len(tokens) - len(tokens) % BLOCK_SIZE, BLOCK_SIZE):
            parent = ku.hash_block_tokens(sha256, parent, tokens[k : k + BLOCK_SIZE], extra)
            out.append(bytes(parent))
        return out

    prompts = {
        "A": [1000 + i for i in range(12)],
        "B": [1000 + i for i in range(8)] + [2000 + i for i in range(8)],
        "C": [3000 + i for i in range(8)],
        "D": [4000 + i for i in range(8)],
    }
    lora_key = ("lora", "sql-adapter", "/adapters/sql")
    raw = {name: chain(toks) for name, toks in prompts.items()}
    raw["C"] = chain(prompts["C"], (lora_key,))

    def stored(hashes: list[Any], parent: Any, tokens: list[int], medium: str = "GPU", **kw: Any) -> Any:
        return ke.BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=BLOCK_SIZE,
            lora_id=kw.pop("lora_id", None),
            medium=medium,
            lora_name=kw.pop("lora_name", None),
            **kw,
        )

    def script(convert: Any, with_clear: bool) -> list[list[Any]]:
        h = {name: [convert(x) for x in hashes] for name, hashes in raw.items()}
        full = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}
        swa = {"group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 8}
        a, b, c = prompts["A"], prompts["B"], prompts["C"]
        batches = [
            [stored(h["A"], None, a, **full)],
            [stored(h["B"][2:], h["B"][1], b[8:], extra_keys=None, **full)],
            [stored(h["A"], None, a, session_id="req-a", **swa)],
            [
                stored(h["C"], None, c, lora_id=1, lora_name="sql-adapter", extra_keys=[("sql-adapter",)] * 2, **full),
                ke.BlockRemoved(block_hashes=[h["A"][0]], medium="GPU", group_idx=1),
            ],
            [
                ke.BlockRemoved(block_hashes=[h["B"][3]], medium="GPU", group_idx=0),
                stored([h["B"][3]], h["B"][2], b[12:], medium="CPU", locality="LOCAL", **full),
                ke.BlockRemoved(block_hashes=[h["A"][2]], medium="GPU", group_idx=0),
            ],
            [stored([h["D"][0]], None, prompts["D"][:4], medium="STORAGE", ownership="fs", **full)],
        ]
        if with_clear:
            batches.append([ke.AllBlocksCleared()])
            batches.append([stored(h["A"][:2], None, a[:8], **full)])
        return batches

    workers = []
    for name, rank, int_hashes, with_clear, buffer_steps, replay_from in (
        ("vllm-0", 0, True, False, 10_000, 2),
        ("vllm-1", 1, True, True, 3, 1),  # a replay buffer of 3: asking from 1 cannot fill the gap
        ("vllm-2", 0, False, False, 10_000, 0),  # digest bytes, as with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0
    ):
        convert = (lambda x: int.from_bytes(x, "big") & ((1 << 64) - 1)) if int_hashes else bytes
        if int_hashes:
            probe = raw["A"][0]
            assert ku.maybe_convert_block_hash(ku.BlockHash(probe)) == convert(probe)  # vLLM's own conversion
        events = script(convert, with_clear)
        workers.append(_worker(ke, name, rank, events, 1_700_000_000.0, int_hashes, buffer_steps, replay_from))
    return {
        "engine": "vllm",
        "version": vllm.__version__,
        "hash": "sha256 (vLLM's default, seed 'vllm-none-hash'); events carry maybe_convert_block_hash's int "
        "form unless int_hashes is false; prompt C is hashed with extra_keys (('lora', 'sql-adapter', "
        "'/adapters/sql'),)",
        "block_size": BLOCK_SIZE,
        "topic": TOPIC,
        "prompts": prompts,
        "workers": workers,
    }


def _worker(
    ke: Any,
    name: str,
    rank: int,
    events: list[list[Any]],
    ts0: float,
    int_hashes: bool,
    buffer_steps: int,
    replay_from: int,
) -> dict[str, Any]:
    """One worker's record: its script of events, published by the engine's own ZMQ publisher (``ke``, vLLM's or
    SGLang's kv_events module) as one batch per step from ``ts0`` on, what a subscriber got live and by replay."""
    batches = [ke.KVEventBatch(ts=ts0 + k, events=evs) for k, evs in enumerate(events)]

    def make(endpoint: str, replay: str) -> Any:
        # the engines add the DP rank to the port: hand them the port less the rank
        def shift(address: str) -> str:
            return address.rsplit(":", 1)[0] + ":" + str(int(address.rsplit(":", 1)[1]) - rank)

        return ke.ZmqEventPublisher(rank, shift(endpoint), shift(replay), buffer_steps=buffer_steps, topic=TOPIC)

    live, replay = _record(make, batches, replay_from)
    return {
        "name": name,
        "dp_rank": rank,
        "int_hashes": int_hashes,
        "buffer_steps": buffer_steps,
        "timestamps": [b.ts for b in batches],
        "script": [[_plain(e) for e in evs] for evs in events],
        "live": live,
        "replay_from": replay_from,
        "replay": replay,
    }


# ---------------------------------------------------------------------- SGLang


def _sglang_workers() -> dict[str, Any]:
    import sglang
    from sglang.srt.disaggregation import kv_events as ke
    from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

    prompts = {
        "A": [1000 + i for i in range(12)],
        "B": [1000 + i for i in range(8)] + [2000 + i for i in range(8)],
        "E": [5000 + i for i in range(8)],
    }
    text = {name: get_hash_str(toks, None, BLOCK_SIZE) for name, toks in prompts.items()}
    h = {name: [hash_str_to_int64(x) for x in hs] for name, hs in text.items()}
    GPU, CPU, DISK, EXT = (ke.StorageMedium.GPU, ke.StorageMedium.CPU, ke.StorageMedium.DISK, ke.StorageMedium.EXTERNAL)

    def stored(hashes: list[int], parent: int | None, tokens: list[Any], medium: Any = GPU, **kw: Any) -> Any:
        return ke.BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=BLOCK_SIZE,
            lora_id=None,
            medium=medium,
            **kw,
        )

    a, b, e = prompts["A"], prompts["B"], prompts["E"]
    common = [
        [stored(h["A"], None, a, session_id="sess-1")],
        [stored(h["B"][2:], h["B"][1], b[8:])],
        [ke.BlockRemoved(block_hashes=[h["B"][3]], medium=GPU), stored([h["B"][3]], h["B"][2], b[12:], medium=CPU)],
        [stored([h["E"][0]], None, e[:4], medium=DISK, cache_salt="salt-1", lora_name="sql-adapter")],
        [stored([h["E"][1]], h["E"][0], e[4:], medium=EXT), ke.BlockRemoved(block_hashes=[h["A"][2]])],
    ]
    second = [
        *common,
        [ke.AllBlocksCleared()],
        [stored(h["A"][:2], None, [[a[k], a[k + 1]] for k in range(7)] + [[a[7], 0]])],  # a bigram page pair list
    ]
    workers = []
    for name, rank, events, buffer_steps, replay_from in (
        ("sglang-0", 0, common, 10_000, 1),
        ("sglang-1", 1, second, 3, 2),
    ):
        workers.append(_worker(ke, name, rank, events, 1_700_000_100.0, True, buffer_steps, replay_from))
    return {
        "engine": "sglang",
        "version": sglang.__version__,
        "hash": "get_hash_str(tokens, prior, page_size) (SHA-256 chain), events carry hash_str_to_int64 (signed)",
        "block_size": BLOCK_SIZE,
        "topic": TOPIC,
        "prompts": prompts,
        "workers": workers,
    }


def main(argv: list[str]) -> None:
    if len(argv) != 3 or argv[1] not in ("vllm", "sglang"):
        raise SystemExit(f"usage: {argv[0]} vllm|sglang OUT.json")
    data = _vllm_workers() if argv[1] == "vllm" else _sglang_workers()
    data["generator"] = "tools/vectors/record_engine_event_streams.py " + argv[1]
    with open(argv[2], "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv)
