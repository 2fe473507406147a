"""The fields of a shared-cache mailbox (:mod:`kvblocks.backends.sharing`), parsed and checked.

A mailbox is outside bytes: whoever can write it decides what an attacher maps. Its body is strict JSON
whose every field is checked here for type and range against the bounds below (far above any real
model, low enough that checking is cheap); anything else is a :class:`~kvblocks.errors.ConfigError`.
Nothing is unpickled and no name in it is called.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, fields
from typing import Any

from kvblocks import strict_json
from kvblocks.backends.spec import KVCacheSpec
from kvblocks.errors import ConfigError

# Bounds on what a mailbox may describe: far above any real model, low enough that checking is cheap.
_MAX_CACHES = 256
_MAX_LAYERS = 1024
_MAX_DIM = 1 << 20
_MAX_BLOCKS = 1 << 40
_MAX_BYTES = 1 << 50
_MAX_HANDLE = 1 << 18  # an expandable-segments handle lists one handle per segment page
_MAX_DEVICE = 1024
_MAX_COUNTER_OFFSET = 1 << 32
_MAX_TEXT = 64
_REF_COUNTER_NAME = re.compile(rb"/[A-Za-z0-9_.-]{1,250}")
"""torch's IPC reference counter is a POSIX shm segment (``/torch_<pid>_<n>_<n>``): one name, no path."""


def _int(value: object, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"mailbox field {what} must be an int in [{low}, {high}], got {value!r:.80}")
    return value


def _text(value: object, what: str) -> str:
    if not isinstance(value, str) or len(value) > _MAX_TEXT:
        raise ConfigError(f"mailbox field {what} must be a string of at most {_MAX_TEXT} characters")
    return value


def _object(value: object, keys: set[str], what: str) -> dict[str, object]:
    if not isinstance(value, dict) or set(value) != keys:
        got = sorted(map(str, value))[:20] if isinstance(value, dict) else type(value).__name__
        raise ConfigError(f"mailbox field {what} must be an object with keys {sorted(keys)}, got {got}")
    return value


def _encode_bytes(value: object, what: str) -> str:
    if not isinstance(value, bytes) or not 1 <= len(value) <= _MAX_HANDLE:
        raise ConfigError(f"CUDA IPC field {what} must be 1-{_MAX_HANDLE} bytes, got {type(value).__name__}")
    return base64.b64encode(value).decode("ascii")


def _decode_bytes(value: object, what: str) -> bytes:
    if not isinstance(value, str) or len(value) > 4 * _MAX_HANDLE // 3 + 4:
        raise ConfigError(f"mailbox field {what} must be base64 text of at most {_MAX_HANDLE} bytes")
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:
        raise ConfigError(f"mailbox field {what} is not valid base64") from None
    if not 1 <= len(raw) <= _MAX_HANDLE:
        raise ConfigError(f"mailbox field {what} must decode to 1-{_MAX_HANDLE} bytes, got {len(raw)}")
    return raw


@dataclass(frozen=True)
class _IpcFields:
    """What torch's ``rebuild_cuda_tensor`` needs to open a CUDA allocation of another process.

    The tensor class, storage class, dtype, shape and stride are fixed by kvblocks (a flat uint8
    tensor of the cache's bytes), so the mailbox carries only numbers and opaque handle bytes.
    """

    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    tensor_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool

    def to_json(self) -> dict[str, object]:
        return {
            "device": self.device,
            "handle": _encode_bytes(self.handle, "handle"),
            "storage_size_bytes": self.storage_size_bytes,
            "storage_offset_bytes": self.storage_offset_bytes,
            "tensor_offset": self.tensor_offset,
            "ref_counter_handle": _encode_bytes(self.ref_counter_handle, "ref_counter_handle"),
            "ref_counter_offset": self.ref_counter_offset,
            "event_handle": None if self.event_handle is None else _encode_bytes(self.event_handle, "event_handle"),
            "event_sync_required": self.event_sync_required,
        }

    @classmethod
    def from_json(cls, value: object, nbytes: int) -> _IpcFields:
        """The fields of ``value``, each checked; ``nbytes`` is the cache's size, which must fit the storage."""
        raw = _object(value, {f.name for f in fields(cls)}, "ipc")
        storage_size = _int(raw["storage_size_bytes"], "ipc.storage_size_bytes", 1, _MAX_BYTES)
        tensor_offset = _int(raw["tensor_offset"], "ipc.tensor_offset", 0, _MAX_BYTES)
        if tensor_offset + nbytes > storage_size:
            raise ConfigError(
                f"the cache's {nbytes} bytes at offset {tensor_offset} overrun the {storage_size}-byte CUDA storage"
            )
        counter = _decode_bytes(raw["ref_counter_handle"], "ipc.ref_counter_handle")
        if not _REF_COUNTER_NAME.fullmatch(counter):
            raise ConfigError("mailbox field ipc.ref_counter_handle is not a POSIX shared-memory name")
        sync = raw["event_sync_required"]
        if not isinstance(sync, bool):
            raise ConfigError("mailbox field ipc.event_sync_required must be true or false")
        event = None if raw["event_handle"] is None else _decode_bytes(raw["event_handle"], "ipc.event_handle")
        if sync and event is None:
            raise ConfigError("mailbox field ipc.event_handle is needed when event_sync_required is true")
        return cls(
            device=_int(raw["device"], "ipc.device", 0, _MAX_DEVICE - 1),
            handle=_decode_bytes(raw["handle"], "ipc.handle"),
            storage_size_bytes=storage_size,
            storage_offset_bytes=_int(raw["storage_offset_bytes"], "ipc.storage_offset_bytes", 0, _MAX_BYTES),
            tensor_offset=tensor_offset,
            ref_counter_handle=counter,
            ref_counter_offset=_int(raw["ref_counter_offset"], "ipc.ref_counter_offset", 0, _MAX_COUNTER_OFFSET),
            event_handle=event,
            event_sync_required=sync,
        )


