"""Deterministic workloads for the benchmarks, and the scheduler loop that drives a manager through them."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class ChatRequest:
    request_id: str
    prompt: list[int]
    output: list[int]


@dataclass(frozen=True)
class ChatWorkload:
    requests: list[ChatRequest]
    working_set_blocks: int  # distinct blocks the whole workload ever caches
    max_request_blocks: int

    @property
    def total_tokens(self) -> int:
        """Prompt plus output tokens over all requests (each request's whole context)."""
        return sum(len(r.prompt) + len(r.output) for r in self.requests)


def multi_turn_chat(
    *,
    seed: int = 0,
    conversations: int = 96,
    turns: tuple[int, int] = (2, 5),
    system_prompts: int = 4,
    system_len: tuple[int, int] = (256, 1024),
    user_len: tuple[int, int] = (32, 384),
    output_len: tuple[int, int] = (16, 128),
    block_size: int = 16,
    vocab: int = 50_000,
) -> ChatWorkload:
    """Conversations over a few shared system prompts; each turn re-sends the whole history.

    Requests are issued turn by turn across all conversations (shuffled within a
    turn), so a conversation's next turn arrives after many others: with a pool
    smaller than the working set, some histories survive in cache and some do not.
    """
    rng = random.Random(seed)

    def tokens(bounds: tuple[int, int]) -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randint(*bounds))]

    systems = [tokens(system_len) for _ in range(system_prompts)]
    system_of = [rng.randrange(system_prompts) for _ in range(conversations)]
    histories = [list(systems[system_of[c]]) for c in range(conversations)]
    num_turns = [rng.randint(*turns) for _ in range(conversations)]
    requests: list[ChatRequest] = []
    for turn in range(max(num_turns)):
        order = [c for c in range(conversations) if num_turns[c] > turn]
        rng.shuffle(order)
        for c in order:
            prompt = histories[c] + tokens(user_len)
            output = tokens(output_len)
            requests.append(ChatRequest(f"c{c}-t{turn}", prompt, output))
            histories[c] = prompt + output
    # Distinct full blocks: the system prompts once, then each conversation's own blocks (the one that
    # straddles the end of its system prompt included).
    working_set = sum(len(s) // block_size for s in systems) + sum(
        len(histories[c]) // block_size - len(systems[system_of[c]]) // block_size for c in range(conversations)
    )
    max_blocks = max(-(-(len(r.prompt) + len(r.output)) // block_size) for r in requests)
    return ChatWorkload(requests, working_set, max_blocks)


def pool_size_for(workload: ChatWorkload, concurrency: int, fraction: float = 0.3) -> int:
    """~``fraction`` of the working set, but never too small for ``concurrency`` requests at their largest."""
    return max(int(workload.working_set_blocks * fraction), concurrency * workload.max_request_blocks + 1)


def serve_chat(manager, workload: ChatWorkload, concurrency: int = 8) -> int:
    """Continuous batching: admit up to ``concurrency`` requests (prefill), then decode one token each per step.

    Works with any object that has the manager's call shapes. Returns the number of
    prompt tokens found cached (so both managers can be checked to do the same work).
    """
    pending = deque(workload.requests)
    running: dict[str, list] = {}  # id -> [request, tokens generated so far]
    cached_total = 0
    while pending or running:
        while pending and len(running) < concurrency:
            req = pending.popleft()
            manager.add_sequence(req.request_id, req.prompt)
            cached = manager.lookup(req.request_id).device
            if manager.allocate(req.request_id, len(req.prompt) - cached) is None:
                raise RuntimeError("pool too small for the benchmark's concurrency")
            manager.commit(req.request_id, len(req.prompt))
            cached_total += cached
            running[req.request_id] = [req, 0]
        for request_id in list(running):
            entry = running[request_id]
            req, done = entry
            manager.append_tokens(request_id, (req.output[done],))
            if manager.allocate(request_id, 1) is None:
                raise RuntimeError("pool too small for the benchmark's concurrency")
            done += 1
            manager.commit(request_id, len(req.prompt) + done)
            if done == len(req.output):
                manager.free(request_id)
                del running[request_id]
            else:
                entry[1] = done
    return cached_total


def serve_prefill_by_hashes(manager, requests: list[tuple[str, list, int]], block_size: int) -> int:
    """Trace-replay shape: sequences arrive as block hashes + length; prefill only, then free."""
    cached_total = 0
    for request_id, hashes, num_tokens in requests:
        manager.add_sequence(request_id, block_hashes=hashes, num_tokens=num_tokens)
        cached = manager.lookup(request_id).device
        if manager.allocate(request_id, num_tokens - cached) is None:
            raise RuntimeError("pool too small")
        manager.commit(request_id, num_tokens)
        manager.free(request_id)
        cached_total += cached
    return cached_total


def serve_chat_step(manager, workload: ChatWorkload, concurrency: int = 8) -> int:
    """:func:`serve_chat` with one batched ``step`` per decode iteration instead of three calls per sequence.

    Admissions are the same as :func:`serve_chat`'s (prefill committed at once, so requests admitted
    together share prompts, and both find the same hits). Each step then commits what the previous
    forward pass wrote (every known token), appends each sequence's sampled token and gives it a slot
    for the next pass.
    """
    pending = deque(workload.requests)
    running: dict[str, list] = {}  # id -> [request, tokens generated so far]
    cached_total = 0
    step = manager.step
    while pending or running:
        while pending and len(running) < concurrency:
            req = pending.popleft()
            manager.add_sequence(req.request_id, req.prompt)
            cached = manager.lookup(req.request_id).device
            if manager.allocate(req.request_id, len(req.prompt) - cached, num_cached_tokens=cached) is None:
                raise RuntimeError("pool too small for the benchmark's concurrency")
            manager.commit(req.request_id, len(req.prompt))  # its prefill, as serve_chat has it
            cached_total += cached
            running[req.request_id] = [req, 0]
        ids = list(running)
        entries = list(running.values())
        computed = [len(req.prompt) + done for req, done in entries]
        sampled = [(req.output[done],) for req, done in entries]
        if step(ids, computed, sampled):
            raise RuntimeError("pool too small for the benchmark's concurrency")
        for request_id, entry in zip(ids, entries):
            entry[1] += 1
            if entry[1] == len(entry[0].output):
                manager.free(request_id)
                del running[request_id]
    return cached_total
