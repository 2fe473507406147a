"""An engine stand-in for tests: serves a stream recorded from vLLM's or SGLang's own ZMQ publisher
(``tests/data/*_event_stream.json``) on 127.0.0.1 as the engine did -- PUB frames, and a ROUTER that answers
replay requests from the frames published so far -- so that subscribers are tested against real bytes."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from kvblocks.interop.zmq_events import END_SEQ, ZmqEventSubscriber

DATA = Path(__file__).parents[1] / "data"
ANY_PORT = "tcp://127.0.0.1:*"


def _until(condition: Callable[[], bool], step: Callable[[], object], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        step()


class RecordedEngine:
    """Serves a recorded stream as the engine did: live frames on PUB, a replay ROUTER over the frames
    'published' so far (the last ``buffer_steps``). ``advance(live=False)`` puts a frame in the buffer
    without sending it live: a message the subscriber missed. While ``silent`` the ROUTER takes each
    request (counted in ``requests``) and never answers."""

    def __init__(self, worker: dict[str, Any], topic: str) -> None:
        ctx = zmq.Context.instance()
        self.frames = [[bytes.fromhex(p) for p in f] for f in worker["live"]]
        self.topic = topic.encode()
        self.buffer: deque[list[bytes]] = deque(maxlen=worker["buffer_steps"])
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(ANY_PORT)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind(ANY_PORT)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.next = 0
        self.requests: list[int] = []  # the start of every replay request served
        self.silent = False  # take replay requests and never answer them
        self.on_request: Callable[[], object] = lambda: None  # runs before each answer goes out
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def advance(self, live: bool = True) -> None:
        frame = self.frames[self.next]
        self.next += 1
        with self.lock:
            self.buffer.append(frame)
        if live:
            self.pub.send_multipart(frame)

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(10):
                continue
            client, _, start = self.router.recv_multipart()
            self.requests.append(int.from_bytes(start, "big"))
            if self.silent:
                continue
            with self.lock:
                frames = [f for f in self.buffer if int.from_bytes(f[1], "big") >= int.from_bytes(start, "big")]
            self.on_request()
            for f in frames:
                self.router.send_multipart([client, b"", *f])
            self.router.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.pub.close(linger=0)
        self.router.close(linger=0)


def _load(engine: str) -> dict[str, Any]:
    return dict(json.loads((DATA / f"{engine}_event_stream.json").read_text()))


def _connected(sub: ZmqEventSubscriber, engine: RecordedEngine) -> None:
    """Wait out ZMQ's slow joiner: frame 0 goes live until the SUB has it (a SUB misses what precedes it)."""
    first = engine.frames[0]

    def resend() -> None:
        engine.pub.send_multipart(first)
        time.sleep(0.005)

    _until(lambda: sub._sub.poll(0) != 0, resend)