@dataclass(frozen=True)
class _Entry:
    """One cache as a mailbox describes it, checked."""

    spec: KVCacheSpec
    num_blocks: int
    ipc: _IpcFields | None  # None: the bytes are in the data segment of the same index

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block


_SPEC_INTS = {"num_layers": _MAX_LAYERS, "num_kv_heads": _MAX_DIM, "head_dim": _MAX_DIM, "block_size": _MAX_DIM}
_SPEC_TEXTS = ("dtype", "layout", "kind")


def _parse_spec(value: object) -> KVCacheSpec:
    raw = _object(value, {f.name for f in fields(KVCacheSpec)}, "spec")
    checked: dict[str, Any] = {key: _int(raw[key], f"spec.{key}", 1, high) for key, high in _SPEC_INTS.items()}
    checked.update({key: _text(raw[key], f"spec.{key}") for key in _SPEC_TEXTS})
    scale = raw["scale_dtype"]
    checked["scale_dtype"] = None if scale is None else _text(scale, "spec.scale_dtype")
    if not isinstance(raw["block_major"], bool):
        raise ConfigError("mailbox field spec.block_major must be true or false")
    checked["block_major"] = raw["block_major"]
    return KVCacheSpec(**checked)  # its own checks raise ConfigError


_ENTRY_KEYS = {"spec", "num_blocks", "device", "transport"}


def _parse_entry(value: object) -> _Entry:
    transport = value.get("transport") if isinstance(value, dict) else None
    if transport not in ("shm", "ipc"):
        raise ConfigError(f"mailbox field transport must be 'shm' or 'ipc', got {transport!r:.80}")
    raw = _object(value, _ENTRY_KEYS | ({"ipc"} if transport == "ipc" else set()), "caches[]")
    spec = _parse_spec(raw["spec"])
    num_blocks = _int(raw["num_blocks"], "num_blocks", 1, _MAX_BLOCKS)
    nbytes = num_blocks * spec.bytes_per_block
    if nbytes > _MAX_BYTES:
        raise ConfigError(f"a mailbox describes a cache of {nbytes} bytes, more than {_MAX_BYTES}")
    device = _text(raw["device"], "device")
    if transport == "shm":
        if device != "cpu":
            raise ConfigError(f"a shared-memory cache is on the cpu, the mailbox says {device!r}")
        return _Entry(spec, num_blocks, None)
    ipc = _IpcFields.from_json(raw["ipc"], nbytes)
    if device != f"cuda:{ipc.device}":
        raise ConfigError(f"a CUDA IPC cache of device {ipc.device} cannot be on {device!r}")
    return _Entry(spec, num_blocks, ipc)


def _parse_mailbox(body: bytes) -> list[_Entry]:
    """The caches a mailbox body describes; ConfigError for anything but the documented plain fields."""
    try:
        document = strict_json.parse(body)  # bad UTF-8 or JSON, too deep, too many digits, NaN, a repeated key
    except strict_json.StrictJSONError as error:
        raise ConfigError(f"the mailbox is not strict UTF-8 JSON: {str(error)[:200]}") from None
    caches = _object(document, {"caches"}, "(top level)")["caches"]
    if not isinstance(caches, list) or not 1 <= len(caches) <= _MAX_CACHES:
        raise ConfigError(f"mailbox field caches must be a list of 1-{_MAX_CACHES} caches")
    return [_parse_entry(entry) for entry in caches]
