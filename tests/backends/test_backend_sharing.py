"""Shared-memory publication: what a mailbox may contain, who may have written it, and what is never run.

The trust model (docs/backends.md): only a mailbox and data segments created by this user with owner-only
permissions are read; their contents are plain, validated JSON fields; nothing is unpickled and no callable
named by the mailbox is called. Anything else raises ConfigError (malformed) or AttachTimeoutError (nothing
ready in time), and leaves no mapping behind.
"""

from __future__ import annotations

import base64
import copy
import inspect
import json
import os
import pickle
import stat
import time
import uuid
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks.backends import CPUBackend, KVCacheSpec, attach_shared, mailbox_fields, publish_shared, sharing
from kvblocks.errors import AttachTimeoutError, ConfigError

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
SHM = Path("/dev/shm")
needs_dev_shm = pytest.mark.skipif(not SHM.is_dir(), reason="POSIX shared memory is not under /dev/shm here")


def _name() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def _write_mailbox(name: str, body: bytes, *, version: int | None = None) -> shared_memory.SharedMemory:
    """A ready mailbox holding ``body``, written the way the owner writes one (this user, mode 0600)."""
    mailbox = shared_memory.SharedMemory(name=f"kvblocks-{name}", create=True, size=sharing._MAILBOX_BYTES)
    header = sharing._HEADER.pack(sharing._MAGIC, sharing._VERSION if version is None else version, 1, len(body))
    mailbox.buf[: len(header)] = header
    mailbox.buf[len(header) : len(header) + len(body)] = body
    return mailbox


def _body(entries: list[dict]) -> bytes:
    return json.dumps({"caches": entries}).encode()


def _drop(segment: shared_memory.SharedMemory) -> None:
    segment.close()
    segment.unlink()


