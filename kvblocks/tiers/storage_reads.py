"""A storage tier's reads of its entries on the calling thread: fetch, check, and settle what was found.

:class:`EntryReader` is the part of :class:`~kvblocks.tiers.storage_tier.StorageTier` that reads: a batched
``get`` decoded into payloads (:meth:`EntryReader.read`, what the tier's reader thread and its
:meth:`~kvblocks.tiers.storage_tier.StorageTier.read` run), or entries read straight into the caller's
buffers (:meth:`EntryReader.read_into`, shared with a helper thread when big enough). Either way the
outcome is settled alike: the stats are counted, corrupt and misplaced entries deleted, and the hashes
that failed leave the tier's index.
"""

from __future__ import annotations

import itertools
import logging
import operator
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from kvblocks.errors import ConfigError, InvalidArgumentError
from kvblocks.hashing import BlockHash
from kvblocks.tiers.entry import HEADER, EntryFormat, StreamedChecksum
from kvblocks.tiers.storage import StorageBackend, byte_view
from kvblocks.tiers.storage_stats import LoadOutcome, StorageTierStats

__all__ = ["SHARED_READ_BYTES", "EntryReader"]

_log = logging.getLogger("kvblocks.tiers")
_Read = TypeVar("_Read")  # what a guarded read returns: a LoadOutcome, or a count of blocks read
_WRONG_KEY = "written under another key"
_READONLY = operator.attrgetter("readonly")
SHARED_READ_BYTES = 1 << 20
"""A :meth:`~kvblocks.tiers.storage_tier.StorageTier.read_into` of at least this many payload bytes (and more
than one block) shares its entries with a helper thread where the host has more than one core: reading a file
into place is a kernel copy, hashing it xxh3, and both release the GIL (vLLM's CPU layout, 2 MiB blocks, a 32 MiB step:
about 6.1 -> 3.9 ms with the second core free; about the same 6 ms with it busy, as the calling thread
takes whatever entries the helper has not)."""


def _scatter(payload: memoryview, views: list[memoryview]) -> None:
    """Copy ``payload`` across ``views`` in order (their lengths add up to the payload's)."""
    offset = 0
    for view in views:
        view[:] = payload[offset : offset + len(view)]
        offset += len(view)


