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

Trust: whoever can write the mailbox decides what an attacher maps, so only segments this
user created with owner-only permissions (0600) are read. The mailbox holds plain JSON
fields, each checked for type and range; nothing is unpickled, and a CUDA cache is rebuilt
by one fixed call of torch's ``rebuild_cuda_tensor``, never by a callable the mailbox names.
A malformed mailbox raises :class:`~kvblocks.errors.ConfigError`; one that is absent or not
ready in time, :class:`~kvblocks.errors.AttachTimeoutError`.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import stat
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from multiprocessing import shared_memory
from typing import Any

from kvblocks.backends._torch import torch
from kvblocks.backends.cache import KVCache, build_cache
from kvblocks.backends.mailbox_fields import _MAX_CACHES, _encode_bytes, _IpcFields, _parse_mailbox
from kvblocks.errors import AttachTimeoutError, ConfigError

__all__ = ["CacheRegistry", "SharedCaches", "attach_shared", "publish_shared"]

_MAGIC = b"KVBLOCKS"
_VERSION = 2  # 2: CUDA caches as plain IPC fields (1 carried a pickle)
_HEADER = struct.Struct("<8sIII")  # magic, version, state, JSON length
_STATE = struct.Struct("<I")
_STATE_OFFSET = 12
_MAILBOX_BYTES = 1 << 20
_WRITING = 0
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


# ---------------------------------------------------------------- names and private segments


def _mailbox_name(name: str) -> str:
    if (
        not isinstance(name, str)
        or not 1 <= len(name) <= 200
        or not name.isascii()
        or not all(c.isalnum() or c in "-_" for c in name)
    ):
        raise ConfigError(f"a shared cache name must be 1-200 letters, digits, '-' or '_', got {name!r}")
    return f"kvblocks-{name}"


def _data_name(name: str, index: int) -> str:
    return f"{_mailbox_name(name)}-{index}"


def _buffer(shm: shared_memory.SharedMemory) -> memoryview:
    buf = shm.buf
    if buf is None:  # pragma: no cover - only after close()
        raise ConfigError(f"shared memory {shm.name!r} is closed")
    return buf


def _check_private(name: str, info: os.stat_result) -> None:
    """Refuse a segment anyone but this user could have created or written."""
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"shared memory {name!r} is not a plain segment: refused")
    if info.st_uid != os.geteuid():
        raise ConfigError(
            f"shared memory {name!r} has owner uid {info.st_uid}, not this user ({os.geteuid()}): refused"
        )
    if info.st_mode & 0o077:
        raise ConfigError(
            f"shared memory {name!r} has permissions {stat.S_IMODE(info.st_mode):o}: others may read or write it, "
            "refused (owner-only 600 required)"
        )


def _open_private(name: str, *, writable: bool) -> tuple[int, int]:
    """An open fd of segment ``name`` and its size, checked on the fd itself (no check-then-open race).

    Raises FileNotFoundError when there is no such segment, ConfigError when it is not this user's alone.
    """
    import _posixshmem  # type: ignore[import-not-found]  # what SharedMemory itself uses on POSIX

    try:
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NONBLOCK  # a FIFO planted there must not block
        fd: int = _posixshmem.shm_open("/" + name, flags, mode=0o600)
    except FileNotFoundError:
        raise
    except OSError as error:
        raise ConfigError(f"shared memory {name!r} cannot be opened: {error}") from None
    try:
        info = os.fstat(fd)
        _check_private(name, info)
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


class _Mapping:
    """An existing, private POSIX shared-memory segment mapped read-write, *without* a resource tracker.

    ``SharedMemory(name)`` would register the segment with this process's resource tracker
    (before Python 3.13), which unlinks it when the process exits -- destroying the owner's
    caches -- or, when the tracker is shared with the owner, drops the owner's registration.
    An attacher therefore maps the segment itself.
    """

    def __init__(self, name: str, min_size: int) -> None:
        try:
            fd, size = _open_private(name, writable=True)
        except FileNotFoundError:
            raise ConfigError(f"shared memory {name!r} named by a ready mailbox does not exist") from None
        try:
            if size < min_size:
                raise ConfigError(f"shared memory {name!r} holds {size} bytes, the mailbox describes {min_size}")
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)
        self.name = name

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()


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


# ---------------------------------------------------------------- CUDA IPC through fixed, plain fields


def _ipc_fields(storage: torch.Tensor) -> _IpcFields:
    """The plain IPC fields of a CUDA cache's storage, from torch's own reduction of it (flat, uint8)."""
    from torch.multiprocessing import reductions

    flat = storage.detach().view(-1)
    rebuild, args = reductions.reduce_tensor(flat)  # type: ignore[no-untyped-call]
    return _fields_of_reduction(rebuild, tuple(args), flat.numel())