SMALL_SPEC = {
    "num_layers": 1,
    "num_kv_heads": 1,
    "head_dim": 8,
    "dtype": "float32",
    "block_size": 4,
    "layout": "NHD",
    "kind": "kv",
    "scale_dtype": None,
    "block_major": True,
}
SMALL_NBYTES = 2 * 2 * 4 * 8 * 4  # 2 blocks of K and V, 4 tokens, 8 float32 each
IPC = {
    "device": 0,
    "handle": b"\x01" * 65,
    "storage_size_bytes": 2 * 1024 * 1024,
    "storage_offset_bytes": 4096,
    "tensor_offset": 512,
    "ref_counter_handle": b"/torch_4242_1938272_0",
    "ref_counter_offset": 7,
    "event_handle": b"\x02" * 64,
    "event_sync_required": True,
}
"""Synthetic values of the shapes torch's ``_share_cuda_`` gives (a CUDA IPC handle is 64 bytes, plus a tag)."""
_REBUILD_ARGS = (
    "tensor_cls",
    "size",
    "stride",
    "tensor_offset",
    "storage_cls",
    "dtype",
    "device",
    "handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)
"""The parameters of torch.multiprocessing.reductions.rebuild_cuda_tensor, in order (checked below)."""


def _plain_ipc(**overrides: object) -> dict:
    values = {**IPC, **overrides}
    for key in ("handle", "ref_counter_handle", "event_handle"):
        if isinstance(values[key], bytes):
            values[key] = base64.b64encode(values[key]).decode("ascii")
    return values


def _ipc_entry(**overrides: object) -> dict:
    return {"spec": SMALL_SPEC, "num_blocks": 2, "device": "cuda:0", "transport": "ipc", "ipc": _plain_ipc(**overrides)}


def _fake_cuda(monkeypatch) -> list[tuple]:
    """torch's CUDA rebuild replaced by a recorder returning host bytes, and one CUDA device seen."""
    calls: list[tuple] = []

    def rebuild(*args):
        calls.append(args)
        return torch.zeros(args[1][0], dtype=torch.uint8)

    monkeypatch.setattr(torch.multiprocessing.reductions, "rebuild_cuda_tensor", rebuild)
    monkeypatch.setattr(sharing, "_cuda_devices", lambda: 1)
    return calls


class _MakeMarker:
    """Unpickling this calls ``os.mkdir(path)``: the payload an attacker would place in a mailbox."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (self.path,))


# ---------------------------------------------------------------- nothing from the mailbox is executed


def test_a_pickle_in_the_mailbox_is_never_executed(tmp_path) -> None:
    """Before the fix, attach_shared unpickled the "ipc" entry: the reduce ran (here it makes a directory)."""
    marker = tmp_path / "executed"
    payload = base64.b64encode(pickle.dumps(_MakeMarker(marker))).decode("ascii")
    entry = {"spec": SMALL_SPEC, "num_blocks": 2, "device": "cuda:0", "transport": "ipc", "ipc": payload}
    name = _name()
    mailbox = _write_mailbox(name, json.dumps({"caches": [entry]}).encode())
    try:
        with pytest.raises(ConfigError):
            attach_shared(name, timeout=0.5)
    finally:
        _drop(mailbox)
        assert not marker.exists(), "attach_shared ran code named by the mailbox"


@pytest.mark.parametrize("field", ["handle", "event_handle"])
def test_a_pickle_in_an_ipc_byte_field_reaches_torch_as_bytes_never_loaded(tmp_path, field, monkeypatch) -> None:
    """The byte fields are opaque handles: a pickle there reaches the fixed rebuild as bytes, unloaded."""
    marker = tmp_path / "executed"
    payload = pickle.dumps(_MakeMarker(marker))
    calls = _fake_cuda(monkeypatch)
    name = _name()
    mailbox = _write_mailbox(name, _body([_ipc_entry(**{field: payload})]))
    try:
        attach_shared(name, timeout=0.5).close()
    finally:
        _drop(mailbox)
    assert len(calls) == 1 and calls[0][_REBUILD_ARGS.index(field)] == payload
    assert not marker.exists()


def test_sharing_never_unpickles(monkeypatch) -> None:
    """Publishing and attaching (and refusing) run with every unpickling entry point booby-trapped."""

    def trap(*args, **kwargs):
        raise AssertionError("sharing unpickled something")

    monkeypatch.setattr(pickle, "loads", trap)
    monkeypatch.setattr(pickle, "load", trap)
    monkeypatch.setattr(pickle, "Unpickler", trap)
    name = _name()
    cache = CPUBackend().allocate(SPEC, 3)
    cache.key(0)[1].fill_(4.0)
    with publish_shared(name, [cache]), attach_shared(name, timeout=5) as attached:
        assert torch.all(attached.caches[0].key(0)[1] == 4.0)


# ---------------------------------------------------------------- who may have written the mailbox


@needs_dev_shm
def test_published_segments_are_owner_only() -> None:
    name = _name()
    cache = CPUBackend().allocate(SPEC, 2)
    with publish_shared(name, [cache, CPUBackend().allocate(SPEC, 1)]):
        paths = [SHM / f"kvblocks-{name}", SHM / f"kvblocks-{name}-0", SHM / f"kvblocks-{name}-1"]
        for path in paths:
            info = path.stat()
            assert info.st_uid == os.geteuid()
            assert stat.S_IMODE(info.st_mode) == 0o600, (path, oct(info.st_mode))


@needs_dev_shm
@pytest.mark.parametrize("which", ["mailbox", "data"])
@pytest.mark.parametrize("mode", [0o640, 0o604, 0o666, 0o620])
def test_segments_readable_or_writable_by_others_are_refused(which, mode) -> None:
    """Anyone in the group (or anyone at all) could have written them: refused, not read."""
    name = _name()
    with publish_shared(name, [CPUBackend().allocate(SPEC, 2)]):
        path = SHM / (f"kvblocks-{name}" if which == "mailbox" else f"kvblocks-{name}-0")
        os.chmod(path, mode)
        with pytest.raises(ConfigError, match=r"permission|owner"):
            attach_shared(name, timeout=0.5)


@needs_dev_shm
@pytest.mark.parametrize("which", ["mailbox", "data"])
def test_segments_owned_by_another_user_are_refused(which, monkeypatch) -> None:
    name = _name()
    with publish_shared(name, [CPUBackend().allocate(SPEC, 2)]):
        path = SHM / (f"kvblocks-{name}" if which == "mailbox" else f"kvblocks-{name}-0")
        owner = path.stat().st_uid
        if os.geteuid() == 0:
            os.chown(path, 65534, -1)  # as root: really hand it to "nobody"
        else:
            real = os.geteuid
            monkeypatch.setattr(os, "geteuid", lambda: real() + 1)
        try:
            with pytest.raises(ConfigError, match="owner"):
                attach_shared(name, timeout=0.5)
        finally:
            if os.geteuid() == 0:
                os.chown(path, owner, -1)


def test_a_data_segment_gone_or_too_small_is_a_config_error() -> None:
    import _posixshmem

    name = _name()
    with publish_shared(name, [CPUBackend().allocate(SPEC, 2)]):
        _posixshmem.shm_unlink(f"/kvblocks-{name}-0")  # the owner withdrew it, or never wrote it
        with pytest.raises(ConfigError, match="does not exist"):
            attach_shared(name, timeout=0.5)
        small = shared_memory.SharedMemory(name=f"kvblocks-{name}-0", create=True, size=16)
        try:
            with pytest.raises(ConfigError, match="16 bytes"):
                attach_shared(name, timeout=0.5)
        finally:
            small.close()


# ---------------------------------------------------------------- the mailbox's framing


def test_a_mailbox_created_but_not_yet_sized_is_waited_for() -> None:
    """The owner's shm_open and ftruncate are two steps: between them the mailbox exists with 0 bytes."""
    import _posixshmem

    name = _name()
    fd = _posixshmem.shm_open(f"/kvblocks-{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        with pytest.raises(AttachTimeoutError):
            attach_shared(name, timeout=0.1)
    finally:
        os.close(fd)
        _posixshmem.shm_unlink(f"/kvblocks-{name}")


@pytest.mark.parametrize(
    "header, error",
    [
        ((b"KVBLOCKS", None, 0, 10), AttachTimeoutError),  # still being written
        ((b"\0" * 8, None, 0, 0), AttachTimeoutError),  # nothing written yet
        ((b"NOTOURS!", None, 1, 10), ConfigError),
        ((b"KVBLOCKS", 1, 1, 10), ConfigError),  # the format that carried a pickle
        ((b"KVBLOCKS", None, 2, 10), ConfigError),  # no such state
        ((b"KVBLOCKS", None, 1, 0), ConfigError),
        ((b"KVBLOCKS", None, 1, 1 << 20), ConfigError),  # past the end of the mailbox
        ((b"KVBLOCKS", None, 1, 0xFFFFFFFF), ConfigError),
    ],
)
def test_mailbox_headers(header, error) -> None:
    magic, version, state, length = header
    name = _name()
    mailbox = shared_memory.SharedMemory(name=f"kvblocks-{name}", create=True, size=sharing._MAILBOX_BYTES)
    try:
        mailbox.buf[: sharing._HEADER.size] = sharing._HEADER.pack(
            magic, sharing._VERSION if version is None else version, state, length
        )
        with pytest.raises(error):
            attach_shared(name, timeout=0.05)
    finally:
        _drop(mailbox)


def test_a_mailbox_smaller_than_its_header_is_refused() -> None:
    name = _name()
    mailbox = shared_memory.SharedMemory(name=f"kvblocks-{name}", create=True, size=7)
    try:
        with pytest.raises(ConfigError, match="smaller than its header"):
            attach_shared(name, timeout=0.05)
    finally:
        _drop(mailbox)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"timeout": 1, "poll": 0},  # a back-off that never grows: a busy loop
        {"timeout": 1, "poll": -0.1},
        {"timeout": 1, "poll": float("nan")},
        {"timeout": -1},
        {"timeout": float("inf")},
        {"timeout": True},
        {"timeout": "1"},
        {"timeout": 1, "poll": 0.01, "max_poll": 0.001},
    ],
)
def test_wait_settings_are_checked_before_waiting(kwargs) -> None:
    cpu_before = time.process_time()
    with pytest.raises(ConfigError):
        attach_shared(_name(), **kwargs)
    assert time.process_time() - cpu_before < 0.05  # refused at once, not after spinning


