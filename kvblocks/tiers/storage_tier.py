"""The storage tier as the manager sees it: an index of stored hashes, and I/O on two threads.

The manager's scheduling calls never touch the backend. They read an in-memory index
of block hashes known to be stored, queue writes, and queue reads; a writer thread
and a reader thread do the I/O and hand results back through queues::

    scheduler thread                      I/O threads                   backend
    lookup ─── index (hashes known stored)
    save   ─── encode ─> AsyncWriter queue ─> writer thread ─ exists/put ─> ...
    load   ─── request ─> read queue       ─> reader thread ─ get/decode ─> ...
    poll   <── results queue <──────────────── payloads of the leading run

The index learns from successful writes, from probes (``probe``: are this prompt's
blocks stored by some other node?) and forgets hashes a read finds missing or corrupt.
It may be stale -- another node's budget evicted an entry -- which costs a miss, never
wrong KV: every entry is checked against its header, checksum and key when read.

With an event sink, the index's changes become ``tier="storage"`` events: a hash it learns is stored
(a write landed, a probe found it) is a ``BlockStored``, one it forgets (a read found it missing,
corrupt or under another key; the index's size bound dropped it) a
``BlockRemoved``. The I/O threads change the index, but an :class:`~kvblocks.events.EventSink` is
not thread-safe: each change is noted under the index's lock, in the order the index saw it, and
:meth:`StorageTier.publish` emits the notes from the thread that drives the manager (the manager
calls it in ``take_transfers``, ``complete_transfers`` and ``poll_loads``). A consumer's view thus
trails the index by at most a step, and replaying the notes in order gives exactly the index.

Keys carry the entry format's tag (:attr:`EntryFormat.tag`), so a node whose KV format differs
(a bfloat16 deployment beside a float16 one) neither finds nor skips writing the other's entries.

The reads themselves -- fetching, checking and settling entries, on the reader thread or the caller's -- are
:class:`~kvblocks.tiers.storage_reads.EntryReader`'s, which the tier owns; its counters and a read's outcome
are defined in :mod:`kvblocks.tiers.storage_stats` (and importable from here).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvblocks.errors import ConfigError, IntegrityError, InvalidArgumentError
from kvblocks.events import EventSink, record_changes
from kvblocks.events.codec import BlockStored, is_group_tag
from kvblocks.hashing import BlockHash, Namespace
from kvblocks.tiers.config import TierConfig
from kvblocks.tiers.entry import HEADER, EntryFormat, block_key, namespace_tag
from kvblocks.tiers.protocol import KEYED
from kvblocks.tiers.storage import StorageBackend
from kvblocks.tiers.storage_reads import SHARED_READ_BYTES, EntryReader
from kvblocks.tiers.storage_stats import LoadOutcome, StorageTierStats
from kvblocks.tiers.storage_stats import Payload as Payload  # importable from here, as before
from kvblocks.tiers.writer import AsyncWriter, EntryPool

__all__ = ["LoadOutcome", "StorageTier", "StorageTierStats"]

_log = logging.getLogger("kvblocks.tiers")
_MAX_QUEUED_PROBES = 256
ENTRY_POOL_BYTES = 256 << 20
"""Idle entry buffers a tier keeps for :meth:`StorageTier.save_built` (the most a pool holds unused)."""


@dataclass
class _Request:
    id: int
    hashes: tuple[BlockHash, ...]
    load: bool
    cancelled: bool = field(default=False)


class StorageTier:
    """Keys, index, writer and reader of one manager's storage tier (see the module docstring)."""

    medium = KEYED

    def __init__(
        self,
        config: TierConfig,
        namespace: Namespace,
        scheme: str,
        block_size: int,
        *,
        entry_format: EntryFormat | None = None,
        tag: str | None = None,
        owns_backend: bool = True,
        events: EventSink | None = None,
        group: int | None = None,
        group_kind: str | None = None,
        entry_pool_bytes: int = ENTRY_POOL_BYTES,
        writer_on_demand: bool = False,
        shared_read_bytes: int | None = SHARED_READ_BYTES,
    ) -> None:
        """``entry_format`` / ``tag`` (default: the config's format, the namespace's tag) let a hybrid
        manager's local group store under keys and a header of its own in the same backend; only the
        tier that ``owns_backend`` closes it. ``events`` receives the index's changes (see the module
        docstring), tagged ``group`` / ``group_kind``. ``entry_pool_bytes``: the most idle entry
        buffers :meth:`save_built` keeps for reuse (at least one buffer). ``writer_on_demand``: start the
        writer thread at the first save instead of now (a tier that may never save, e.g. vLLM's
        scheduler-side connector, then runs none). ``shared_read_bytes``: :meth:`read_into` calls moving at
        least this many payload bytes share the work with a helper thread (None: never; see
        :data:`~kvblocks.tiers.storage_reads.SHARED_READ_BYTES`)."""
        entry_format = entry_format if entry_format is not None else config.entry_format
        if config.storage is None or entry_format is None:
            raise ConfigError("StorageTier needs a TierConfig with storage and entry_format")
        if events is not None and not isinstance(events, EventSink):
            raise ConfigError(f"events must be an EventSink or None, got {type(events).__name__}")
        if not is_group_tag(group, group_kind):
            raise ConfigError(f"not an event group tag: {group!r}, {group_kind!r}")
        self._events = events
        self.group = group
        self.group_kind = group_kind
        self._block_size = block_size  # said in BlockStored events
        # Index changes not yet emitted, as runs of (stored?, hashes), guarded by _lock; None without a sink.
        self._log: list[tuple[bool, list[BlockHash]]] | None = None if events is None else []
        self.backend: StorageBackend = config.storage
        self.format: EntryFormat = entry_format
        self.timeout_s = float(config.storage_timeout_s)
        self._scheme = scheme
        self._tag = tag if tag is not None else namespace_tag(namespace, scheme, block_size)
        self._owns_backend = owns_backend
        self._ranks: tuple[int | None, ...] = config.ranks or (None,)
        self._index: OrderedDict[BlockHash, None] = OrderedDict()
        self._index_size = config.storage_index_size
        self._lock = threading.Lock()  # guards the index and the pending-save bookkeeping only
        self._saving: dict[str, BlockHash] = {}
        self._shards_stored: dict[BlockHash, int] = {}
        self.stats = StorageTierStats()
        self._healthy = True
        self._ids = itertools.count()
        self._requests: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._queued_probes = 0
        self._queued_loads: dict[int, _Request] = {}  # loads not yet started, for cancel()
        self._results: queue.SimpleQueue[tuple[int, LoadOutcome]] = queue.SimpleQueue()
        self._progress = threading.Condition()
        self._requested = 0  # reads queued (loads and probes) ...
        self._answered = 0  # ... and answered: equal when the reader is idle
        if isinstance(entry_pool_bytes, bool) or not isinstance(entry_pool_bytes, int) or entry_pool_bytes < 0:
            raise ConfigError(f"entry_pool_bytes must be an int >= 0, got {entry_pool_bytes!r}")
        self.entry_pool = EntryPool(entry_format.entry_length, max(1, entry_pool_bytes // entry_format.entry_length))
        self._max_pending_writes = config.max_pending_writes
        self._writer: AsyncWriter | None = None  # started by the first save (see ``writer``)
        self._writer_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_loop, name="kvblocks-storage-reader", daemon=True)
        self._reader.start()
        self._reads = EntryReader(
            self.backend,
            entry_format,
            self.keys_of,
            len(self._ranks),
            self.stats,
            self._forget,
            shared_read_bytes,
            os.cpu_count() or 1,
        )
        self._closed = False
        if not writer_on_demand:
            _ = self.writer

    @property
    def writer(self) -> AsyncWriter:
        """The background writer (started with the tier, or on first use with ``writer_on_demand``); after
        :meth:`close`, a closed one."""
        writer = self._writer
        if writer is None:
            with self._writer_lock:
                if self._writer is None:
                    made = AsyncWriter(self.backend, max_pending=self._max_pending_writes, on_stored=self._on_stored)
                    if self._closed:  # nothing queued: its thread stops at once, and is joined
                        made.close(None)
                    self._writer = made
                writer = self._writer
        return writer

    @property
    def num_shards(self) -> int:
        return len(self._ranks)

    @property
    def healthy(self) -> bool:
        """False from a read timeout until the reader answers a request again; no storage hits meanwhile."""
        return self._healthy

    def keys_of(self, block_hash: BlockHash) -> list[str]:
        tag, scheme, fmt = self._tag, self._scheme, self.format.tag
        return [block_key(tag, scheme, block_hash, rank, format_tag=fmt) for rank in self._ranks]

    # ------------------------------------------------------------------ index (scheduler thread)

    def known_run(self, hashes: Sequence[BlockHash], start: int, stop: int) -> int:
        """How many of ``hashes[start:stop]``, from ``start``, are known stored. No I/O."""
        if not self._healthy or not self._index:
            return 0
        index = self._index
        n = 0
        with self._lock:
            for i in range(start, stop):
                if hashes[i] not in index:
                    break
                n += 1
        return n

    def holds(self, block_hash: BlockHash) -> bool:
        """Whether a lookup may count ``block_hash`` as stored: known stored, and reads are answered. Pure."""
        return self._healthy and block_hash in self._index

    def check_integrity(self) -> None:
        """The index of known-stored hashes stays within ``storage_index_size``."""
        if len(self._index) > self._index_size:
            raise IntegrityError(f"storage index holds {len(self._index)} hashes, more than {self._index_size}")

    def is_known(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def _remember(self, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            index = self._index
            noting = self._log is not None
            for h in hashes:
                if noting and h not in index:
                    self._note(True, h)
                index[h] = None
                index.move_to_end(h)
            while len(index) > self._index_size:
                dropped, _ = index.popitem(last=False)
                if noting:
                    self._note(False, dropped)

    def forget(self, hashes: Sequence[BlockHash]) -> None:
        """Stop reporting ``hashes`` as stored: a reader elsewhere (another process's tier) found their
        entries missing or unusable. A later probe or write may learn them again."""
        self._forget(hashes)

    def _forget(self, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            index = self._index
            noting = self._log is not None
            for h in hashes:
                if h in index:
                    del index[h]
                    if noting:
                        self._note(False, h)

    # ------------------------------------------------------------------ events

    @property
    def events(self) -> EventSink | None:
        """The sink this tier emits to (None: it emits nothing)."""
        return self._events

    def _note(self, stored: bool, block_hash: BlockHash) -> None:
        """Record an index change (any thread, under ``_lock``; only with a sink)."""
        log: list[tuple[bool, list[BlockHash]]] = self._log  # type: ignore[assignment]
        if log and log[-1][0] is stored:
            log[-1][1].append(block_hash)
        else:
            log.append((stored, [block_hash]))

    def publish(self) -> None:
        """Emit the index changes noted since the last call, in order (one event per run of one kind).

        Call it only from the thread that drives the manager: the sink is not thread-safe.
        """
        if not self._log:  # None (no sink) or empty; a note racing this read is emitted next time
            return
        with self._lock:
            log, self._log = self._log, []
        sink: EventSink = self._events  # type: ignore[assignment]  # a log exists only with a sink
        record_changes(sink, log, "storage", self.group, self.group_kind, self._block_size)

    def known_hashes(self) -> list[BlockHash]:
        """The hashes known stored now, least recently learned first (a copy; any thread)."""
        with self._lock:
            return list(self._index)

    def snapshot_events(self) -> list[BlockStored]:
        """The index as one ``BlockStored`` (none when empty), tagged as this tier's events.

        Notes not yet published are left for :meth:`publish`: replayed after the snapshot they change
        nothing (each hash ends as its last note says, which is what the snapshot holds)."""
        hashes = tuple(self.known_hashes())
        if not hashes:
            return []
        return [
            BlockStored(
                hashes, None, "storage", group=self.group, group_kind=self.group_kind, block_size=self._block_size
            )
        ]

    # ------------------------------------------------------------------ writes

    def check_payloads(self, hashes: Sequence[BlockHash], payloads: Sequence[object]) -> None:
        """Raise :class:`InvalidArgumentError` where :meth:`save` would refuse these payloads. Copies nothing.

        Lets a caller that saves for several tiers at once refuse before any of them queued a write.
        """
        shards = len(self._ranks)
        if len(payloads) != len(hashes):
            raise InvalidArgumentError(f"{len(hashes)} blocks to save but {len(payloads)} payloads")
        length = self.format.payload_length
        for payload in payloads:
            try:
                parts: tuple[Any, ...] = (payload,) if shards == 1 else tuple(payload)  # type: ignore[arg-type]
            except TypeError:
                raise InvalidArgumentError(f"expected one payload per rank ({shards})") from None
            if len(parts) != shards:
                raise InvalidArgumentError(f"expected one payload per rank ({shards}), got {len(parts)}")
            for part in parts:
                try:
                    size = memoryview(part).cast("B").nbytes
                except (TypeError, ValueError) as e:
                    raise InvalidArgumentError(f"payload of a block to save: {e}") from None
                if size != length:
                    raise InvalidArgumentError(f"payload of a block to save is {size} bytes, the format says {length}")

    def save(self, hashes: Sequence[BlockHash], payloads: Sequence[object]) -> None:
        """Queue entries for ``hashes``: each payload is the block's bytes, or one per rank.

        Every payload is encoded (and its length checked) before anything is queued, so a
        wrong payload raises and queues nothing.
        """
        shards = len(self._ranks)
        if len(payloads) != len(hashes):
            raise InvalidArgumentError(f"{len(hashes)} blocks to save but {len(payloads)} payloads")
        encode = self.format.encode
        items: list[tuple[str, bytes]] = []
        owners: list[BlockHash] = []
        for h, payload in zip(hashes, payloads, strict=True):
            parts: tuple[Any, ...] = (payload,) if shards == 1 else tuple(payload)  # type: ignore[arg-type]
            if len(parts) != shards:
                raise InvalidArgumentError(f"expected one payload per rank ({shards}), got {len(parts)}")
            for key, part in zip(self.keys_of(h), parts, strict=True):
                try:
                    items.append((key, encode(part, key)))
                except (TypeError, ValueError) as e:
                    raise InvalidArgumentError(f"payload of a block to save: {e}") from None
                owners.append(h)
        with self._lock:
            for (key, _), h in zip(items, owners, strict=True):
                self._saving[key] = h
        self.stats.saves_queued += len(hashes)
        self.writer.submit(items)

    def save_built(self, hashes: Sequence[BlockHash], fill: Callable[[int, memoryview], None]) -> None:
        """Queue entries for ``hashes``, each built in place: ``fill(i, payload)`` writes block ``i``'s payload.

        ``payload`` is the part of a pooled entry buffer after its header (exactly the format's payload
        length): ``fill`` copies the block straight there (e.g. from the KV tensors), the header and
        checksum are written in front of it, and the buffer goes to the writer without another copy --
        queued at once, so the writer thread puts one entry while the next is being filled. The writer
        hands each buffer back to :attr:`entry_pool` once its entry is written, skipped or dropped. What
        ``fill`` raises propagates; the entries already queued stay queued. One shard per block only.
        """
        if len(self._ranks) != 1:
            raise InvalidArgumentError(f"save_built builds one shard per block; this tier has {len(self._ranks)}")
        pool, encode_into = self.entry_pool, self.format.encode_into
        for i, h in enumerate(hashes):
            (key,) = self.keys_of(h)
            entry = pool.take()
            try:
                with memoryview(entry) as view:
                    fill(i, view[HEADER.size :])
                    encode_into(view, key)
            except BaseException:
                pool.give(entry)
                raise
            with self._lock:
                self._saving[key] = h
            self.stats.saves_queued += 1
            self.writer.submit([(key, entry)], pool=pool)

    def _on_stored(self, keys: list[str]) -> None:
        """Writer thread: entries are stored; a hash is known once every rank's shard is."""
        done: list[BlockHash] = []
        shards = len(self._ranks)
        with self._lock:
            for key in keys:
                h = self._saving.pop(key, None)
                if h is None:
                    continue
                count = self._shards_stored.get(h, 0) + 1
                if count == shards:
                    self._shards_stored.pop(h, None)
                    done.append(h)
                else:
                    self._shards_stored[h] = count
        if done:
            self._remember(done)

    # ------------------------------------------------------------------ reads

    def probe(self, hashes: Sequence[BlockHash]) -> int | None:
        """Ask, off-thread, which leading ``hashes`` are stored; the answer feeds the index.

        Returns the request's id for :meth:`is_answered`, or None when the probe queue was full
        (the probe is dropped and counted).
        """
        with self._lock:
            if self._queued_probes >= _MAX_QUEUED_PROBES:
                self.stats.probes_dropped += 1
                return None
            self._queued_probes += 1
        self.stats.probes += 1
        self._requested += 1
        request = _Request(next(self._ids), tuple(hashes), load=False)
        self._requests.put(request)
        return request.id

    def is_answered(self, request_id: int) -> bool:
        """Whether the reader has answered request ``request_id`` (it answers in the order asked)."""
        return self._answered > request_id

    def load(self, hashes: Sequence[BlockHash]) -> int:
        """Queue a read of ``hashes``' entries; returns a request id for :meth:`take_results`."""
        request = _Request(next(self._ids), tuple(hashes), load=True)
        self.stats.loads_requested += len(hashes)
        self._requested += 1
        self._queued_loads[request.id] = request
        self._requests.put(request)
        return request.id

    def read(self, hashes: Sequence[BlockHash]) -> LoadOutcome:
        """Read ``hashes``' entries on the calling thread and return the payloads of their sound leading run.

        What :meth:`load` does on the reader thread, for a caller that must have the blocks before it goes
        on (a vLLM worker loading before its forward pass). The same checks, stats and index updates apply;
        a backend that raises makes every block a miss (counted in ``load_errors``).
        """
        checked = tuple(hashes)
        self.stats.loads_requested += len(checked)
        return self._reads.read_or_miss(checked)

    def cancel(self, request_id: int) -> None:
        """The caller no longer wants a queued read: the reader skips it if it has not started it."""
        request = self._queued_loads.pop(request_id, None)
        if request is not None:
            request.cancelled = True
            self.stats.loads_cancelled += len(request.hashes)

    def take_results(self) -> list[tuple[int, LoadOutcome]]:
        """Finished reads, without waiting."""
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def note_timeout(self, num_blocks: int) -> None:
        """A read outlived its deadline: count it; report no storage hits until the backend answers."""
        self.stats.load_timeouts += num_blocks
        self._healthy = False

    def _read_loop(self) -> None:
        while True:
            request = self._requests.get()
            if request is None:
                return
            if request.load:
                self._queued_loads.pop(request.id, None)
                if not request.cancelled:  # a freed or timed-out admission's read is not worth doing
                    self._results.put((request.id, self._reads.read_or_miss(request.hashes)))
            else:
                with self._lock:
                    self._queued_probes -= 1
                try:
                    self._probe(request.hashes)
                except Exception:  # a backend bug must not kill the reader: the probe finds nothing
                    _log.exception("storage read failed")
            self._healthy = True
            with self._progress:
                self._answered += 1
                self._progress.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every read queued so far was answered (tests, shutdown). False on timeout."""
        target = self._requested
        with self._progress:
            return self._progress.wait_for(lambda: self._answered >= target, timeout)

    # ------------------------------------------------------------------ reads into place

    def read_into(self, hashes: Sequence[BlockHash], targets: Sequence[Sequence[Any]]) -> int:
        """Read ``hashes``' entries straight into ``targets`` on the calling thread; how many leading blocks
        arrived sound.

        ``targets[i]`` are the writable buffers block ``i``'s payload goes into, in order, together
        exactly the payload's length (e.g. each layer's view of one KV block). With a backend that reads
        into place (``FileStorage.get_into(key, buffers, on_read)``) the bytes go straight there and are
        checked: header, checksum (taken as the read lands, while the bytes are in cache), key. Otherwise
        (Redis) each entry is read and decoded as :meth:`read` does, and copied. The checks, stats and index
        updates are :meth:`read`'s, and a backend that raises makes every block a miss (counted in
        ``load_errors``).

        Only the returned leading run holds sound KV: a buffer past it may hold anything -- part of an
        entry, a corrupt one -- so its block must be recomputed (vLLM: reported as a load error). A tier
        with several shards per block cannot read into place (:class:`InvalidArgumentError`).
        """
        return self._reads.read_into(hashes, targets)

    def _probe(self, hashes: tuple[BlockHash, ...]) -> None:
        with self._lock:
            unknown = [h for h in hashes if h not in self._index]
        if not unknown:
            return
        shards = len(self._ranks)
        present = self.backend.exists([key for h in unknown for key in self.keys_of(h)])
        found = []
        for i, h in enumerate(unknown):
            if all(present[i * shards : (i + 1) * shards]):
                found.append(h)
        self._remember(found)

    # ------------------------------------------------------------------ shutdown

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued writes (shutdown, tests)."""
        writer = self._writer
        return True if writer is None else writer.flush(timeout)

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop both threads (queued writes get ``timeout`` seconds) and close the backend if this tier owns it."""
        if self._closed:
            return
        self._closed = True
        self._reads.close()  # no read helper from now on
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._writer_lock:
            writer = self._writer
        if writer is not None:
            writer.close(timeout)
        self._requests.put(None)
        self._reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self._owns_backend:
            self.backend.close()