def _fields_of_reduction(rebuild: object, args: tuple[Any, ...], nbytes: int) -> _IpcFields:
    """Keep the numbers and handles of ``reduce_tensor``'s answer; refuse any answer of another form."""
    from torch.multiprocessing import reductions

    if rebuild is not reductions.rebuild_cuda_tensor or len(args) != 15:
        raise ConfigError(f"torch shares this tensor through {getattr(rebuild, '__name__', '?')!r}, not CUDA IPC")
    size, stride, tensor_offset, dtype = args[1], args[2], args[3], args[5]
    if tuple(size) != (nbytes,) or tuple(stride) != (1,) or dtype != torch.uint8:
        raise ConfigError("torch reduced a flat uint8 storage to another shape or dtype")
    device, handle, storage_size, storage_offset = args[6], args[7], args[8], args[9]
    counter, counter_offset, event, sync = args[11], args[12], args[13], args[14]
    plain = {
        "device": device,
        "handle": _encode_bytes(handle, "handle"),
        "storage_size_bytes": storage_size,
        "storage_offset_bytes": storage_offset,
        "tensor_offset": tensor_offset,
        "ref_counter_handle": _encode_bytes(counter, "ref_counter_handle"),
        "ref_counter_offset": counter_offset,
        "event_handle": None if event is None else _encode_bytes(event, "event_handle"),
        "event_sync_required": sync,
    }
    return _IpcFields.from_json(plain, nbytes)  # what an attacher would refuse is refused here


def _cuda_devices() -> int:
    return torch.cuda.device_count()


def _rebuild_ipc(ipc: _IpcFields, nbytes: int) -> torch.Tensor:
    """The cache's storage, opened by torch's ``rebuild_cuda_tensor`` with kvblocks' fixed classes and shape."""
    from torch.multiprocessing import reductions

    if ipc.device >= _cuda_devices():
        raise ConfigError(f"the mailbox names CUDA device {ipc.device}; this process sees {_cuda_devices()}")
    try:
        tensor: torch.Tensor = reductions.rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
            torch.Tensor,
            (nbytes,),
            (1,),
            ipc.tensor_offset,
            torch.storage.TypedStorage,
            torch.uint8,
            ipc.device,
            ipc.handle,
            ipc.storage_size_bytes,
            ipc.storage_offset_bytes,
            False,
            ipc.ref_counter_handle,
            ipc.ref_counter_offset,
            ipc.event_handle,
            ipc.event_sync_required,
        )
    except RuntimeError as error:  # CUDA refused the handle (torch.AcceleratorError is a RuntimeError)
        raise ConfigError(f"CUDA cannot open the IPC handle of the mailbox: {error}") from None
    return tensor


# ---------------------------------------------------------------- publish and attach


def _describe(cache: KVCache) -> dict[str, Any]:
    return {"spec": asdict(cache.spec), "num_blocks": cache.num_blocks, "device": str(cache.device)}


def _create_private(name: str, size: int) -> shared_memory.SharedMemory:
    """A new segment (O_EXCL: never one somebody placed first), checked as attachers will check it."""
    shm = shared_memory.SharedMemory(name=name, create=True, size=size)
    try:
        fd, _ = _open_private(name, writable=False)
        os.close(fd)
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    return shm


def _write_ready(view: memoryview, body: bytes) -> None:
    """Body, then the header in state "writing", then the state word alone: ready means complete."""
    view[_HEADER.size : _HEADER.size + len(body)] = body
    _HEADER.pack_into(view, 0, _MAGIC, _VERSION, _WRITING, len(body))
    _STATE.pack_into(view, _STATE_OFFSET, _READY)


def publish_shared(name: str, caches: Sequence[KVCache]) -> SharedCaches:
    """Publish ``caches`` for other processes under ``name``; returns the owner's handle.

    Host caches are copied once into shared memory and the returned handle's caches are the
    shared ones (use those from now on). CUDA caches are shared in place through IPC handles.
    Every segment is this user's alone (mode 0600); a name already taken raises FileExistsError.
    """
    group = tuple(caches)
    if not group or not all(isinstance(c, KVCache) for c in group):
        raise ConfigError("publish_shared needs a non-empty sequence of KVCache")
    if len(group) > _MAX_CACHES:
        raise ConfigError(f"one mailbox describes at most {_MAX_CACHES} caches, got {len(group)}")
    unsupported = sorted({c.device.type for c in group} - {"cpu", "cuda"})
    if unsupported:
        raise ConfigError(f"only CPU and CUDA caches can be shared across processes, not {', '.join(unsupported)}")
    mailbox = _create_private(_mailbox_name(name), _MAILBOX_BYTES)
    segments = [mailbox]
    shared: list[KVCache] = []
    entries = []
    try:
        for index, cache in enumerate(group):
            entry = _describe(cache)
            if cache.device.type == "cpu":
                shm = _create_private(_data_name(name, index), max(1, cache.nbytes))
                segments.append(shm)
                storage = torch.frombuffer(_buffer(shm), dtype=torch.uint8, count=cache.nbytes)
                storage.copy_(cache.storage.view(-1))
                shared.append(build_cache(cache.spec, cache.num_blocks, storage, pinned=False))
                entry["transport"] = "shm"
            else:
                entry["transport"] = "ipc"
                entry["ipc"] = _ipc_fields(cache.storage).to_json()
                shared.append(cache)
            entries.append(entry)
        body = json.dumps({"caches": entries}).encode("utf-8")
        if _HEADER.size + len(body) > _MAILBOX_BYTES:
            raise ConfigError(f"too many caches to describe in one mailbox ({len(body)} bytes)")
        _parse_mailbox(body)  # a publisher never writes what its attachers would refuse
        _write_ready(_buffer(mailbox), body)
    except BaseException:
        SharedCaches((), segments, owner=True).close()
        raise
    return SharedCaches(tuple(shared), segments, owner=True)


