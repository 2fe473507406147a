"""The host tier's bookkeeping: which block hashes host blocks hold, and their LRU.

Unlike the device tree this index is flat: a host block may hold a block whose
prefix lives on the device, so only *runs* matter, and ``run`` stops at the first
hash the host lacks. A host block is one of::

    fresh ──reserve──> pending (a copy into it is in flight; never matched)
                          │ complete(ok)           │ complete(failed)
                          v                        v
                       ready, idle  <──release──  fresh
                          │ acquire (a swap-in reads it: it cannot be evicted)
                          v
                       ready, in use

Eviction takes the least recently used idle ready block. The block ids index the
host cache tensors the engine (or :class:`~kvblocks.tiers.TransferExecutor`) owns.

With an event sink, the tier's changes become ``tier="host"`` events: a completed copy is a
``BlockStored``, an evicted entry a ``BlockRemoved``. They are noted as they happen and emitted,
in order and batched into runs of one kind, by :meth:`HostTier.publish`, which the manager calls
at the end of each call that changed the tier (so one write-back of many blocks is one event).
The index is flat, so a ``BlockStored`` here names a batch of hashes, not a chain, and its
``parent_hash`` is None (as vLLM's CPU offloading events do).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvblocks.core.eviction import DEFAULT_EVICTION
from kvblocks.core.pool import BlockPool
from kvblocks.errors import IntegrityError, InvalidArgumentError
from kvblocks.event_codec import AllBlocksCleared, BlockRemoved, BlockStored, is_group_tag
from kvblocks.events import EventSink, record_changes
from kvblocks.hashing import BlockHash
from kvblocks.tiers.protocol import SLOT

__all__ = ["HostTier"]


class HostTier:
    """``num_blocks`` host blocks: a pool (ref counts, fresh queue, idle blocks in ``eviction``'s order) plus a
    hash index.

    ``events`` receives this tier's events (see the module docstring), tagged ``group`` /
    ``group_kind`` as the device index of the same group tags its own (both None: untagged);
    ``block_size`` (tokens per block, None: not said) goes into its ``BlockStored`` events.
    """

    medium = SLOT

    def __init__(
        self,
        num_blocks: int,
        *,
        events: EventSink | None = None,
        group: int | None = None,
        group_kind: str | None = None,
        block_size: int | None = None,
        eviction: str = DEFAULT_EVICTION,
    ) -> None:
        if events is not None and not isinstance(events, EventSink):
            raise InvalidArgumentError(f"events must be an EventSink or None, got {type(events).__name__}")
        if not is_group_tag(group, group_kind):
            raise InvalidArgumentError(f"not an event group tag: {group!r}, {group_kind!r}")
        self.pool = BlockPool(num_blocks, eviction=eviction)
        self._block_of: dict[BlockHash, int] = {}  # ready blocks
        self._pending: dict[BlockHash, int] = {}  # blocks a copy is being written into
        self.num_evicted = 0
        self._events = events
        self.group = group
        self.group_kind = group_kind
        self.block_size = block_size
        # Changes not yet emitted, as runs of (stored?, hashes); None without a sink (nothing is noted).
        self._log: list[tuple[bool, list[BlockHash]]] | None = None if events is None else []

    @property
    def events(self) -> EventSink | None:
        """The sink this tier emits to (None: it emits nothing)."""
        return self._events

    def hashes(self) -> list[BlockHash]:
        """The hashes of the ready entries (what a lookup can find). Pure."""
        return list(self._block_of)

    def _note(self, stored: bool, block_hash: BlockHash) -> None:
        log: list[tuple[bool, list[BlockHash]]] = self._log  # type: ignore[assignment]  # called with a sink only
        if log and log[-1][0] is stored:
            log[-1][1].append(block_hash)
        else:
            log.append((stored, [block_hash]))

    def publish(self) -> None:
        """Emit the changes noted since the last call, in order, one event per run of one kind."""
        log = self._log
        if not log:
            return
        self._log = []
        sink: EventSink = self._events  # type: ignore[assignment]  # a log exists only with a sink
        record_changes(sink, log, "host", self.group, self.group_kind, self.block_size)

    def snapshot_events(self) -> list[BlockStored]:
        """The ready entries as one ``BlockStored`` (none when empty), tagged as this tier's events. Pure."""
        hashes = tuple(self._block_of)
        if not hashes:
            return []
        return [
            BlockStored(hashes, None, "host", group=self.group, group_kind=self.group_kind, block_size=self.block_size)
        ]

    def __len__(self) -> int:
        return len(self._block_of)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._block_of or block_hash in self._pending

    def holds(self, block_hash: BlockHash) -> bool:
        """Whether a ready block holds ``block_hash`` (a lookup may count it). Pure."""
        return block_hash in self._block_of

    def flush(self, timeout: float | None) -> bool:
        """Nothing is queued: the engine copies host blocks within the step's plan."""
        return True

    def close(self, timeout: float | None) -> None:
        """No thread to stop, nothing to release: the engine owns the host cache tensors."""

    def block_of(self, block_hash: BlockHash) -> int | None:
        """The ready host block holding ``block_hash`` (None while absent or pending)."""
        return self._block_of.get(block_hash)

    def run(self, hashes: Sequence[BlockHash], start: int, stop: int) -> list[int]:
        """Ready host blocks for ``hashes[start:stop]``, up to the first one the host lacks. Pure."""
        block_of = self._block_of
        out: list[int] = []
        for i in range(start, stop):
            b = block_of.get(hashes[i])
            if b is None:
                break
            out.append(b)
        return out

    def acquire(self, blocks: Iterable[int]) -> None:
        """Hold ready blocks (a swap-in reads them): they cannot be evicted until released."""
        self.pool._acquire_valid(blocks)

    def release(self, blocks: Iterable[int]) -> None:
        self.pool._release_valid(blocks)

    def touch(self, block_hash: BlockHash) -> None:
        """Mark a ready, idle entry most recently used (a device copy of it was just evicted)."""
        b = self._block_of.get(block_hash)
        pool = self.pool
        if b is not None and b in pool._idle:
            pool._policy.touch(b)

    def reserve(self, block_hash: BlockHash) -> tuple[int, BlockHash | None] | None:
        """A block to copy ``block_hash`` into, pending until :meth:`complete`; None when every block is held.

        Takes a fresh block, else evicts the idle block the pool's eviction policy chooses (LRU: the least
        recently used). Returns
        ``(block, evicted_hash)``: a lower tier may want the evicted content, which
        stays in the block until the copy into it runs.
        """
        if block_hash in self._block_of or block_hash in self._pending:
            raise InvalidArgumentError("the host tier already holds or is receiving this block")
        pool = self.pool  # package-private access, as the tree has: this runs once per written-back block
        evicted: BlockHash | None = None
        if pool._fresh:
            block = pool._fresh.popleft()
        elif pool._idle:
            (block,) = pool._policy.victims(1)
            evicted = pool._key[block]  # type: ignore[assignment]
            pool._key[block] = None
            del self._block_of[evicted]  # type: ignore[arg-type]
            self.num_evicted += 1
            if self._log is not None:
                self._note(False, evicted)  # type: ignore[arg-type]
        else:
            return None
        pool._ref[block] = 1
        self._pending[block_hash] = block
        return block, evicted

    def complete(self, block_hash: BlockHash, block: int, ok: bool) -> None:
        """The copy into a reserved block finished: it becomes a ready, idle entry -- or fresh again if it failed."""
        if self._pending.get(block_hash) != block:
            raise InvalidArgumentError(f"host block {block} is not pending for that hash")
        del self._pending[block_hash]
        if ok:
            self._block_of[block_hash] = block
            self.pool._key[block] = block_hash
            if self._log is not None:
                self._note(True, block_hash)
        self.pool._release_valid((block,))

    def clear(self) -> None:
        """Drop every idle ready entry (pending and held ones stay).

        With a sink: ``AllBlocksCleared`` when no ready entry is left, else a ``BlockRemoved`` of the
        dropped ones (after any changes still noted).
        """
        pool = self.pool
        dropped: list[BlockHash] = []
        for b in list(pool.idle_order()):
            block_hash: BlockHash = pool.content_key(b)  # type: ignore[assignment]
            del self._block_of[block_hash]
            pool.evict(b)
            dropped.append(block_hash)
        if self._log is None:
            return
        self.publish()
        sink: EventSink = self._events  # type: ignore[assignment]
        if not self._block_of:
            sink.emit(AllBlocksCleared("host", self.group, self.group_kind))
        elif dropped:
            sink.emit(BlockRemoved(tuple(dropped), "host", self.group, self.group_kind))

    def check_integrity(self) -> None:
        pool = self.pool
        pool.check_integrity()
        for h, b in self._block_of.items():
            if pool.content_key(b) != h:
                raise IntegrityError(f"host block {b} is indexed under a hash it does not hold")
        for b in self._pending.values():
            if pool.content_key(b) is not None or pool.ref_count(b) < 1:
                raise IntegrityError(f"pending host block {b} must be held and hold no content yet")
        cached = sum(1 for b in range(pool.num_blocks) if pool.content_key(b) is not None)
        if cached != len(self._block_of):
            raise IntegrityError(f"{cached} host blocks hold content but {len(self._block_of)} are indexed")
