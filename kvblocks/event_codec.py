"""The old path of :mod:`kvblocks.events.codec` (the event types, :class:`EventBatch` and its wire format).

Kept so that code importing ``kvblocks.event_codec`` goes on working; new code imports
:mod:`kvblocks.events` (or :mod:`kvblocks.events.codec` for the builders below the public names).
"""

from kvblocks.events.codec import (
    EVENT_FORMAT_VERSION,
    EVENT_GROUP_KINDS,
    MAX_BATCH_SEQ,
    NO_ARG,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    PendingEvent,
    are_token_ids,
    build_pending,
    decode_batch,
    encode_batch,
    is_event_group,
    is_group_tag,
    is_prefix_event,
    pending_args,
    range_parts,
    removed_event,
    stored_event,
    stored_range_event,
)

__all__ = [
    "EVENT_FORMAT_VERSION",
    "EVENT_GROUP_KINDS",
    "MAX_BATCH_SEQ",
    "NO_ARG",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEvent",
    "PendingEvent",
    "are_token_ids",
    "build_pending",
    "decode_batch",
    "encode_batch",
    "is_event_group",
    "is_group_tag",
    "is_prefix_event",
    "pending_args",
    "range_parts",
    "removed_event",
    "stored_event",
    "stored_range_event",
]
