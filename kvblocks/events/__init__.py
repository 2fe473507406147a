"""KV events: what a cache tier stored, removed or cleared, numbered in emission order.

A :class:`kvblocks.core.prefix_tree.PrefixTree` emits one event per batch it changes (one
``BlockStored`` per insert call, one ``BlockRemoved`` per eviction call), carrying
block hashes -- the same keys a router or indexer uses. In a hybrid model's cache each
group emits its own events, tagged with the group's index and kind (``group``,
``group_kind``): the full-attention group's tree and each local group's
:class:`kvblocks.core.groups.block_index.FlatBlockIndex`. The groups share one key space, so
a consumer that tracks the prefix follows the ``"full"`` group (and untagged events)
only; a window group's removal of a hash says nothing about the full group's copy. An :class:`EventSink`
numbers them 0, 1, 2, ... and delivers them in process: to subscribers as they
happen and to a bounded buffer for polling. A consumer that sees a gap in the
numbers knows it missed events and must resynchronise.

Across processes and machines, events travel in :class:`EventBatch` es::

    manager -> EventSink -> EventPublisher --bytes--> transport --bytes--> pump -> EventConsumer
                              (numbers batches 0, 1, 2, ...          (detects gaps, asks for
                               per producer; encode_batch)            a resync, applies snapshots)

A cache records its events on its hot path with :meth:`EventSink.record` (a factory and its
arguments: the event is built only when read). An :class:`EventPublisher` drains a sink and sends
its records as batches numbered per producer -- when the engine calls :meth:`EventPublisher.publish`,
or every few milliseconds from a background thread after :meth:`EventPublisher.start`, which takes
building, batching and sending off the engine's thread; :meth:`EventPublisher.publish_snapshot`
sends the producer's whole tree (:meth:`kvblocks.core.prefix_tree.PrefixTree.snapshot_events`; for a hybrid
cache, followed by each local group's :meth:`~kvblocks.core.groups.block_index.FlatBlockIndex.snapshot_events`,
all tagged) as one batch that replaces what consumers knew of it. An :class:`EventConsumer` applies batches in order and
reports a missing number as a gap; it then ignores that producer's batches until a
snapshot arrives. Any loss -- a full sink buffer, a dropped message, a transport
that was down -- therefore shows as a gap, never as a silently wrong view.

The package, by layer (each module imports only those above it in this list):

* :mod:`kvblocks.events.codec` -- the event types, :class:`EventBatch` and the wire format
  (:func:`encode_batch`, :func:`decode_batch`): the layer both sides of a transport share;
* :mod:`kvblocks.events.transport` -- the transports (in process, Redis Streams) and
  :func:`~kvblocks.events.transport.pump`: batches and bytes, never sinks, publishers or consumers;
* :mod:`kvblocks.events.sink` -- :class:`EventRecord`, :class:`EventSink` and :func:`record_changes`;
* :mod:`kvblocks.events.publisher` -- :class:`EventPublisher`;
* :mod:`kvblocks.events.consumer` -- :class:`EventConsumer`.

Every name of ``__all__`` is importable from ``kvblocks.events`` itself, the usual place. The whole
package logs on the ``kvblocks.events`` logger.
"""

from kvblocks.events.codec import (
    EVENT_FORMAT_VERSION,
    EVENT_GROUP_KINDS,
    MAX_BATCH_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    decode_batch,
    encode_batch,
)
from kvblocks.events.consumer import EventConsumer
from kvblocks.events.publisher import EventPublisher
from kvblocks.events.sink import EventRecord, EventSink, record_changes

__all__ = [
    "EVENT_FORMAT_VERSION",
    "EVENT_GROUP_KINDS",
    "MAX_BATCH_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventConsumer",
    "EventPublisher",
    "EventRecord",
    "EventSink",
    "KVEvent",
    "decode_batch",
    "encode_batch",
    "record_changes",
]
