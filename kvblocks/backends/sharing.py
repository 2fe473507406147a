"""Publishing KV caches under a name, and attaching to them from a runner.

In one process a :class:`CacheRegistry` does it: ``publish`` stores the caches and wakes
every waiter; ``attach`` blocks on a condition variable (no spinning) until they are there
or the timeout passes.

Across processes, :func:`publish_shared` puts the caches where another process can map
them -- host caches in POSIX shared memory (zero copy: the tensors *are* the shared
pages), CUDA caches behind CUDA IPC handles -- and a small named mailbox describes them::

    mailbox "kvblocks-<name>":  magic | version | state (0 writing, 1 ready) | length | JSON

:func:`attach_shared` opens the mailbox by name, sleeping between looks with a growing
back-off (never a busy loop), and maps the caches once the state says ready. A creator
that only profiles never publishes, so nobody can attach to a throwaway cache.
"""

from __future__ import annotations

import base64
import contextlib
import json
import mmap
import os
import pickle
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from multiprocessing import shared_memory
from typing import Any

import torch

from kvblocks.backends.cache import KVCache, build_cache
from kvblocks.backends.spec import KVCacheSpec
from kvblocks.errors import AttachTimeoutError, ConfigError

__all__ = ["CacheRegistry", "SharedCaches", "attach_shared", "publish_shared"]

_MAGIC = b"KVBLOCKS"
_VERSION = 1
_HEADER = struct.Struct("<8sII I")  # magic, version, state, JSON length
_MAILBOX_BYTES = 1 << 20
_DATA_ALIGN = 4096
_READY = 1


class CacheRegistry:
    """In-process publication: caches by name, with waiting attachers woken on publish."""

    def __init__(self) -> None:
        self._caches: dict[str, tuple[KVCache, ...]] = {}
        self._changed = threading.Condition()

    def publish(self, name: str, caches: KVCache | Sequence[KVCache]) -> None:
        group = (caches,) if isinstance(caches, KVCache) else tuple(caches)
        if not group or not all(isinstance(c, KVCache) for c in group):
            raise ConfigError("publish needs one KVCache or a non-empty sequence of them")
        with self._changed:
            if name in self._caches:
                raise ConfigError(f"caches are already published under {name!r}")
            self._caches[name] = group
            self._changed.notify_all()

    def attach(self, name: str, *, timeout: float) -> tuple[KVCache, ...]:
        """The caches published under ``name``, waiting up to ``timeout`` seconds for them."""
        with self._changed:
            if not self._changed.wait_for(lambda: name in self._caches, timeout=timeout):
                raise AttachTimeoutError(f"no KV caches were published under {name!r} within {timeout} s")
            return self._caches[name]

    def withdraw(self, name: str) -> None:
        with self._changed:
            self._caches.pop(name, None)


def _mailbox_name(name: str) -> str:
    if not name or not all(c.isalnum() or c in "-_" for c in name) or len(name) > 200:
        raise ConfigError(f"a shared cache name must be 1-200 letters, digits, '-' or '_', got {name!r}")
    return f"kvblocks-{name}"


def _data_name(name: str, index: int) -> str:
    return f"{_mailbox_name(name)}-{index}"


def _buffer(shm: shared_memory.SharedMemory) -> memoryview:
    buf = shm.buf
    if buf is None:  # pragma: no cover - only after close()
        raise ConfigError(f"shared memory {shm.name!r} is closed")
    return buf


class _Mapping:
    """An existing POSIX shared-memory segment mapped read-write, *without* a resource tracker.

    ``SharedMemory(name)`` would register the segment with this process's resource tracker
    (before Python 3.13), which unlinks it when the process exits -- destroying the owner's
    caches -- or, when the tracker is shared with the owner, drops the owner's registration.
    An attacher therefore maps the segment itself.
    """

    def __init__(self, name: str) -> None:
        import _posixshmem  # type: ignore[import-not-found]  # what SharedMemory itself uses on POSIX

        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)
        self.name = name

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()

    def unlink(self) -> None:  # only owners unlink
        raise AssertionError("an attacher never unlinks")  # pragma: no cover


class SharedCaches:
    """Caches published across processes, and the resources keeping them alive.

    The owner keeps this object (the segments live as long as it does and are unlinked by
    :meth:`close`); an attacher gets one too and closes it without unlinking.
    """

    def __init__(self, caches: tuple[KVCache, ...], segments: list[Any], owner: bool) -> None:
        self.caches = caches
        self._segments = segments
        self._owner = owner

    def close(self) -> None:
        """Drop this process's mappings (and, for the owner, the segments themselves)."""
        self.caches = ()
        segments, self._segments = self._segments, []
        for shm in segments:
            with contextlib.suppress(BufferError):  # a tensor view still maps it; it goes with the process
                shm.close()
            if self._owner:
                with contextlib.suppress(FileNotFoundError):
                    shm.unlink()

    def __enter__(self) -> SharedCaches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _describe(cache: KVCache) -> dict[str, Any]:
    return {"spec": asdict(cache.spec), "num_blocks": cache.num_blocks, "device": str(cache.device)}


