"""Speaking the field's formats: vLLM's and SGLang's KV events on the wire (msgpack over ZMQ).

Nothing here is imported by ``import kvblocks``: the wire codecs need ``msgspec`` and the transport
``pyzmq`` (``pip install "kvblocks[zmq]"``). The engines' block hash schemes live with kvblocks' own
in :mod:`kvblocks.hashing`.

* :mod:`kvblocks.interop.engine_wire` -- one engine payload (msgpack ``KVEventBatch``) <-> kvblocks events,
  dialects ``"vllm"`` and ``"sglang"``.
* :mod:`kvblocks.interop.zmq_events` -- :class:`ZmqEventPublisher` (a kvblocks event transport that vLLM
  consumers read) and :class:`ZmqEventSubscriber` (an engine's stream into a kvblocks ``Router``, gaps filled
  through the engine's replay socket); the entry point of :mod:`~kvblocks.interop.zmq_publisher` and
  :mod:`~kvblocks.interop.zmq_subscriber`, where the two halves live.
"""