@pytest.mark.parametrize("name", [123, b"kv", "", "a/b", "é" * 3, "x" * 201, None])
def test_bad_names_are_config_errors(name) -> None:
    with pytest.raises(ConfigError, match="name"):
        attach_shared(name, timeout=0.01)
    with pytest.raises(ConfigError, match="name"):
        publish_shared(name, [CPUBackend().allocate(SPEC, 1)])


# ---------------------------------------------------------------- CUDA IPC fields, on the CPU


def test_rebuild_args_match_torchs_rebuild_cuda_tensor() -> None:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    assert tuple(inspect.signature(rebuild_cuda_tensor).parameters) == (
        "tensor_cls",
        "tensor_size",
        "tensor_stride",
        "tensor_offset",
        "storage_cls",
        "dtype",
        "storage_device",
        "storage_handle",
        "storage_size_bytes",
        "storage_offset_bytes",
        "requires_grad",
        "ref_counter_handle",
        "ref_counter_offset",
        "event_handle",
        "event_sync_required",
    )


def test_an_ipc_cache_is_rebuilt_by_the_fixed_call_with_exactly_the_checked_fields(monkeypatch) -> None:
    calls = _fake_cuda(monkeypatch)
    name = _name()
    mailbox = _write_mailbox(name, _body([_ipc_entry()]))
    try:
        with attach_shared(name, timeout=0.5) as attached:
            cache = attached.caches[0]
            assert (cache.num_blocks, cache.spec.head_dim, cache.nbytes) == (2, 8, SMALL_NBYTES)
    finally:
        _drop(mailbox)
    assert calls == [
        (
            torch.Tensor,
            (SMALL_NBYTES,),
            (1,),
            IPC["tensor_offset"],
            torch.storage.TypedStorage,
            torch.uint8,
            IPC["device"],
            IPC["handle"],
            IPC["storage_size_bytes"],
            IPC["storage_offset_bytes"],
            False,
            IPC["ref_counter_handle"],
            IPC["ref_counter_offset"],
            IPC["event_handle"],
            IPC["event_sync_required"],
        )
    ]


