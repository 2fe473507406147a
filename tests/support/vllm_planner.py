"""A fake index over a store for the vLLM connector's planner, and block-hash chains (shared by its tests)."""

from __future__ import annotations

from collections.abc import Sequence


class FakeIndex:
    """An index over a store: knows what it learned; probes are answered when the test says so."""

    def __init__(self, stored: set[bytes] = frozenset(), known: set[bytes] = frozenset(), probe_room: int = 10**9):
        self.stored = set(stored)  # what the store really holds
        self.known = set(known)  # what the index knows
        self.pending: dict[int, tuple[bytes, ...]] = {}
        self.answered: set[int] = set()
        self.probe_room = probe_room
        self._next = 0

    def known_run(self, hashes: Sequence[bytes], start: int, stop: int) -> int:
        n = 0
        for h in hashes[start:stop]:
            if h not in self.known:
                break
            n += 1
        return n

    def is_known(self, h: bytes) -> bool:
        return h in self.known

    def probe(self, hashes: Sequence[bytes]) -> int | None:
        if len(self.pending) >= self.probe_room:
            return None
        pid = self._next
        self._next += 1
        self.pending[pid] = tuple(hashes)
        return pid

    def is_answered(self, pid: int) -> bool:
        return pid in self.answered

    def forget(self, hashes: Sequence[bytes]) -> None:
        self.known -= set(hashes)

    def answer_all(self) -> None:
        for pid, hashes in self.pending.items():
            self.known |= {h for h in hashes if h in self.stored}
            self.answered.add(pid)
        self.pending.clear()


def chain(n: int, tag: str = "r") -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]
