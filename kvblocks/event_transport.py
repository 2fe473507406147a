"""The old path of :mod:`kvblocks.events.transport` (the in-process and Redis Streams transports, and ``pump``).

Kept so that code importing ``kvblocks.event_transport`` goes on working; new code imports
:mod:`kvblocks.events.transport`.
"""

from kvblocks.events.transport import (
    BatchConsumer,
    EventTransport,
    InProcessTransport,
    RedisStreamTransport,
    pump,
    receive_timeout,
)

__all__ = ["BatchConsumer", "EventTransport", "InProcessTransport", "RedisStreamTransport", "pump", "receive_timeout"]
