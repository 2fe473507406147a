"""A keyed tier written in test code (a peer node's memory): the toy tier of ``tests/tiers/test_toy_tier.py`` and
the "peer" tier of the manager contract suite. Nothing in kvblocks knows it; ``register_tier_kind`` makes it a
tier kind."""

from __future__ import annotations

from collections.abc import Sequence

from kvblocks.errors import IntegrityError, InvalidArgumentError
from kvblocks.event_codec import BlockStored
from kvblocks.events import EventSink
from kvblocks.hashing import BlockHash
from kvblocks.tiers.protocol import KEYED
from kvblocks.tiers.storage_stats import LoadOutcome


class PeerTier:
    """Blocks a peer node keeps in memory, by chain hash (``memory`` is shared by every node's tier). Its reads
    answer at the next poll; it knows what it holds without asking anyone, so it never probes."""

    medium = KEYED
    timeout_s = 1.0

    def __init__(self, memory: dict[BlockHash, bytes], payload: int = 8) -> None:
        self.memory = memory
        self.payload = payload
        self.requests: dict[int, tuple[BlockHash, ...]] = {}
        self.next_request = 0
        self.timeouts = 0

    @property
    def events(self) -> EventSink | None:
        return None

    @property
    def healthy(self) -> bool:
        return True

    def holds(self, key: BlockHash) -> bool:
        return key in self.memory

    def is_known(self, key: BlockHash) -> bool:
        return key in self.memory

    def known_run(self, hashes: Sequence[BlockHash], start: int, stop: int) -> int:
        n = 0
        while start + n < stop and hashes[start + n] in self.memory:
            n += 1
        return n

    def probe(self, hashes: Sequence[BlockHash]) -> int | None:
        return None

    def is_answered(self, request: int) -> bool:
        return True

    def load(self, hashes: Sequence[BlockHash]) -> int:
        self.next_request += 1
        self.requests[self.next_request] = tuple(hashes)
        return self.next_request

    def cancel(self, request: int) -> None:
        self.requests.pop(request, None)

    def take_results(self) -> list[tuple[int, LoadOutcome]]:
        done, self.requests = self.requests, {}
        results = []
        for request, hashes in done.items():
            run = self.known_run(hashes, 0, len(hashes))
            results.append((request, LoadOutcome(tuple((memoryview(self.memory[h]),) for h in hashes[:run]))))
        return results

    def note_timeout(self, num_blocks: int) -> None:
        self.timeouts += num_blocks

    def check_payloads(self, hashes: Sequence[BlockHash], payloads: Sequence[object]) -> None:
        size = self.payload
        if len(hashes) != len(payloads) or not all(isinstance(p, bytes) and len(p) == size for p in payloads):
            raise InvalidArgumentError(f"the peer takes one {size}-byte payload per block")

    def save(self, hashes: Sequence[BlockHash], payloads: Sequence[object]) -> None:
        for key, payload in zip(hashes, payloads, strict=True):
            self.memory[key] = payload  # type: ignore[assignment]  # checked by check_payloads

    def publish(self) -> None:
        pass

    def snapshot_events(self) -> list[BlockStored]:
        return [BlockStored(tuple(self.memory), None, "peer")] if self.memory else []

    def check_integrity(self) -> None:
        if not all(len(p) == self.payload for p in self.memory.values()):
            raise IntegrityError("a peer entry has the wrong size")

    def flush(self, timeout: float | None) -> bool:
        return True

    def close(self, timeout: float | None) -> None:
        pass

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Nothing runs off-thread: always idle."""
        return True