def _read_mailbox(mailbox_name: str) -> bytes | None:
    """The JSON body of a ready mailbox; None while it is absent, not yet sized, or being written."""
    try:
        fd, size = _open_private(mailbox_name, writable=False)
    except FileNotFoundError:
        return None
    try:
        if size == 0:  # created, not yet sized by its owner (ftruncate sets the whole size at once)
            return None
        if size < _HEADER.size:
            raise ConfigError(f"mailbox {mailbox_name!r} is {size} bytes, smaller than its header")
        with mmap.mmap(fd, min(size, _MAILBOX_BYTES), access=mmap.ACCESS_READ) as view:
            _magic, _version, state, _length = _HEADER.unpack_from(view, 0)
            if state == _WRITING:
                return None
            header = view[: _HEADER.size]
            return _checked_body(mailbox_name, _HEADER.unpack(header), view[_HEADER.size :])
    finally:
        os.close(fd)


def _checked_body(mailbox_name: str, header: tuple[Any, ...], rest: bytes) -> bytes:
    magic, version, state, length = header
    if state != _READY:
        raise ConfigError(f"mailbox {mailbox_name!r} has state {state}, neither 0 (writing) nor 1 (ready)")
    if magic != _MAGIC:
        raise ConfigError(f"{mailbox_name!r} is not a kvblocks mailbox (magic {magic!r})")
    if version != _VERSION:
        raise ConfigError(f"mailbox {mailbox_name!r} uses format version {version}, this kvblocks reads {_VERSION}")
    if not 1 <= length <= len(rest):
        raise ConfigError(f"mailbox {mailbox_name!r} declares {length} bytes of description, it holds {len(rest)}")
    return rest[:length]


def _check_wait(timeout: float, poll: float, max_poll: float) -> None:
    for what, value, low in (("timeout", timeout, 0.0), ("poll", poll, None), ("max_poll", max_poll, poll)):
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or (value < low if low is not None else value <= 0):
            bound = f">= {low}" if low is not None else "> 0"
            raise ConfigError(f"{what} must be a finite number {bound} seconds, got {value!r}")


def _wait_for_mailbox(name: str, mailbox_name: str, timeout: float, poll: float, max_poll: float) -> bytes:
    deadline = time.monotonic() + timeout
    delay = poll
    while True:
        body = _read_mailbox(mailbox_name)
        if body is not None:
            return body
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AttachTimeoutError(f"no KV caches were published under {name!r} within {timeout} s")
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, max_poll)


def attach_shared(name: str, *, timeout: float, poll: float = 0.001, max_poll: float = 0.05) -> SharedCaches:
    """Map the caches another process published under ``name``, waiting up to ``timeout`` seconds.

    Sleeps between looks, starting at ``poll`` seconds and doubling up to ``max_poll``.
    Raises :class:`~kvblocks.errors.AttachTimeoutError` when nothing ready appears in time, and
    :class:`~kvblocks.errors.ConfigError` for a mailbox or segment that is malformed, not this
    user's, or readable or writable by others (see the module docstring: nothing is executed).
    """
    mailbox_name = _mailbox_name(name)
    _check_wait(timeout, poll, max_poll)
    entries = _parse_mailbox(_wait_for_mailbox(name, mailbox_name, timeout, poll, max_poll))
    segments: list[_Mapping] = []
    caches = []
    try:
        for index, entry in enumerate(entries):
            if entry.ipc is None:
                mapping = _Mapping(_data_name(name, index), entry.nbytes)
                segments.append(mapping)
                storage = torch.frombuffer(mapping.buf, dtype=torch.uint8, count=entry.nbytes)
            else:
                storage = _rebuild_ipc(entry.ipc, entry.nbytes)
            caches.append(build_cache(entry.spec, entry.num_blocks, storage, pinned=False))
    except BaseException:
        SharedCaches((), list(segments), owner=False).close()
        raise
    return SharedCaches(tuple(caches), list(segments), owner=False)
