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

Failures never raise: a write that fails (disk full, permission denied) is dropped, counted
(``stats.put_errors``) and logged on ``kvblocks.tiers`` (the first at once, then at most one line
per :data:`WARN_INTERVAL_S` with a count); a read that fails is a miss, counted. A directory that
cannot be written at all is refused when the storage opens (:class:`~kvblocks.errors.ConfigError`),
unless the process only looks up (``check_writable=False``).

Anyone who can write the directory is not trusted to make this process block or touch files outside
it: links are never followed under the root (an entry or shard that is a link is not used, and the
start-up scan never enters or deletes through one), entries are opened without blocking and used only
when they are regular files (a FIFO at an entry's path is a miss, not a reader stuck in ``open``).
Such odd entries are skipped and counted in ``stats.skipped_entries``, never fatal.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import itertools
import logging
import math
import os
import stat
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import xxhash

from kvblocks.errors import ConfigError, InvalidArgumentError
from kvblocks.tiers.entry import valid_key
from kvblocks.tiers.storage import StorageStats, byte_view

__all__ = ["FileStorage"]

_log = logging.getLogger("kvblocks.tiers")

_TEMP_PREFIX = ".tmp-"
_SHARDS = frozenset(f"{i:02x}" for i in range(256))
_PREADV = getattr(os, "preadv", None)
# No link followed at the entry's name; never blocks (a FIFO would, in open, until someone wrote to it).
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
_ODD_ERRNOS = frozenset({errno.ELOOP, errno.ENXIO})  # open's answer for a link (O_NOFOLLOW), a socket

WARN_INTERVAL_S = 60.0
"""Failed writes are logged at most once per this many seconds: the first at once, each later line with
the number of failures since the one before (a full disk fails every write: a line a minute, not thousands)."""
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


def _read_whole(fd: int, size: int) -> bytes:
    """The file's first ``size`` bytes (its size when opened; fewer if it ends sooner): one read, as a rule."""
    data = os.read(fd, size)
    if len(data) == size:
        return data
    parts = [data]
    got = len(data)
    while got < size:
        more = os.read(fd, size - got)  # short: a signal, or the kernel's per-call limit (2 GiB)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


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


def _is_key(name: str) -> bool:
    try:
        valid_key(name)
    except InvalidArgumentError:
        return False
    return True


class _Throttle:
    """When to log a recurring failure: the first at once, then at most one line per ``interval`` seconds."""

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._next = -math.inf
        self._since = 0  # failures since the last line
        self._lock = threading.Lock()

    def tick(self) -> int:
        """Count one failure; the failures to report in a line now (this one included), or 0: stay quiet."""
        now = time.monotonic()
        with self._lock:
            self._since += 1
            if now < self._next:
                return 0
            self._next = now + self._interval
            count, self._since = self._since, 0
            return count


class FileStorage:
    """Block entries as files under ``root`` (see the module docstring)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        byte_budget: int | None = None,
        fsync: bool = False,
        index_existing: bool = True,
        check_writable: bool = True,
    ) -> None:
        """``index_existing=False`` skips the start-up scan of the directory (and its clean-up of dead
        temporaries): for a process that only asks which entries exist (vLLM's scheduler side), whose
        index of sizes would never be used -- it never writes, so it never enforces ``byte_budget``.
        ``check_writable`` (default): refuse a directory this process cannot create files in with a
        :class:`ConfigError` naming it, rather than serve with every save failing; False for a process
        that never writes."""
        if byte_budget is not None and (
            isinstance(byte_budget, bool) or not isinstance(byte_budget, int) or byte_budget < 0
        ):
            raise ConfigError(f"byte_budget must be an int >= 0 or None, got {byte_budget!r}")
        for value, what in ((fsync, "fsync"), (index_existing, "index_existing"), (check_writable, "check_writable")):
            if not isinstance(value, bool):
                raise ConfigError(f"{what} must be a bool, got {value!r}")
        self.root = Path(root)
        self._root = os.fspath(self.root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"cannot use {self.root} as a storage directory: {error}") from error
        if check_writable:
            self._check_writable()
        self._budget = byte_budget
        self._fsync = fsync
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self._bytes = 0
        self._serial = 0
        self._shards: set[str] = set()  # shard directories known to exist, and to be directories, not links
        self._write_failures = _Throttle(WARN_INTERVAL_S)
        self.stats = StorageStats()
        if index_existing:
            self._load_index()

    def _check_writable(self) -> None:
        """Create (and remove) an empty file in the root: the one test a read-only mount, a directory of
        another owner and an ACL all answer truly (``os.access`` does not, for root or for ACLs)."""
        probe = f"{self._root}/{_TEMP_PREFIX}probe-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            with open(probe, "xb"):  # created, closed at once, removed: nothing to write
                pass
        except OSError as error:
            raise ConfigError(
                f"storage directory {self._root} is not writable ({error.strerror or error}): every save "
                "would fail; make it writable by this process or configure another path"
            ) from None
        with contextlib.suppress(OSError):
            os.unlink(probe)

    # ---------------------------------------------------------------- layout

    @staticmethod
    def _shard(key: str) -> str:
        return f"{xxhash.xxh3_64_intdigest(key.encode()) & 0xFF:02x}"

    def _file(self, key: str) -> str:
        """Where ``key``'s entry lives, as the string every call here hands the OS (a ``Path`` built per
        key costs several microseconds: more than the ``stat`` of :meth:`exists`)."""
        return f"{self._root}/{self._shard(key)}/{key}"

    def _entry_path(self, key: str) -> str:
        """:meth:`_file`, once its shard is known to be a directory of its own; raises ``FileNotFoundError``
        when the shard is missing and ``OSError(ELOOP)`` when it is something else -- a link to a directory
        elsewhere is never entered. A shard is looked at once; from then on it is known."""
        shard = self._shard(key)
        directory = f"{self._root}/{shard}"
        if shard not in self._shards:
            if not stat.S_ISDIR(os.lstat(directory).st_mode):
                raise OSError(errno.ELOOP, "the shard is not a directory of its own", directory)
            self._shards.add(shard)
        return f"{directory}/{key}"

    def _load_index(self) -> None:
        """Index the entries on disk, oldest first, and remove temporaries of writes that died half-way.

        Only real shard directories are entered and only regular files are indexed or removed, each
        found through its directory's descriptor: a shard or temporary replaced by a link, a directory
        named like a temporary, a FIFO, a socket -- skipped and counted, never followed, never fatal.
        """
        found: list[tuple[int, str, int]] = []
        skipped = 0
        try:
            root = os.open(self._root, _O_DIR & ~os.O_NOFOLLOW)  # the root itself is the caller's choice
        except OSError as error:
            raise ConfigError(f"cannot read the storage directory {self._root}: {error}") from None
        try:
            with os.scandir(root) as entries:
                for entry in entries:
                    if entry.name not in _SHARDS:
                        continue  # not kvblocks' (the directory may hold other things)
                    if entry.is_dir(follow_symlinks=False):
                        skipped += self._scan_shard(root, entry.name, found)
                    else:
                        skipped += 1
        except OSError as error:
            raise ConfigError(f"cannot read the storage directory {self._root}: {error}") from None
        finally:
            os.close(root)
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size
        self.stats.skipped_entries += skipped

    def _scan_shard(self, root: int, shard: str, found: list[tuple[int, str, int]]) -> int:
        """Add the shard's entries to ``found`` as ``(mtime, key, size)``; the odd entries it skipped."""
        try:
            fd = os.open(shard, _O_DIR, dir_fd=root)
        except OSError:  # became a link (or went away) since the scan: not entered
            return 1
        skipped = 0
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue  # removed meanwhile
                    name = entry.name
                    if not stat.S_ISREG(info.st_mode):
                        skipped += 1
                    elif name.startswith(_TEMP_PREFIX):
                        with contextlib.suppress(OSError):
                            os.unlink(name, dir_fd=fd)  # a write that died half-way
                    elif _is_key(name) and self._shard(name) == shard:
                        found.append((info.st_mtime_ns, name, info.st_size))
                    else:
                        skipped += 1  # not a key, or a key of another shard: never read here
            self._shards.add(shard)
        except OSError:
            skipped += 1
        finally:
            os.close(fd)
        return skipped

    @property
    def nbytes(self) -> int:
        """Bytes of the entries this process knows of."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._index)

    # ---------------------------------------------------------------- operations

    def put(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]]) -> int:
        checked = [(valid_key(key), value) for key, value in items]
        written = 0
        for key, value in checked:
            size = len(value)
            if self._budget is not None and size > self._budget:
                self._write_failed(key, f"{size} bytes, more than the byte_budget of {self._budget}")
                continue
            if self._write(key, value):
                written += 1
                with self._lock:
                    self._index_add(key, size)
                    self.stats.puts += 1
                    self.stats.put_bytes += size
                    victims = self._over_budget()
                self._remove_files(victims)
        return written

    def _write(self, key: str, value: bytes | bytearray | memoryview) -> bool:
        shard = self._shard(key)
        directory = f"{self._root}/{shard}"
        with self._lock:
            self._serial += 1
            temp = f"{directory}/{_TEMP_PREFIX}{key}-{os.getpid()}-{self._serial}"
        try:
            if shard not in self._shards:
                os.makedirs(directory, exist_ok=True)
                if not stat.S_ISDIR(os.lstat(directory).st_mode):  # a link to a directory elsewhere
                    raise OSError(errno.ELOOP, "the shard is a link, not a directory", directory)
                self._shards.add(shard)
            with open(temp, "xb") as handle:  # x: O_EXCL, so never through a link planted at the name
                handle.write(value)
                if self._fsync:
                    handle.flush()
                    os.fsync(handle.fileno())
            os.replace(temp, f"{directory}/{key}")
            return True
        except OSError as error:
            self._shards.discard(shard)  # looked at again next time (it may have been removed)
            with contextlib.suppress(OSError):
                os.unlink(temp)
            self._write_failed(key, error.strerror or str(error))
            return False

    def _write_failed(self, key: str, why: str) -> None:
        """Count a dropped write, and log it unless a line about failed writes went out in the last
        :data:`WARN_INTERVAL_S` (the count then rides on the next line)."""
        with self._lock:
            self.stats.put_errors += 1
        count = self._write_failures.tick()
        if count:
            _log.warning(
                "storage entry %s not written to %s (%s); %d failed write%s since the last warning: the "
                "entries are dropped (the cache serves without them); see stats.put_errors",
                key,
                self._root,
                why,
                count,
                "" if count == 1 else "s",
            )

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
                os.unlink(self._entry_path(key))

    def _open(self, key: str) -> tuple[int, int] | None:
        """A descriptor of ``key``'s entry and its size, if it is a regular file reached through no link;
        None (the miss counted) for anything else -- absent, unreadable, a link, a FIFO, a directory, a
        socket. The caller closes the descriptor."""
        try:
            fd = os.open(self._entry_path(key), _O_READ)
        except FileNotFoundError:
            self._forget(key)
            self._note_miss(error=False)
            return None
        except OSError as error:
            self._note_miss(error=True, odd=error.errno in _ODD_ERRNOS)
            return None
        try:
            info = os.fstat(fd)
        except OSError:
            os.close(fd)
            self._note_miss(error=True)
            return None
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            self._forget(key)
            self._note_miss(error=True, odd=True)
            return None
        return fd, info.st_size

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        checked = [valid_key(key) for key in keys]
        out: list[bytes | None] = []
        for key in checked:
            value = None
            opened = self._open(key)
            if opened is not None:
                fd, size = opened
                try:
                    value = _read_whole(fd, size)
                except OSError:
                    self._note_miss(error=True)
                finally:
                    os.close(fd)
            if value is not None:
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
        opened = self._open(key)
        if opened is None:
            return None
        fd, length = opened
        try:
            if on_read is None:
                _read_fully(fd, views)
            else:
                _read_in_runs(fd, views, on_read)
        except OSError:
            self._note_miss(error=True)
            return None
        finally:
            os.close(fd)
        self._note_hit(key, length)
        return length

    def _note_miss(self, *, error: bool, odd: bool = False) -> None:
        with self._lock:
            self.stats.gets += 1
            self.stats.misses += 1
            self.stats.get_errors += error
            self.stats.skipped_entries += odd

    def _note_hit(self, key: str, size: int) -> None:
        with self._lock:
            self.stats.gets += 1
            self.stats.hits += 1
            self._index_add(key, size, known=True)

    def _index_add(self, key: str, size: int, *, known: bool = False) -> None:
        """Index ``key`` as the most recently used (lock held). ``known``: a read's hit, which keeps the size
        already indexed. A key not indexed yet is indexed only if its file is there now: another thread may
        have deleted it since it was written or read, and its ``_forget`` came first -- indexing it after
        would count bytes no file holds (and put out a live entry early to stay under the budget). The
        lock orders this look against that delete's ``_forget``."""
        old = self._index.pop(key, None)
        if old is not None and known:
            size = old
        elif old is None and not self._is_entry(key):
            return
        self._bytes += size - (old or 0)
        self._index[key] = size

    def _is_entry(self, key: str) -> bool:
        """Whether ``key``'s entry is a regular file now (reached through no link)."""
        try:
            return stat.S_ISREG(os.lstat(self._entry_path(key)).st_mode)
        except OSError:
            return False

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size

    def contains(self, keys: Sequence[str]) -> int:
        checked = [valid_key(key) for key in keys]
        count = 0
        for key in checked:
            if not self._is_entry(key):
                break
            count += 1
        return count

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [self._is_entry(key) for key in [valid_key(key) for key in keys]]

    def delete(self, keys: Sequence[str]) -> int:
        checked = [valid_key(key) for key in keys]
        removed = 0
        for key in checked:
            try:
                os.unlink(self._entry_path(key))
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
