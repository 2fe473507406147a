"""The storage tier's interface, its counters, and the in-memory backend.

A :class:`StorageBackend` stores opaque entries (header + payload, see
:mod:`kvblocks.tiers.entry`) under block keys, in batches. It never raises for an I/O
failure: a read that fails is a miss, a write that fails is dropped, and both are counted
in :class:`StorageStats`. Callers' mistakes -- a malformed key -- do raise.

``contains`` has prefix semantics, because only a cached *prefix* is usable::

    keys      k0   k1   k2   k3
    stored    yes  no   yes  yes
    contains  -> 1   (k2 and k3 cannot be used without k1)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from kvblocks.errors import ConfigError
from kvblocks.tiers.entry import valid_key

__all__ = ["MemoryStorage", "StorageBackend", "StorageStats", "usable_prefix"]


def byte_view(buffer: Any) -> memoryview:
    """``buffer`` (writable or not) as a flat memoryview of bytes: itself when it already is one, since a
    read into place passes one per layer per block."""
    if type(buffer) is memoryview and buffer.format == "B" and buffer.ndim == 1:
        return buffer
    return memoryview(buffer).cast("B")


@dataclass
class StorageStats:
    """Monotonic counters of one storage backend."""

    puts: int = 0
    put_bytes: int = 0
    put_errors: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    get_errors: int = 0
    deletes: int = 0
    evictions: int = 0
    skipped_entries: int = 0
    """Things found where entries live that are not entries -- links, FIFOs, directories, sockets, files
    named as no key (``FileStorage``): never followed, opened or removed; counted each time one is met
    (the start-up scan, a read)."""

    def snapshot(self) -> StorageStats:
        return replace(self)


@runtime_checkable
class StorageBackend(Protocol):
    """What the storage tier needs from a backend (memory, a directory, Redis ...)."""

    stats: StorageStats

    def put(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]]) -> int:
        """Store entries; returns how many were written (failures are dropped and counted)."""

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """The entries under ``keys`` (None for a miss or a failed read)."""

    def contains(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are stored (stops at the first miss)."""

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored (a failed check says False)."""

    def delete(self, keys: Sequence[str]) -> int:
        """Remove entries; returns how many existed."""

    def close(self) -> None:
        """Release connections and handles; the backend is unusable afterwards."""


def usable_prefix(runs: Sequence[int]) -> int:
    """The blocks every tensor-parallel rank can load: the shortest rank's leading run.

    >>> usable_prefix([4, 2, 3])   # rank 1 found only 2 leading blocks of its shard
    2
    """
    if not runs:
        raise ConfigError("usable_prefix needs one run length per rank")
    return min(runs)


class MemoryStorage:
    """Entries in a dict, for tests and single-process use; optional byte budget with LRU eviction."""

    def __init__(self, *, byte_budget: int | None = None) -> None:
        if byte_budget is not None and (
            isinstance(byte_budget, bool) or not isinstance(byte_budget, int) or byte_budget < 0
        ):
            raise ConfigError(f"byte_budget must be an int >= 0 or None, got {byte_budget!r}")
        self._budget = byte_budget
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = StorageStats()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]]) -> int:
        checked = [(valid_key(key), bytes(value)) for key, value in items]
        with self._lock:
            for key, value in checked:
                if self._budget is not None and len(value) > self._budget:
                    self.stats.put_errors += 1
                    continue
                old = self._entries.pop(key, None)
                if old is not None:
                    self._bytes -= len(old)
                self._entries[key] = value
                self._bytes += len(value)
                self.stats.puts += 1
                self.stats.put_bytes += len(value)
                self._evict_over_budget()
        return len(checked)

    def _evict_over_budget(self) -> None:
        while self._budget is not None and self._bytes > self._budget:
            _, value = self._entries.popitem(last=False)
            self._bytes -= len(value)
            self.stats.evictions += 1

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        checked = [valid_key(key) for key in keys]
        out: list[bytes | None] = []
        with self._lock:
            for key in checked:
                value = self._entries.get(key)
                self.stats.gets += 1
                if value is None:
                    self.stats.misses += 1
                else:
                    self.stats.hits += 1
                    self._entries.move_to_end(key)
                out.append(value)
        return out

    def contains(self, keys: Sequence[str]) -> int:
        checked = [valid_key(key) for key in keys]
        with self._lock:
            count = 0
            for key in checked:
                if key not in self._entries:
                    break
                count += 1
            return count

    def exists(self, keys: Sequence[str]) -> list[bool]:
        checked = [valid_key(key) for key in keys]
        with self._lock:
            return [key in self._entries for key in checked]

    def delete(self, keys: Sequence[str]) -> int:
        checked = [valid_key(key) for key in keys]
        removed = 0
        with self._lock:
            for key in checked:
                value = self._entries.pop(key, None)
                if value is not None:
                    self._bytes -= len(value)
                    removed += 1
            self.stats.deletes += removed
        return removed

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
