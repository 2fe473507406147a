"""KV events over ZMQ in vLLM's wire format, both ways: publish a kvblocks manager's events to vLLM consumers
(llm-d's indexer, Dynamo's router), and feed a vLLM or SGLang engine's events to a kvblocks :class:`Router`.

The wire, as vLLM's and SGLang's ``ZmqEventPublisher`` speak it:

* a PUB socket sends one multipart message per batch: ``(topic, seq as 8 bytes big-endian, payload)``, the
  payload a msgpack ``KVEventBatch`` (:mod:`kvblocks.interop.engine_wire`);
* a ROUTER socket answers a replay request ``(identity, b"", start_seq as 8 bytes big-endian)`` with
  ``(identity, b"", topic, seq, payload)`` for every buffered batch numbered ``>= start_seq``, then the end
  marker ``(identity, b"", b"", -1 as 8 signed bytes, b"")``. (vLLM <= 0.11 left the topic frame out; the
  subscriber reads both.)

Publishing::

    pub = ZmqEventPublisher("tcp://*:5557", "tcp://*:5558", topic="kv@worker-3")
    publisher = EventPublisher("worker-3", manager.events, pub, snapshot=manager.snapshot_events)
    publisher.publish()  # each engine step: batches leave with their kvblocks seq as the wire seq

:class:`ZmqEventPublisher` has ``send_batch``, so :class:`~kvblocks.events.EventPublisher` hands it the numbered
:class:`EventBatch`; the wire seq is the batch's seq, so a batch the publisher skipped is a gap on the wire too.
The engine thread only appends the batch to a bounded queue; a background thread owns both sockets, encodes,
sends, keeps the last ``buffer_steps`` payloads and answers replay requests (every 5 ms at most while idle).
With ``publisher.start()`` that thread also runs the publisher's rounds (:meth:`ZmqEventPublisher.run_periodically`):
the engine thread then only records its events; this thread takes them unbuilt (``send_pending``) and writes
the payload straight from the sink's entries (:func:`kvblocks.interop.fast_wire.encode_pending_events`: the
same bytes as :func:`~kvblocks.interop.engine_wire.encode_engine_events`, in less than half its CPU time,
which on a small machine is taken from the engine's thread).
Nothing raises into the engine: a full queue or a failed send is counted (``dropped``, ``errors``).

Consuming::

    sub = ZmqEventSubscriber("tcp://engine-3:5557", "tcp://engine-3:5558", worker="engine-3", dialect="vllm")
    consumer = EventConsumer(on_events=router.apply_events, on_snapshot=router.replace_index)
    pump_subscriber(sub, consumer, timeout_s=0.1)  # in the router's loop

:meth:`ZmqEventSubscriber.receive` returns kvblocks batches numbered with the wire seq. On a gap (a seq that is
not the last + 1, or a first message that is not seq 0: a late joiner) it asks the replay socket for the
missing batches and delivers them in order, dropping the ones it already had. A subscriber that has nothing
yet and finds no live message waiting asks for everything from seq 0 at once (the *join*): a router that
joins an idle engine learns what the engine still buffers without waiting for its next batch; an engine
that never published answers with the end marker alone, and the subscriber waits for seq 0 live. When the
replay cannot fill the gap (the engine's buffer no longer reaches back, no replay socket, no answer in
``replay_timeout_s``), it delivers the first batch it does have as a *snapshot*: the router forgets what it
knew of that worker and starts again from there -- it promises less than the worker holds, never more. A
payload that does not decode is counted and handled the same way; an engine that restarts (seq 0 again)
resets the worker too.

The router's loop is never held up for long: one ``receive`` waits at most its ``timeout_s`` plus one
replay (``replay_timeout_s``); a second gap in the same call waits for the next call. A replay socket that
does not answer is not asked again for ``replay_backoff_s``, doubling at each further silence up to
``replay_backoff_max_s``; meanwhile a gap resets the worker at once, without waiting.

Both classes need ``pyzmq`` and ``msgspec`` (``pip install "kvblocks[zmq]"``), imported when one is created.

The module is the entry point; the code lives in :mod:`kvblocks.interop.zmq_publisher` (:class:`ZmqEventPublisher`,
the wire's frames, :func:`require_zmq`) and :mod:`kvblocks.interop.zmq_subscriber` (:class:`ZmqEventSubscriber`,
:func:`pump_subscriber`). Both log on the ``kvblocks.events`` logger.
"""

from kvblocks.interop.zmq_publisher import END_SEQ, ZmqEventPublisher, require_zmq
from kvblocks.interop.zmq_subscriber import ZmqEventSubscriber, pump_subscriber

__all__ = ["END_SEQ", "ZmqEventPublisher", "ZmqEventSubscriber", "pump_subscriber", "require_zmq"]
