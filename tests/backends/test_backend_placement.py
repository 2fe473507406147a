"""The one placement decision, and publishing/attaching caches in one process and across two."""

from __future__ import annotations

import inspect
import itertools
import multiprocessing
import threading
import time
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks.backends import CacheRegistry, CPUBackend, KVCacheSpec, attach_shared, plan_placement, publish_shared
from kvblocks.backends.placement import ROLES
from kvblocks.errors import AttachTimeoutError, ConfigError
from kvblocks.tiers import FileStorage, MemoryStorage

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
HOST_TIERS = [0, 1, 4096]
STORAGE = [None, "file:///var/kv", "redis://127.0.0.1:6379", object(), MemoryStorage()]
"""Configured (anything but None) or not; the empty MemoryStorage is falsy, and still a backend."""


# ---------------------------------------------------------------- the rule


def test_runner_creates_in_the_plain_case_and_attaches_otherwise() -> None:
    plain = plan_placement("mixed", profiling=False, num_host_blocks=0, storage_backend=None)
    assert (plain.create_in_runner, plain.cache_process, plain.attacher) == (True, False, None)
    for kwargs in (
        {"role": "prefill", "num_host_blocks": 0, "storage_backend": None},
        {"role": "decode", "num_host_blocks": 0, "storage_backend": None},
        {"role": "mixed", "num_host_blocks": 8, "storage_backend": None},
        {"role": "mixed", "num_host_blocks": 0, "storage_backend": "file"},
    ):
        placement = plan_placement(profiling=False, **kwargs)
        assert not placement.create_in_runner and placement.attacher == "runner" and placement.publish
        assert "runner attaches" in placement.reason


def test_profiling_runner_allocates_privately() -> None:
    placement = plan_placement("decode", profiling=True, num_host_blocks=8, storage_backend="file")
    assert placement.create_in_runner and not placement.publish and placement.attacher is None
    assert "profiling" in placement.reason
    assert placement.action("cache_process") == "idle"


@pytest.mark.parametrize(
    "role, profiling, host, storage",
    list(itertools.product(ROLES, (False, True), HOST_TIERS, STORAGE)),
)
def test_exactly_one_creator_over_every_combination(role, profiling, host, storage) -> None:
    """Both parties read the same Placement: one creates, nobody waits on what is never published."""
    placement = plan_placement(role, profiling=profiling, num_host_blocks=host, storage_backend=storage)
    parties = ["runner"] + (["cache_process"] if placement.cache_process else [])
    actions = {party: placement.action(party) for party in parties}
    assert list(actions.values()).count("create") == 1
    attaching = [p for p, a in actions.items() if a == "attach"]
    assert attaching == ([] if placement.create_in_runner else ["runner"])
    assert placement.publish == bool(attaching)  # published iff someone attaches; profiling never publishes
    if profiling:
        assert actions["runner"] == "create" and not placement.publish
    expected_process = host > 0 or storage is not None or role != "mixed"
    assert placement.cache_process == expected_process


def _decision(placement) -> tuple[object, ...]:
    """What both parties act on (the reason names the backend, so it is left out)."""
    return (placement.create_in_runner, placement.cache_process, placement.publish, placement.creator)


@settings(max_examples=60, deadline=None)
@given(
    role=st.sampled_from(ROLES),
    profiling=st.booleans(),
    host=st.sampled_from(HOST_TIERS),
    kind=st.sampled_from(["memory", "file"]),
)
def test_placement_reads_the_configuration_not_what_the_storage_holds(
    tmp_path_factory, role, profiling, host, kind
) -> None:
    """An empty store is falsy (``__len__``): a runner deciding before the first write and a cache process
    deciding after it must still agree (FastDeploy #7420: one double-allocates or both wait)."""
    storage = MemoryStorage() if kind == "memory" else FileStorage(tmp_path_factory.mktemp("kv"))
    marker = plan_placement(role, profiling=profiling, num_host_blocks=host, storage_backend=object())
    before = plan_placement(role, profiling=profiling, num_host_blocks=host, storage_backend=storage)
    assert len(storage) == 0
    storage.put([("block-0", b"kv bytes")])
    assert len(storage) == 1
    after = plan_placement(role, profiling=profiling, num_host_blocks=host, storage_backend=storage)
    assert _decision(before) == _decision(after) == _decision(marker)
    assert before.cache_process  # a storage backend always means a cache process
    assert before.creator == ("runner" if profiling else "cache_process")


def test_an_empty_storage_backend_still_moves_creation_to_the_cache_process() -> None:
    placement = plan_placement("mixed", profiling=False, num_host_blocks=0, storage_backend=MemoryStorage())
    assert placement.creator == "cache_process" and placement.attacher == "runner" and placement.publish