def publish_shared(name: str, caches: Sequence[KVCache]) -> SharedCaches:
    """Publish ``caches`` for other processes under ``name``; returns the owner's handle.

    Host caches are copied once into shared memory and the returned handle's caches are the
    shared ones (use those from now on). CUDA caches are shared in place through IPC handles.
    """
    group = tuple(caches)
    if not group or not all(isinstance(c, KVCache) for c in group):
        raise ConfigError("publish_shared needs a non-empty sequence of KVCache")
    mailbox = shared_memory.SharedMemory(name=_mailbox_name(name), create=True, size=_MAILBOX_BYTES)
    segments = [mailbox]
    shared: list[KVCache] = []
    entries = []
    try:
        for index, cache in enumerate(group):
            entry = _describe(cache)
            if cache.device.type == "cpu":
                shm = shared_memory.SharedMemory(name=_data_name(name, index), create=True, size=max(1, cache.nbytes))
                segments.append(shm)
                storage = torch.frombuffer(shm.buf, dtype=torch.uint8, count=cache.nbytes)
                storage.copy_(cache.storage)
                shared.append(build_cache(cache.spec, cache.num_blocks, storage, pinned=False))
                entry["transport"] = "shm"
            else:
                from torch.multiprocessing.reductions import reduce_tensor

                rebuild, args = reduce_tensor(cache.storage)  # type: ignore[no-untyped-call]
                entry["transport"] = "ipc"
                entry["ipc"] = base64.b64encode(pickle.dumps((rebuild, args))).decode("ascii")
                shared.append(cache)
            entries.append(entry)
        body = json.dumps({"caches": entries}).encode("utf-8")
        if _HEADER.size + len(body) > _MAILBOX_BYTES:
            raise ConfigError(f"too many caches to describe in one mailbox ({len(body)} bytes)")
        view = _buffer(mailbox)
        view[_HEADER.size : _HEADER.size + len(body)] = body
        # The state word goes last: an attacher that sees "ready" sees the whole description.
        view[: _HEADER.size] = _HEADER.pack(_MAGIC, _VERSION, _READY, len(body))
    except BaseException:
        SharedCaches((), segments, owner=True).close()
        raise
    return SharedCaches(tuple(shared), segments, owner=True)


def attach_shared(name: str, *, timeout: float, poll: float = 0.001, max_poll: float = 0.05) -> SharedCaches:
    """Map the caches another process published under ``name``, waiting up to ``timeout`` seconds.

    Sleeps between looks, starting at ``poll`` seconds and doubling up to ``max_poll``.
    Raises :class:`~kvblocks.errors.AttachTimeoutError` when nothing ready appears in time.
    """
    deadline = time.monotonic() + timeout
    delay = poll
    mailbox = None
    while True:
        if mailbox is None:
            try:
                mailbox = _Mapping(_mailbox_name(name))
            except FileNotFoundError:
                mailbox = None
        if mailbox is not None:
            magic, version, state, length = _HEADER.unpack_from(mailbox.buf, 0)
            if magic == _MAGIC and state == _READY:
                if version != _VERSION:
                    mailbox.close()
                    raise ConfigError(
                        f"shared caches {name!r} use format version {version}, this kvblocks reads {_VERSION}"
                    )
                body = bytes(mailbox.buf[_HEADER.size : _HEADER.size + length])
                break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if mailbox is not None:
                mailbox.close()
            raise AttachTimeoutError(f"no KV caches were published under {name!r} within {timeout} s")
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, max_poll)
    segments = [mailbox]
    caches = []
    for index, entry in enumerate(json.loads(body)["caches"]):
        spec = KVCacheSpec(**entry["spec"])
        num_blocks = entry["num_blocks"]
        if entry["transport"] == "shm":
            mapping = _Mapping(_data_name(name, index))
            segments.append(mapping)
            storage = torch.frombuffer(mapping.buf, dtype=torch.uint8, count=num_blocks * spec.bytes_per_block)
        else:
            rebuild, args = pickle.loads(base64.b64decode(entry["ipc"]))
            storage = rebuild(*args)
        caches.append(build_cache(spec, num_blocks, storage, pinned=False))
    return SharedCaches(tuple(caches), segments, owner=False)