_handles = st.binary(min_size=1, max_size=300)
_counter_names = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-", min_size=1, max_size=60)


@st.composite
def _torch_reductions(draw) -> tuple:
    """Synthetic ``reduce_tensor`` results for a flat uint8 CUDA tensor of ``nbytes``."""
    nbytes = draw(st.integers(1, 1 << 40))
    tensor_offset = draw(st.integers(0, 1 << 40))
    sync = draw(st.booleans())
    return nbytes, (
        torch.Tensor,
        torch.Size([nbytes]),
        (1,),
        tensor_offset,
        torch.storage.TypedStorage,
        torch.uint8,
        draw(st.integers(0, 1023)),
        draw(_handles),
        tensor_offset + nbytes + draw(st.integers(0, 1 << 40)),
        draw(st.integers(0, 1 << 48)),
        False,
        ("/" + draw(_counter_names)).encode(),
        draw(st.integers(0, 1 << 32)),
        draw(_handles) if sync else draw(st.none() | _handles),
        sync,
    )


@settings(max_examples=400, deadline=None)
@given(reduction=_torch_reductions())
def test_ipc_fields_travel_from_torchs_reduce_to_torchs_rebuild_unchanged(reduction) -> None:
    """reduce_tensor's answer (publisher) -> plain JSON -> checked fields -> rebuild_cuda_tensor (attacher)."""
    from torch.multiprocessing import reductions

    nbytes, args = reduction
    fields = sharing._fields_of_reduction(reductions.rebuild_cuda_tensor, args, nbytes)
    entry = {"spec": SMALL_SPEC, "num_blocks": 2, "device": f"cuda:{args[6]}", "transport": "ipc"}
    body = json.dumps({"caches": [{**entry, "ipc": fields.to_json()}]}).encode()
    if nbytes >= SMALL_NBYTES:  # the mailbox's cache must fit the storage the fields describe
        assert mailbox_fields._parse_mailbox(body)[0].ipc == fields
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reductions, "rebuild_cuda_tensor", lambda *a: calls.append(a) or torch.zeros(0))
        patch.setattr(sharing, "_cuda_devices", lambda: 1024)
        sharing._rebuild_ipc(fields, nbytes)
    fixed = (torch.Tensor, (nbytes,), (1,), args[3], torch.storage.TypedStorage, torch.uint8)
    assert calls == [(*fixed, *args[6:10], False, *args[11:])]


