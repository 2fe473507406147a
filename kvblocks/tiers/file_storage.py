"""FileStorage: one file per block entry in a local or shared directory.

    root/
      3f/xxh3-128.2d0a6f8b1056740b.b6a1f...e2      shard = low byte of the key's xxh3-64, in hex
      a0/...

Keys are validated storage keys (``[a-z0-9.-]``), so no caller text ever becomes a path.
A write goes to a temporary file in the same shard and is renamed into place, so a reader
sees a whole entry or none. With ``byte_budget`` the directory is kept under that many
bytes by removing the least recently used entries (recency as this process saw it: entries
on disk at start-up are ranked by modification time). Several processes may share one
directory; each enforces the budget for what it knows, so shared budgets are approximate.

Failures never raise: a write that fails (disk full, permission denied) is dropped and
counted; a read that fails is a miss, counted.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import xxhash

from kvblocks.errors import ConfigError
from kvblocks.tiers.entry import valid_key
from kvblocks.tiers.storage import StorageStats, byte_view

__all__ = ["FileStorage"]

_TEMP_PREFIX = ".tmp-"
_PREADV = getattr(os, "preadv", None)
_O_READ = os.O_RDONLY | getattr(os, "O_BINARY", 0)  # O_BINARY: Windows only
_IOV_MAX = 16  # buffers per preadv call: at least this many on every platform, raised below where known
if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names:
    _IOV_MAX = max(_IOV_MAX, min(1024, os.sysconf("SC_IOV_MAX")))


READ_RUN_BYTES = 512 << 10
"""With ``get_into``'s ``on_read``: the bytes read per ``preadv`` before the filled buffers are handed on.

