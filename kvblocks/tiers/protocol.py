"""The tier protocol: what a group's :class:`~kvblocks.tiers.stack.TierStack` asks of every tier below the device.

A tier is one of two media, and the medium says how the step's plan moves its blocks::

    medium  example     holds                  into it                    out of it (to device)
    slot    HostTier    numbered blocks        swap-out  (device block)   swap-in  (plan, this step)
    keyed   StorageTier entries by block hash  save      (device/slot)    load     (off-thread read, polled)

Everything else is common (:class:`Tier`): whether it holds a block, its events, its integrity, and its
shutdown. A stack has at most one tier of each medium, slot above keyed; which tier fills each place is
configured by name (``TierConfig.kinds``) from the registry in :mod:`kvblocks.tiers.kinds`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvblocks.core.pool import BlockPool
    from kvblocks.event_codec import BlockStored
    from kvblocks.events import EventSink
    from kvblocks.hashing import BlockHash
    from kvblocks.tiers.storage_stats import LoadOutcome

__all__ = ["KEYED", "MEDIA", "SLOT", "KeyedTier", "SlotTier", "Tier"]

SLOT = "slot"
KEYED = "keyed"
MEDIA = (SLOT, KEYED)


@runtime_checkable
class Tier(Protocol):
    """What every tier answers, whatever its medium (:data:`SLOT` or :data:`KEYED`)."""

    @property
    def medium(self) -> str:
        """:data:`SLOT` or :data:`KEYED`: how the step's plan moves this tier's blocks."""

    @property
    def events(self) -> EventSink | None:
        """The sink this tier's own events go to (None: it emits none)."""

    def holds(self, key: BlockHash) -> bool:
        """Whether a lookup may count ``key`` as served by this tier now. Pure."""

    def publish(self) -> None:
        """Emit the changes noted since the last call (on the manager's thread)."""

    def snapshot_events(self) -> list[BlockStored]:
        """What the tier holds, as ``BlockStored`` events (a subscriber's resync). Pure."""

    def check_integrity(self) -> None:
        """Raise :class:`~kvblocks.errors.IntegrityError` if the tier's own bookkeeping disagrees. Pure."""

    def flush(self, timeout: float | None) -> bool:
        """Wait until queued writes are done (True if they are; a tier that queues nothing: True)."""

    def close(self, timeout: float | None) -> None:
        """Stop the tier's threads and release what it owns."""


@runtime_checkable
class SlotTier(Tier, Protocol):
    """A tier of numbered blocks, each a copy of one device block (host memory). Block ids index the tier's
    cache tensors; a block being copied into is pending (never matched) until :meth:`complete`."""

    pool: BlockPool
    """Ref counts and idle order of the tier's blocks (a held block cannot be evicted)."""
    num_evicted: int
    """Entries evicted to make room, so far."""

    def __len__(self) -> int:
        """Ready entries. Pure."""

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is ready or pending here (no second copy is planned). Pure."""

    def block_of(self, key: BlockHash) -> int | None:
        """The ready block holding ``key`` (None: absent or pending). Pure."""

    def run(self, hashes: Sequence[BlockHash], start: int, stop: int) -> list[int]:
        """Ready blocks of ``hashes[start:stop]`` up to the first one absent. Pure."""

    def touch(self, key: BlockHash) -> None:
        """Mark a ready, idle entry recently used (its device copy was just evicted)."""

    def reserve(
        self, key: BlockHash, parent: BlockHash | None = None, tokens: bytes | None = None
    ) -> tuple[int, BlockHash | None] | None:
        """A block to copy ``key`` into (and the key evicted to make room); None when every block is held.
        ``parent`` / ``tokens`` (the block's chain: its parent's hash, its token ids as ``array('I')`` bytes)
        are given, where known, to a tier that emits events, for its ``BlockStored``."""

    def complete(self, key: BlockHash, block: int, ok: bool) -> None:
        """The copy into a reserved block finished (``ok``) or failed."""

    def acquire(self, blocks: Iterable[int]) -> None:
        """Hold ready blocks a swap-in reads."""

    def release(self, blocks: Iterable[int]) -> None:
        """Let go of blocks :meth:`acquire` or :meth:`reserve` held."""

    def clear(self) -> None:
        """Drop every idle ready entry."""


@runtime_checkable
class KeyedTier(Tier, Protocol):
    """A tier addressed by block hash, read and written off the scheduler's thread (storage). Its hits come
    from what it is known to hold; a load is a request whose outcome :meth:`take_results` reports."""

    timeout_s: float
    """Longest wait for a load; a longer one is a miss."""

    @property
    def healthy(self) -> bool:
        """False while loads time out: no hits are reported meanwhile."""

    def is_known(self, key: BlockHash) -> bool:
        """Whether ``key`` is known held (a save of it is planned no more). Pure."""

    def known_run(self, hashes: Sequence[BlockHash], start: int, stop: int) -> int:
        """How many of ``hashes[start:stop]``, from ``start``, are known held. Pure."""

    def probe(self, hashes: Sequence[BlockHash]) -> int | None:
        """Ask (off-thread) which of ``hashes`` are held; a request id, or None when nothing is asked."""

    def is_answered(self, request: int) -> bool:
        """Whether a probe was answered."""

    def load(self, hashes: Sequence[BlockHash]) -> int:
        """Start reading ``hashes``; the request id :meth:`take_results` reports it under."""

    def cancel(self, request: int) -> None:
        """Forget a load: its outcome is never reported."""

    def take_results(self) -> list[tuple[int, LoadOutcome]]:
        """Loads finished since the last call, as (request, outcome). Never waits."""

    def note_timeout(self, num_blocks: int) -> None:
        """A load of ``num_blocks`` blocks timed out (the manager gave up on it)."""

    def check_payloads(self, hashes: Sequence[BlockHash], payloads: Sequence[object]) -> None:
        """Raise :class:`~kvblocks.errors.InvalidArgumentError` unless ``payloads`` can be saved as ``hashes``."""

    def save(self, hashes: Sequence[BlockHash], payloads: Sequence[object]) -> None:
        """Queue ``payloads`` to be written as ``hashes`` (checked by :meth:`check_payloads`)."""