def test_ipc_fields_of_a_real_tensor_come_from_torchs_reduce_tensor(monkeypatch) -> None:
    from torch.multiprocessing import reductions

    seen = []
    storage = torch.zeros(2, 48, dtype=torch.uint8)  # a cache's storage may be 2-D: it is reduced flat

    def reduce(tensor):
        seen.append(tuple(tensor.shape))
        args = (torch.Tensor, tensor.size(), tensor.stride(), 0, torch.storage.TypedStorage, tensor.dtype)
        return reductions.rebuild_cuda_tensor, (*args, 0, b"h", 96, 0, False, b"/torch_1", 0, None, False)

    monkeypatch.setattr(reductions, "reduce_tensor", reduce)
    fields = sharing._ipc_fields(storage)
    assert seen == [(96,)] and (fields.handle, fields.storage_size_bytes, fields.event_handle) == (b"h", 96, None)
    monkeypatch.setattr(reductions, "reduce_tensor", lambda tensor: (reductions.rebuild_tensor, ()))
    with pytest.raises(ConfigError, match="rebuild_tensor"):  # e.g. a host tensor: not an IPC handle
        sharing._ipc_fields(storage)


@pytest.mark.parametrize(
    "overrides",
    [
        {"device": -1},
        {"device": 1024},
        {"device": True},
        {"device": 0.0},
        {"handle": "not base64!"},
        {"handle": ""},
        {"handle": base64.b64encode(b"x" * (mailbox_fields._MAX_HANDLE + 1)).decode()},
        {"handle": None},
        {"handle": ["AQ=="]},
        {"storage_size_bytes": SMALL_NBYTES - 1, "tensor_offset": 0},  # the cache overruns the storage
        {"storage_size_bytes": 600, "tensor_offset": 500},
        {"storage_size_bytes": 0},
        {"storage_offset_bytes": -1},
        {"tensor_offset": 1 << 60},
        {"ref_counter_handle": b"../../etc/passwd"},
        {"ref_counter_handle": b"/a/b"},
        {"ref_counter_handle": b"/torch\x00x"},
        {"ref_counter_offset": -1},
        {"ref_counter_offset": 1 << 40},
        {"event_handle": None, "event_sync_required": True},
        {"event_sync_required": 1},
        {"event_sync_required": "yes"},
    ],
)
def test_bad_ipc_fields_are_config_errors_before_torch_is_called(overrides, monkeypatch) -> None:
    calls = _fake_cuda(monkeypatch)
    entry = _ipc_entry()
    entry["ipc"].update(_plain_ipc(**overrides) | {k: v for k, v in overrides.items() if not isinstance(v, bytes)})
    name = _name()
    mailbox = _write_mailbox(name, _body([entry]))
    try:
        with pytest.raises(ConfigError, match=r"ipc|storage"):
            attach_shared(name, timeout=0.5)
    finally:
        _drop(mailbox)
    assert calls == []


@pytest.mark.parametrize(
    "change",
    [
        lambda entry: entry["ipc"].pop("handle"),
        lambda entry: entry["ipc"].update(extra=1),
        lambda entry: entry.update(device="cuda:1"),
        lambda entry: entry.update(device="cpu"),
        lambda entry: entry.update(ipc="AQID"),
        lambda entry: entry.pop("ipc"),
    ],
)
def test_ipc_entries_of_another_shape_are_refused(change, monkeypatch) -> None:
    calls = _fake_cuda(monkeypatch)
    entry = _ipc_entry()
    change(entry)
    name = _name()
    mailbox = _write_mailbox(name, _body([entry]))
    try:
        with pytest.raises(ConfigError):
            attach_shared(name, timeout=0.5)
    finally:
        _drop(mailbox)
    assert calls == []


def test_an_ipc_cache_on_a_machine_without_that_device_is_a_config_error(monkeypatch) -> None:
    monkeypatch.setattr(sharing, "_cuda_devices", lambda: 0)
    name = _name()
    mailbox = _write_mailbox(name, _body([_ipc_entry()]))
    try:
        with pytest.raises(ConfigError, match="sees 0"):
            attach_shared(name, timeout=0.5)
    finally:
        _drop(mailbox)


