"""What the router keeps per worker (:class:`WorkerState`), the copy of it a caller reads (:class:`WorkerLoad`),
and the :class:`Lease` a routed request holds on its worker's counters."""

from __future__ import annotations

import warnings
from collections.abc import Hashable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

from kvblocks.routing.config import TIERS

__all__ = ["Lease", "LoadKeeper", "WorkerLoad", "WorkerState"]


@dataclass
class WorkerLoad:
    """A worker's counters (a copy: reading it never changes the router)."""

    worker: Hashable
    running: int
    inflight_prefill_tokens: int
    cached_blocks: int
    draining: bool
    silent: bool
    evicted_recently: float = 0.0


@dataclass
class WorkerState:
    """One worker as its router keeps it: its bit in the index, its load and health, its blocks per tier."""

    id: Hashable
    bit: int
    order: int
    running: int = 0
    inflight: int = 0
    draining: bool = False
    removed: bool = False
    held: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))  # blocks per tier
    last_event: float | None = None
    routed_since_event: float | None = None  # when the first route after the last event was sent
    silent: bool = False
    version: int = 0  # bumped on every load change: older heap entries are stale
    evicted_recently: float = 0.0  # blocks evicted, halved every eviction_half_life routes


class LoadKeeper(Protocol):
    """What a :class:`Lease` changes: its router's load counters (the :class:`~kvblocks.routing.Router`, named
    here by shape only, so that this module does not import the one that uses it)."""

    leaked_leases: int

    def _change_load(self, w: WorkerState, running: int, inflight: int) -> None: ...


class Lease:
    """The counters one routed request holds on its worker; released exactly once.

    Use it as a context manager (also ``async with``): leaving the block -- normally, by an
    exception, or by cancellation -- releases it. :meth:`prefill_done` gives the prefill
    tokens back early (the prefill finished; the sequence keeps running). A lease that is
    garbage collected unreleased is released then, with a warning.
    """

    __slots__ = ("_prefill_open", "_router", "_worker", "closed", "overlap_blocks", "prefill_tokens", "worker")

    def __init__(self, router: LoadKeeper, worker: WorkerState, prefill_tokens: int, overlap_blocks: float) -> None:
        self._router = router
        self._worker = worker
        self.worker = worker.id
        self.prefill_tokens = prefill_tokens
        self.overlap_blocks = overlap_blocks
        self._prefill_open = True
        self.closed = False

    def prefill_done(self) -> None:
        """The prefill finished: its tokens leave the worker's in-flight count (once)."""
        if self._prefill_open:
            self._prefill_open = False
            self._router._change_load(self._worker, 0, -self.prefill_tokens)

    def release(self) -> None:
        """The request ended (finished, failed or cancelled). Idempotent."""
        if self.closed:
            return
        self.closed = True
        pending = self.prefill_tokens if self._prefill_open else 0
        self._prefill_open = False
        self._router._change_load(self._worker, -1, -pending)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            warnings.warn(
                f"a routing lease on worker {self.worker!r} was garbage collected unreleased; releasing it now",
                ResourceWarning,
                stacklevel=2,
            )
            self._router.leaked_leases += 1
            self.release()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("decoding" if not self._prefill_open else "prefilling")
        return f"Lease(worker={self.worker!r}, prefill_tokens={self.prefill_tokens}, {state})"