@pytest.mark.parametrize("value", ["", "  ", False, True])
def test_a_storage_backend_that_reads_as_a_switch_is_refused(value) -> None:
    """By the rule "" or False would be a backend (not None), but surely meant none: refused, not guessed."""
    with pytest.raises(ConfigError, match="storage_backend"):
        plan_placement("mixed", profiling=False, num_host_blocks=0, storage_backend=value)


def test_the_device_never_enters_the_rule() -> None:
    assert list(inspect.signature(plan_placement).parameters) == [
        "role",
        "profiling",
        "num_host_blocks",
        "storage_backend",
    ]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"role": "both", "profiling": False, "num_host_blocks": 0, "storage_backend": None},
        {"role": "mixed", "profiling": 1, "num_host_blocks": 0, "storage_backend": None},
        {"role": "mixed", "profiling": False, "num_host_blocks": -1, "storage_backend": None},
        {"role": "mixed", "profiling": False, "num_host_blocks": 1.0, "storage_backend": None},
    ],
)
def test_bad_placement_inputs(kwargs) -> None:
    with pytest.raises(ConfigError):
        plan_placement(**kwargs)


# ---------------------------------------------------------------- in one process


def test_registry_attach_waits_for_publish_without_spinning() -> None:
    registry = CacheRegistry()
    cache = CPUBackend().allocate(SPEC, 4)
    got = []
    cpu_before = time.process_time()
    waiter = threading.Thread(target=lambda: got.append(registry.attach("kv", timeout=5)))
    waiter.start()
    time.sleep(0.3)
    assert not got  # still waiting
    registry.publish("kv", [cache])
    waiter.join(timeout=5)
    assert got and got[0][0] is cache
    assert time.process_time() - cpu_before < 0.2  # 0.3 s of waiting cost (almost) no CPU


def test_registry_timeout_and_refusals() -> None:
    registry = CacheRegistry()
    with pytest.raises(AttachTimeoutError, match="'nothing'"):
        registry.attach("nothing", timeout=0.05)
    cache = CPUBackend().allocate(SPEC, 2)
    registry.publish("kv", cache)
    with pytest.raises(ConfigError, match="already published"):
        registry.publish("kv", cache)
    with pytest.raises(ConfigError):
        registry.publish("other", [])
    registry.withdraw("kv")
    with pytest.raises(AttachTimeoutError):
        registry.attach("kv", timeout=0.01)


# ---------------------------------------------------------------- across two real processes


def _child_attach_and_write(name: str, result) -> None:
    shared = attach_shared(name, timeout=10)
    cache = shared.caches[0]
    result.put((cache.num_blocks, float(cache.key(1)[2, 0, 0, 0]), cache.spec.head_dim))
    cache.value(0)[3].fill_(7.0)  # the owner must see this: the pages are shared
    shared.close()
    result.put("written")


def test_cpu_caches_shared_between_processes() -> None:
    name = f"test-{uuid.uuid4().hex[:12]}"
    owner_cache = CPUBackend().allocate(SPEC, 6)
    owner_cache.key(1)[2].fill_(3.5)
    ctx = multiprocessing.get_context("spawn")
    result = ctx.Queue()
    child = ctx.Process(target=_child_attach_and_write, args=(name, result))
    child.start()  # the child starts waiting before anything is published
    time.sleep(0.2)
    with publish_shared(name, [owner_cache]) as shared:
        cache = shared.caches[0]
        assert result.get(timeout=30) == (6, 3.5, 8)
        assert result.get(timeout=30) == "written"
        child.join(timeout=30)
        assert child.exitcode == 0
        assert torch.all(cache.value(0)[3] == 7.0)
        assert torch.all(cache.value(0)[2] == 0.0)


def test_attach_shared_times_out_quickly_and_cheaply() -> None:
    cpu_before = time.process_time()
    start = time.monotonic()
    with pytest.raises(AttachTimeoutError, match=r"within 0\.3 s"):
        attach_shared(f"absent-{uuid.uuid4().hex[:8]}", timeout=0.3)
    assert 0.3 <= time.monotonic() - start < 2.0
    assert time.process_time() - cpu_before < 0.1  # sleeping back-off, not a spinning loop


def test_shared_names_are_checked_and_cleaned_up() -> None:
    cache = CPUBackend().allocate(SPEC, 2)
    with pytest.raises(ConfigError, match="name"):
        publish_shared("../etc", [cache])
    with pytest.raises(ConfigError):
        publish_shared("ok-name", [])
    name = f"test-{uuid.uuid4().hex[:12]}"
    shared = publish_shared(name, [cache])
    with pytest.raises(FileExistsError):
        publish_shared(name, [cache])
    shared.close()
    with pytest.raises(AttachTimeoutError):  # the owner's close unlinked everything
        attach_shared(name, timeout=0.05)