# ---------------------------------------------------------------- fuzzing a real mailbox

FUZZ_SPECS = [
    SPEC,
    KVCacheSpec(
        num_layers=1,
        num_kv_heads=2,
        head_dim=16,
        dtype="float8_e4m3fn",
        block_size=8,
        layout="HND",
        scale_dtype="float32",
        block_major=False,
    ),
]


@pytest.fixture(scope="module")
def published():
    """A real publication of two host caches; the fuzz tests overwrite its mailbox and restore it."""
    name = _name()
    caches = [CPUBackend().allocate(spec, 3) for spec in FUZZ_SPECS]
    with publish_shared(name, caches) as shared:
        mailbox = shared._segments[0]
        length = sharing._HEADER.unpack_from(mailbox.buf, 0)[3]
        original = bytes(mailbox.buf[: sharing._HEADER.size + length])
        yield name, mailbox.buf, original
        _overwrite(mailbox.buf, original)


def _overwrite(buf: memoryview, content: bytes) -> None:
    buf[:_FUZZ_REGION] = bytes(_FUZZ_REGION)
    buf[: len(content)] = content


_FUZZ_REGION = 8192
_ESCAPES = (ConfigError, AttachTimeoutError)


def _attach_or_refuse(name: str) -> None:
    """Attach once, at once: only the two documented errors may escape; a success maps what it says."""
    try:
        attached = attach_shared(name, timeout=0)
    except _ESCAPES:
        return
    try:
        for cache in attached.caches:
            assert cache.nbytes == cache.num_blocks * cache.spec.bytes_per_block
            cache.key(0)[cache.num_blocks - 1].float().sum()  # the last block is mapped memory
    finally:
        attached.close()


def _framed(body: bytes) -> bytes:
    return sharing._HEADER.pack(sharing._MAGIC, sharing._VERSION, 1, len(body)) + body


def _no_unpickling():
    patch = pytest.MonkeyPatch()
    for attribute in ("loads", "load", "Unpickler"):
        patch.setattr(pickle, attribute, _trap)
    return patch


def _trap(*args, **kwargs):
    raise AssertionError("sharing unpickled something")


@settings(max_examples=1500, deadline=None)
@given(content=st.binary(max_size=600) | st.binary(max_size=300).map(_framed))
def test_random_mailbox_contents_raise_only_the_documented_errors(published, content) -> None:
    name, buf, original = published
    patch = _no_unpickling()
    try:
        _overwrite(buf, content)
        _attach_or_refuse(name)
    finally:
        patch.undo()
        _overwrite(buf, original)


@st.composite
def _byte_mutations(draw, base: bytes) -> bytes:
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, max(0, len(data) - 1)))
        action = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        if action == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif action == "set" and data:
            data[at] = draw(st.integers(0, 255))
        elif action == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif action == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        else:
            del data[at:]
    return bytes(data)


@settings(max_examples=1500, deadline=None)
@given(data=st.data(), reframe=st.booleans())
def test_byte_mutations_of_a_valid_mailbox_raise_only_the_documented_errors(published, data, reframe) -> None:
    """Flipped, inserted, deleted bytes anywhere; with ``reframe`` the header's length is fixed up to match."""
    name, buf, original = published
    body = original[sharing._HEADER.size :]
    mutated = data.draw(_byte_mutations(body if reframe else original))
    patch = _no_unpickling()
    try:
        _overwrite(buf, _framed(mutated) if reframe else mutated)
        _attach_or_refuse(name)
    finally:
        patch.undo()
        _overwrite(buf, original)


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 70), 1 << 70)
    | st.sampled_from([0, 1, 2, 3, 4, 7, 8, 1024, 1 << 20, 1 << 40, 1 << 60, -1])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(["cpu", "cuda:0", "shm", "ipc", "float32", "HND", "mla", "AQID", "/torch_1"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)


_PLAUSIBLE = ["cpu", "cuda:0", "cuda:1", "shm", "ipc", "float32", "bfloat16", "float8_e5m2", "int8", "NHD", "HND"]
_PLAUSIBLE += ["kv", "mla", "AQID", "L3RvcmNoXzE=", "", "float64"]


def _tweaks(value: object) -> st.SearchStrategy:
    if isinstance(value, bool):
        return st.just(not value)
    if isinstance(value, int):
        return st.sampled_from([value + 1, value - 1, value * 2, value // 2, 0, 1 << 40, -value])
    if isinstance(value, str) or value is None:
        return st.sampled_from([*_PLAUSIBLE, None])
    return _json_values


def _slots(document: object, path: tuple = ()) -> list[tuple]:
    """Every (path) to a value inside ``document``, the root included."""
    found = [path]
    if isinstance(document, dict):
        for key, value in document.items():
            found += _slots(value, (*path, key))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            found += _slots(value, (*path, index))
    return found


@st.composite
def _json_mutations(draw, base: object) -> object:
    document = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_slots(document)[::-1]))  # leaves first, the root last
        if not path:
            document = draw(_json_values)
            continue
        parent = document
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["tweak", "tweak", "replace", "delete", "add", "duplicate"]))
        if action == "tweak":  # a plausible value of the same kind: the checks past the types
            parent[path[-1]] = draw(_tweaks(parent[path[-1]]))
        elif action == "replace":
            parent[path[-1]] = draw(_json_values)
        elif action == "delete":
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(_json_values)
        elif action == "duplicate" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[path[-1]]))
    return document


