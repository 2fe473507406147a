"""What a storage tier reports: its counters (:class:`StorageTierStats`) and what a read found
(:class:`LoadOutcome`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["LoadOutcome", "Payload", "StorageTierStats"]

Payload = memoryview


@dataclass
class StorageTierStats:
    """Monotonic counters of the storage tier, in blocks."""

    saves_queued: int = 0
    loads_requested: int = 0
    loads_hit: int = 0
    loads_missing: int = 0
    loads_corrupt: int = 0
    """Entries found damaged (bad magic, another format version or spec than their key's format tag names, short,
    long, checksum mismatch): a miss, and removed so that the block can be written again."""
    loads_wrong_key: int = 0
    """Sound entries whose header names another key (copied or renamed): a miss, and removed."""
    loads_beyond_a_miss: int = 0
    load_timeouts: int = 0
    loads_cancelled: int = 0
    load_errors: int = 0
    probes: int = 0
    probes_dropped: int = 0

    def snapshot(self) -> StorageTierStats:
        return replace(self)


@dataclass(frozen=True)
class LoadOutcome:
    """What a read found: payloads of the usable leading run (one per rank per block)."""

    payloads: tuple[tuple[Payload, ...], ...]