Small enough that a run is still in the reading core's cache (L2 here: 1 MiB) when ``on_read``
checksums it, so the check costs almost no second trip to memory; big enough that the calls per entry
stay few. 16 entries of 2 MiB read into a block's scattered layer views by two threads (median of 150
rounds, this VM): 2.75 ms in runs of 512 KiB, 2.78 of 1 MiB, 3.13 of 256 KiB, 3.90 of 128 KiB, 3.03
read whole then checksummed, 2.67 read without a checksum."""


def _read_fully(fd: int, views: list[memoryview], offset: int = 0) -> int:
    """Fill ``views`` from ``offset`` in the file, in order, until they are full or the file ends; bytes read.

    ``preadv`` may return short (a signal, the kernel's per-call limits) and takes at most
    ``IOV_MAX`` buffers: it is called again on what is left, and a read of 0 bytes means the end.
    """
    total = sum(map(len, views))
    if _PREADV is not None and len(views) <= _IOV_MAX and _PREADV(fd, views, offset) == total:
        return total  # one call filled them all (the common case: no bookkeeping per buffer)
    start = offset  # short (a signal, the file's end) or too many buffers: again from the start, in steps
    pending = [view for view in views if len(view)]
    while pending:
        if _PREADV is not None:
            got = _PREADV(fd, pending[:_IOV_MAX], offset)
        else:  # no preadv (Windows): read the first buffer's worth and copy it in
            os.lseek(fd, offset, os.SEEK_SET)
            data = os.read(fd, len(pending[0]))
            got = len(data)
            pending[0][:got] = data
        if got <= 0:
            break
        offset += got
        while pending and got >= len(pending[0]):
            got -= len(pending[0])
            pending.pop(0)
        if got:
            pending[0] = pending[0][got:]
    return offset - start


def _read_in_runs(fd: int, views: list[memoryview], on_read: Callable[[list[memoryview]], object]) -> None:
    """Fill ``views`` as :func:`_read_fully` does, in runs of about :data:`READ_RUN_BYTES`, calling
    ``on_read(run)`` with each run's views once they are full, in order (a view the file's end left
    short, and those after it: never).

        views   [hdr][ 64K ][ 64K ] ... [ 64K ][ 64K ] ...
        reads   |------- run 1 (>= 512K) -----|-- run 2 ...
        on_read  [hdr, 64K, ..., 64K]          then run 2's views
    """
    ends = list(itertools.accumulate(map(len, views)))
    offset = first = 0
    while first < len(views):
        last = min(bisect.bisect_left(ends, offset + READ_RUN_BYTES, first), len(views) - 1, first + _IOV_MAX - 1)
        run = views[first : last + 1]
        got = _read_fully(fd, run, offset)
        if got != ends[last] - offset:  # the file ended inside this run: hand on the views it filled
            full = bisect.bisect_right(ends, offset + got, first, last + 1) - first
            if full:
                on_read(run[:full])
            return
        on_read(run)
        offset, first = ends[last], last + 1


class FileStorage:
    """Block entries as files under ``root`` (see the module docstring)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        byte_budget: int | None = None,
        fsync: bool = False,
        index_existing: bool = True,
    ) -> None:
        """``index_existing=False`` skips the start-up scan of the directory (and its clean-up of dead
        temporaries): for a process that only asks which entries exist (vLLM's scheduler side), whose
        index of sizes would never be used -- it never writes, so it never enforces ``byte_budget``."""
        if byte_budget is not None and (
            isinstance(byte_budget, bool) or not isinstance(byte_budget, int) or byte_budget < 0
        ):
            raise ConfigError(f"byte_budget must be an int >= 0 or None, got {byte_budget!r}")
        self.root = Path(root)
        self._root = os.fspath(self.root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"cannot use {self.root} as a storage directory: {error}") from error
        self._budget = byte_budget
        if not isinstance(fsync, bool):
            raise ConfigError(f"fsync must be a bool, got {fsync!r}")
        self._fsync = fsync
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self._bytes = 0
        self._serial = 0
        self._shards: set[str] = set()  # shard directories known to exist
        self.stats = StorageStats()
        if not isinstance(index_existing, bool):
            raise ConfigError(f"index_existing must be a bool, got {index_existing!r}")
        if index_existing:
            self._load_index()

    # ---------------------------------------------------------------- layout

    @staticmethod
    def _shard(key: str) -> str:
        return f"{xxhash.xxh3_64_intdigest(key.encode()) & 0xFF:02x}"

    def _file(self, key: str) -> str:
        """Where ``key``'s entry lives, as the string every call here hands the OS (a ``Path`` built per
        key costs several microseconds: more than the ``stat`` of :meth:`exists`)."""
        return f"{self._root}/{self._shard(key)}/{key}"

    def _load_index(self) -> None:
        found = []
        for shard in self.root.iterdir() if self.root.is_dir() else ():
            if not shard.is_dir() or len(shard.name) != 2:
                continue
            for entry in shard.iterdir():
                if entry.name.startswith(_TEMP_PREFIX):
                    entry.unlink(missing_ok=True)  # a write that died half-way
                    continue
                try:
                    stat = entry.stat()
                    found.append((stat.st_mtime_ns, valid_key(entry.name), stat.st_size))
                except (OSError, ValueError):
                    continue
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size

    @property
    def nbytes(self) -> int:
        """Bytes of the entries this process knows of."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._index)

    # ---------------------------------------------------------------- operations

    def put(self, items: Sequence[tuple[str, bytes | bytearray]]) -> int:
        checked = [(valid_key(key), value) for key, value in items]
        written = 0
        for key, value in checked:
            size = len(value)
            if self._budget is not None and size > self._budget:
                self.stats.put_errors += 1
                continue
            if self._write(key, value):
                written += 1
                with self._lock:
                    old = self._index.pop(key, None)
                    self._bytes += size - (old or 0)
                    self._index[key] = size
                    self.stats.puts += 1
                    self.stats.put_bytes += size
                    victims = self._over_budget()
                self._remove_files(victims)
        return written

    def _write(self, key: str, value: bytes | bytearray) -> bool:
        shard = self._shard(key)
        directory = f"{self._root}/{shard}"
        with self._lock:
            self._serial += 1
            temp = f"{directory}/{_TEMP_PREFIX}{key}-{os.getpid()}-{self._serial}"
        try:
            if shard not in self._shards:
                os.makedirs(directory, exist_ok=True)
                self._shards.add(shard)
            with open(temp, "wb") as handle:
                handle.write(value)
                if self._fsync:
                    handle.flush()
                    os.fsync(handle.fileno())
            os.replace(temp, f"{directory}/{key}")
            return True
        except OSError:
            self.stats.put_errors += 1
            with contextlib.suppress(OSError):
                os.unlink(temp)
            return False

    def _over_budget(self) -> list[str]:
        victims = []
        while self._budget is not None and self._bytes > self._budget and self._index:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            victims.append(key)
        self.stats.evictions += len(victims)
        return victims

    def _remove_files(self, keys: list[str]) -> None:
        for key in keys:
            with contextlib.suppress(OSError):
                os.unlink(self._file(key))

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        checked = [valid_key(key) for key in keys]
        out: list[bytes | None] = []
        for key in checked:
            self.stats.gets += 1
            try:
                with open(self._file(key), "rb") as handle:
                    value = handle.read()
            except FileNotFoundError:
                value = None
                self._forget(key)
            except OSError:
                value = None
                self.stats.get_errors += 1
            if value is None:
                self.stats.misses += 1
            else:
                self._note_hit(key, len(value))
            out.append(value)
        return out

    def get_into(
        self, key: str, buffers: Sequence[Any], on_read: Callable[[list[memoryview]], object] | None = None
    ) -> int | None:
        """Read the entry under ``key`` straight into ``buffers``, in order; its length, or None for a miss.

        The entry's first ``min(length, sum of the buffers)`` bytes land in the buffers (``preadv``
        where the platform has it): no fresh memory, no second copy, e.g. ``[header, layer0[b], ...,
        layer{L-1}[b]]`` puts a block's KV straight into place. A length other than the buffers' total
        says the entry is short or long; the caller checks the bytes (:meth:`EntryFormat.check_read`).
        ``on_read``, if given, is called with each run of buffers (as byte views) as soon as they are full,
        in order, the reads going in runs of :data:`READ_RUN_BYTES`: a checksum taken there finds the
        bytes still in the CPU's cache (:class:`~kvblocks.tiers.entry.StreamedChecksum`). What it raises
        propagates.
        Counted as :meth:`get` counts one key; safe to call from several threads at once (the counters
        are kept under the lock), as :meth:`StorageTier.read_into` does.
        """
        valid_key(key)
        views = list(map(byte_view, buffers))
        try:
            fd = os.open(self._file(key), _O_READ)
        except FileNotFoundError:
            self._forget(key)
            self._note_miss(error=False)
            return None
        except OSError:
            self._note_miss(error=True)
            return None
        try:
            length = os.fstat(fd).st_size
            if on_read is None:
                _read_fully(fd, views)
            else:
                _read_in_runs(fd, views, on_read)
        except OSError:
            self._note_miss(error=True)
            return None
        finally:
            os.close(fd)
        self._note_hit(key, length, read=True)
        return length

    def _note_miss(self, *, error: bool) -> None:
        with self._lock:
            self.stats.gets += 1
            self.stats.misses += 1
            self.stats.get_errors += error

    def _note_hit(self, key: str, size: int, *, read: bool = False) -> None:
        """A hit on ``key`` (``read``: also count the read, as ``get_into`` does under the lock)."""
        with self._lock:
            self.stats.gets += read
            self.stats.hits += 1
            if key in self._index:
                self._index.move_to_end(key)
            else:  # written by another process sharing the directory
                self._index[key] = size
                self._bytes += size

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size

    def contains(self, keys: Sequence[str]) -> int:
        checked = [valid_key(key) for key in keys]
        count = 0
        for key in checked:
            if not os.path.isfile(self._file(key)):
                break
            count += 1
        return count

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [os.path.isfile(self._file(key)) for key in [valid_key(key) for key in keys]]

    def delete(self, keys: Sequence[str]) -> int:
        checked = [valid_key(key) for key in keys]
        removed = 0
        for key in checked:
            try:
                os.unlink(self._file(key))
                removed += 1
            except FileNotFoundError:
                pass
            except OSError:
                continue
            self._forget(key)
        self.stats.deletes += removed
        return removed

    def close(self) -> None:
        with self._lock:
            self._index.clear()
            self._bytes = 0