@settings(max_examples=2000, deadline=None)
@given(data=st.data(), base=st.sampled_from(["published", "ipc"]))
def test_json_mutations_of_a_valid_mailbox_raise_only_the_documented_errors(published, data, base) -> None:
    """Values replaced by any JSON, keys dropped or added, entries duplicated: in the real mailbox and in a
    CUDA IPC description (torch's rebuild is booby-trapped: no field set may reach it on a machine without
    that device)."""
    name, buf, original = published
    if base == "published":
        document = json.loads(original[sharing._HEADER.size :])
    else:
        document = {"caches": [_ipc_entry()]}
    mutated = data.draw(_json_mutations(document))
    patch = _no_unpickling()
    patch.setattr(torch.multiprocessing.reductions, "rebuild_cuda_tensor", _trap)
    patch.setattr(sharing, "_cuda_devices", lambda: 0)
    try:
        _overwrite(buf, _framed(json.dumps(mutated).encode()[: _FUZZ_REGION - 64]))
        _attach_or_refuse(name)
    finally:
        patch.undo()
        _overwrite(buf, original)


def test_the_fuzzed_mailbox_still_attaches_after_the_fuzz(published) -> None:
    """The fuzz restores the owner's mailbox after each example: the real publication is intact."""
    name, _buf, _original = published
    with attach_shared(name, timeout=1) as attached:
        assert [cache.spec for cache in attached.caches] == FUZZ_SPECS


@needs_dev_shm
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_something_else_under_the_mailbox_name_is_refused_without_blocking(kind) -> None:
    """Opening a FIFO for reading would wait for a writer forever: refused at once instead."""
    name = _name()
    path = SHM / f"kvblocks-{name}"
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    else:
        path.mkdir(mode=0o700)
    try:
        start = time.monotonic()
        with pytest.raises(ConfigError, match="not a plain segment"):
            attach_shared(name, timeout=2)
        assert time.monotonic() - start < 1
    finally:
        if kind == "fifo":
            path.unlink()
        else:
            path.rmdir()


@pytest.mark.parametrize("where", ["top", "entry"])
def test_a_key_given_twice_in_the_mailbox_is_refused(published, where: str) -> None:
    """Strict JSON: with a repeated key two readers could disagree on what the mailbox says (json.loads keeps
    the last value silently), so the mailbox is refused."""
    original = published[2]
    body = original[sharing._HEADER.size :].decode()
    document = json.loads(body)
    assert len(mailbox_fields._parse_mailbox(body.encode())) == len(document["caches"])  # the real body reads
    if where == "top":
        other = json.dumps(document["caches"][:1])
        doubled = body[:-1] + f', "caches": {other}}}'
    else:
        doubled = body.replace('"num_blocks": ', '"num_blocks": 1, "num_blocks": ', 1)
    with pytest.raises(ConfigError, match="repeats a key"):
        mailbox_fields._parse_mailbox(doubled.encode())
