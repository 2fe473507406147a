"""Speaking the field's formats: vLLM's and SGLang's KV events on the wire (msgpack over ZMQ).

Nothing here is imported by ``import kvblocks``: the wire codecs need ``msgspec`` and the transport
``pyzmq`` (``pip install "kvblocks[zmq]"``). The engines' block hash schemes live with kvblocks' own
in :mod:`kvblocks.hashing`.
"""
