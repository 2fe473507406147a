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
Where the write knew its block's chain -- the parent's hash and the token ids, which the full-attention
group's prefix tree hands over when the tier emits events (:meth:`PrefixTree.keep_token_ids`) -- the
blocks of one batch are emitted as chains, as SGLang publishes host pages: each ``BlockStored`` a run of
blocks each extending the one before, with its first block's ``parent_hash`` and the run's token ids, so a
consumer can chain it onto what it knows::

    a write-back evicts h3, h2 (children first)   ->  BlockStored((h2, h3), parent_hash=h1, token_ids=...)

Blocks written without their chain (a local group's, whose index is flat) go out as one batch with
``parent_hash`` None (as vLLM's CPU offloading events do).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial

from kvblocks.core.eviction import DEFAULT_EVICTION
from kvblocks.core.pool import BlockPool
from kvblocks.errors import IntegrityError, InvalidArgumentError
from kvblocks.event_codec import AllBlocksCleared, BlockRemoved, BlockStored, is_group_tag, removed_event, stored_event
from kvblocks.events import EventSink
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
        # Each entry's chain where its write knew it: hash -> (parent hash, token ids as array('I') bytes).
        self._chains: dict[BlockHash, tuple[BlockHash | None, bytes | None]] | None = None if events is None else {}
        self._stored = partial(stored_event, "host", group, group_kind, block_size)  # what its events are built with
        self._removed = partial(removed_event, "host", group, group_kind)

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
        """Emit the changes noted since the last call, in order: each stored batch as its chains (see the module
        docstring), each removed one as one event."""
        log = self._log
        if not log:
            return
        self._log = []
        sink: EventSink = self._events  # type: ignore[assignment]  # a log exists only with a sink
        stored, removed = self._stored, self._removed
        for is_stored, hashes in log:
            if not is_stored:
                sink.record(removed, hashes)
                continue
            for run, parent, tokens in self._chained(hashes):
                sink.record(stored, run, parent, tokens, None)

    def _chained(self, hashes: Sequence[BlockHash]) -> list[tuple[list[BlockHash], BlockHash | None, bytes | None]]:
        """``hashes`` as runs of chained blocks, each with its first block's parent and the run's token ids (None
        unless every block's are known); the blocks of no known chain together, as one run without a parent."""
        chains = self._chains or {}
        loose: list[BlockHash] = []
        known: dict[BlockHash, tuple[BlockHash | None, bytes | None]] = {}
        for h in hashes:
            facts = chains.get(h)
            if facts is None:
                loose.append(h)
            else:
                known[h] = facts
        child_of: dict[BlockHash, BlockHash] = {}
        for h, (parent, _) in known.items():
            if parent is not None and parent in known and parent not in child_of:
                child_of[parent] = h
        chained = set(child_of.values())
        runs: list[tuple[list[BlockHash], BlockHash | None, bytes | None]] = []
        for h in known:
            if h in chained:
                continue  # reached from the start of its run
            run = [h]
            while run[-1] in child_of:
                run.append(child_of[run[-1]])
            parts = [known[b][1] for b in run]
            tokens = b"".join(parts) if all(p is not None for p in parts) else None  # type: ignore[arg-type]
            runs.append((run, known[h][0], tokens))
        if loose:
            runs.append((loose, None, None))
        return runs

    def snapshot_events(self) -> list[BlockStored]:
        """The ready entries as ``BlockStored`` events, chained where known (none when empty), tagged as this
        tier's events. Pure."""
        hashes = list(self._block_of)
        if not hashes:
            return []
        return [self._stored(run, parent, tokens, None) for run, parent, tokens in self._chained(hashes)]

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

    def reserve(
        self, block_hash: BlockHash, parent: BlockHash | None = None, tokens: bytes | None = None
    ) -> tuple[int, BlockHash | None] | None:
        """A block to copy ``block_hash`` into, pending until :meth:`complete`; None when every block is held.

        Takes a fresh block, else evicts the idle block the pool's eviction policy chooses (LRU: the least
        recently used). Returns
        ``(block, evicted_hash)``: a lower tier may want the evicted content, which
        stays in the block until the copy into it runs. ``parent`` / ``tokens`` (the block's chain) go into
        this tier's ``BlockStored`` when it emits events.
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
                self._chains.pop(evicted, None)  # type: ignore[union-attr, arg-type]
        else:
            return None
        pool._ref[block] = 1
        self._pending[block_hash] = block
        if self._chains is not None and (parent is not None or tokens is not None):
            self._chains[block_hash] = (parent, tokens)
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
        elif self._chains is not None:
            self._chains.pop(block_hash, None)
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
            if self._chains is not None:
                self._chains.pop(block_hash, None)
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