class EntryReader:
    """Reads of one storage tier's entries, owned by the :class:`~kvblocks.tiers.storage_tier.StorageTier`.

    ``keys_of`` gives a block hash's keys (one per shard, ``shards`` of them), ``stats`` are the tier's
    counters, and ``forget`` drops hashes from the tier's index. ``shared_read_bytes``: :meth:`read_into`
    calls moving at least this many payload bytes share the work with a helper thread (None: never; see
    :data:`SHARED_READ_BYTES`); a host with one core never shares.
    """

    def __init__(
        self,
        backend: StorageBackend,
        entry_format: EntryFormat,
        keys_of: Callable[[BlockHash], list[str]],
        shards: int,
        stats: StorageTierStats,
        forget: Callable[[Sequence[BlockHash]], None],
        shared_read_bytes: int | None,
        cpu_count: int,
    ) -> None:
        if shared_read_bytes is not None and (
            isinstance(shared_read_bytes, bool) or not isinstance(shared_read_bytes, int) or shared_read_bytes < 0
        ):
            raise ConfigError(f"shared_read_bytes must be an int >= 0 or None, got {shared_read_bytes!r}")
        self._backend = backend
        self._format = entry_format
        self._keys_of = keys_of
        self._shards = shards
        self._stats = stats
        self._forget = forget
        self._shared_read_bytes = shared_read_bytes if cpu_count > 1 else None
        self._helper_pool: ThreadPoolExecutor | None = None  # started by the first shared read_into
        self._lock = threading.Lock()  # guards the helper's start and shutdown
        self._closed = False

    def read_or_miss(self, hashes: tuple[BlockHash, ...]) -> LoadOutcome:
        """:meth:`read`, where a backend that raises (a bug) makes every block a miss instead of an error."""
        return self._or_miss(lambda: self.read(hashes), len(hashes), LoadOutcome(()))

    def _or_miss(self, read: Callable[[], _Read], blocks: int, miss: _Read) -> _Read:
        """``read()``, or -- when the backend raises (a bug) -- ``miss``, its ``blocks`` counted as load errors."""
        try:
            return read()
        except Exception:
            _log.exception("storage read failed")
            self._stats.load_errors += blocks
            return miss

    def read(self, hashes: tuple[BlockHash, ...]) -> LoadOutcome:
        """One batched get; decode every shard; keep the leading run whose shards are all sound."""
        shards = self._shards
        keys = [key for h in hashes for key in self._keys_of(h)]
        values = self._backend.get(keys)
        decode = self._format.decode
        decoded = [decode(value, key) for value, key in zip(values, keys, strict=True)]
        usable = self._settle(hashes, keys, [reason for _, reason in decoded])
        run = [payload for payload, _ in decoded[: usable * shards] if payload is not None]  # all sound, by _settle
        return LoadOutcome(tuple(tuple(run[i * shards : (i + 1) * shards]) for i in range(usable)))

    def _settle(self, hashes: tuple[BlockHash, ...], keys: list[str], reasons: list[str]) -> int:
        """Count and clean up after a read whose shard ``keys[i]`` was found ``reasons[i]`` ("" sound);
        returns how many leading ``hashes`` have every shard sound.

        Corrupt entries and entries written under another key are deleted: the writer skips keys that
        exist, so they would block the rightful entry forever. A header naming another format version
        or spec is corrupt too: the key's format tag (:attr:`EntryFormat.tag`) names this format's
        header, so no sound entry of another format is ever stored under it -- a flipped version byte
        must not make a block unwritable. Hashes that failed leave the index.
        """
        shards = self._shards
        failed: list[BlockHash] = []
        corrupt: list[str] = []
        misplaced: list[str] = []
        absent = usable = 0
        for i, h in enumerate(hashes):
            sound = 0
            for j in range(shards):
                key, reason = keys[i * shards + j], reasons[i * shards + j]
                if not reason:
                    sound += 1
                elif reason == "absent":
                    absent += 1
                elif reason == _WRONG_KEY:
                    misplaced.append(key)
                else:
                    corrupt.append(key)
            if sound < shards:
                failed.append(h)
            elif not failed:
                usable += 1
        if corrupt or misplaced:
            _log.warning(
                "%d corrupt storage entries and %d written under another key removed", len(corrupt), len(misplaced)
            )
            self._backend.delete(corrupt + misplaced)
        if failed:
            self._forget(failed)
        stats = self._stats
        stats.loads_hit += usable
        stats.loads_missing += absent
        stats.loads_corrupt += len(corrupt)
        stats.loads_wrong_key += len(misplaced)
        stats.loads_beyond_a_miss += max(0, len(hashes) - usable - 1)
        return usable

    def read_into(self, hashes: Sequence[BlockHash], targets: Sequence[Sequence[Any]]) -> int:
        """:meth:`StorageTier.read_into`: checks the targets, counts the blocks requested, reads."""
        checked = tuple(hashes)
        parts = self._checked_targets(checked, targets)
        self._stats.loads_requested += len(checked)
        return self._or_miss(lambda: self._read_into(checked, parts), len(checked), 0)

    def _checked_targets(
        self, hashes: tuple[BlockHash, ...], targets: Sequence[Sequence[Any]]
    ) -> list[list[memoryview]]:
        if self._shards != 1:
            raise InvalidArgumentError(f"read_into reads one shard per block; this tier has {self._shards}")
        if len(targets) != len(hashes):
            raise InvalidArgumentError(f"{len(hashes)} blocks to read but {len(targets)} targets")
        length = self._format.payload_length
        out = []
        for target in targets:
            try:
                views = list(map(byte_view, target))
            except (TypeError, ValueError) as e:
                raise InvalidArgumentError(f"a read target must be contiguous buffers: {e}") from None
            if any(map(_READONLY, views)):
                raise InvalidArgumentError("a read target is read-only")
            if (size := sum(map(len, views))) != length:
                raise InvalidArgumentError(f"a read target holds {size} bytes, the format says {length}")
            out.append(views)
        return out

    def _read_into(self, hashes: tuple[BlockHash, ...], parts: list[list[memoryview]]) -> int:
        keys = [self._keys_of(h)[0] for h in hashes]
        get_into = getattr(self._backend, "get_into", None)
        if callable(get_into):
            reasons = self._each_shared(len(keys), lambda: self._entry_reader(get_into, keys, parts))
        else:
            reasons = []
            for key, value, views in zip(keys, self._backend.get(keys), parts, strict=True):
                payload, reason = self._format.decode(value, key)
                if payload is not None:
                    _scatter(payload, views)
                reasons.append(reason)
        return self._settle(hashes, keys, reasons)

    def _entry_reader(
        self, get_into: Callable[..., int | None], keys: list[str], parts: list[list[memoryview]]
    ) -> Callable[[int], str]:
        """One thread's reader of entry ``i`` into ``parts[i]``: why it is unsound ("" when sound) -- header,
        length, checksum and key checked (:meth:`EntryFormat.check_read`) once the read is in place, the
        checksum taken as the read lands (``get_into(key, buffers, on_read=...)``)."""
        header = bytearray(HEADER.size)  # one per thread
        checksum = StreamedChecksum()
        check = self._format.check_read

        def read(i: int) -> str:
            key, views = keys[i], parts[i]
            length = get_into(key, [header, *views], on_read=checksum.start())
            return check(header, length, views, key, checksum)

        return read

    def _each_shared(self, count: int, make: Callable[[], Callable[[int], str]]) -> list[str]:
        """``task(i)`` for every ``i < count``, ``task = make()`` made once per thread: the calling thread and,
        for a read big enough (:data:`SHARED_READ_BYTES`), the helper thread take the next ``i`` in turn.

        Returns only once both are done with every ``i`` -- the buffers are the caller's again -- and
        re-raises what either raised.
        """
        out = [""] * count
        turns = itertools.count()

        def work() -> None:
            task = make()
            while (i := next(turns)) < count:  # next() on a count is atomic: each i is taken once
                out[i] = task(i)

        limit = self._shared_read_bytes
        helper = None if limit is None or count < 2 or count * self._format.payload_length < limit else self._helper()
        future: Future[None] | None = None if helper is None else helper.submit(work)
        try:
            work()
        finally:
            if future is not None and not future.cancel():
                wait([future])
        if future is not None and not future.cancelled():
            future.result()
        return out

    def _helper(self) -> ThreadPoolExecutor | None:
        """The read helper thread's executor, started on first use; None once closed."""
        with self._lock:
            if self._helper_pool is None and not self._closed:
                self._helper_pool = ThreadPoolExecutor(1, thread_name_prefix="kvblocks-storage-read-helper")
            return self._helper_pool

    def close(self) -> None:
        """Stop the helper thread (if started); later reads run on the calling thread alone."""
        with self._lock:
            self._closed = True
            helper, self._helper_pool = self._helper_pool, None
        if helper is not None:
            helper.shutdown(wait=False)
