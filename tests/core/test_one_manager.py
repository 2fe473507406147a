"""One manager: no class in kvblocks subclasses KVCacheManager except the role facades, which add only their role's
calls and override nothing; no code checks whether a method was overridden; the previous release's class names
build the one manager."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import kvblocks
import kvblocks.presets
from kvblocks import CacheConfig, DecodeManager, DisaggConfig, KVCacheManager, PrefillManager, manager_for_role
from kvblocks.hybrid import LocalGroup
from kvblocks.tiers import TierConfig

ROOT = Path(kvblocks.__file__).parent
# What a facade may define besides its role's calls: its class's role, the role component it owns, and (the
# decode role's reserve) a constructor that passes its configuration on.
FACADE_PARTS = {"role", "_role_component", "__init__", "__doc__", "__module__", "__qualname__", "__annotations__"}
ROLE_CALLS = {
    PrefillManager: {"finish_prefill", "is_transferring", "num_transferring", "transfer_done", "_prefill"},
    DecodeManager: {
        "accept_handoff",
        "decode_counters",
        "is_receiving",
        "num_running",
        "receive_done",
        "reserve_blocks",
        "usage",
        "_decode",
    },
}


def _importable_modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages([str(ROOT)], "kvblocks."):
        if info.name.endswith("__main__"):  # running it is the command line
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:  # an extra this environment lacks (vLLM): its source is checked below
            continue
        names.append(info.name)
    return names


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


def test_only_the_role_facades_subclass_the_manager() -> None:
    assert len(_importable_modules()) > 100
    subclasses = {c for c in _subclasses(KVCacheManager) if c.__module__.startswith("kvblocks")}
    assert subclasses == {PrefillManager, DecodeManager}


def test_no_class_in_the_source_names_a_manager_class_as_its_base() -> None:
    """The same, from the source (modules whose extras are missing included): the only ``class X(...)`` whose
    bases name a manager are the two facades, and they name KVCacheManager itself."""
    managers = {"KVCacheManager", "PrefillManager", "DecodeManager"}
    found = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if bases & managers:
                    found.append((path.relative_to(ROOT).as_posix(), node.name, sorted(bases)))
    assert sorted(found) == [
        ("disagg/decode.py", "DecodeManager", ["KVCacheManager"]),
        ("disagg/prefill.py", "PrefillManager", ["KVCacheManager"]),
    ]


@pytest.mark.parametrize("facade", [PrefillManager, DecodeManager])
def test_a_role_facade_adds_only_its_role_s_calls_and_overrides_nothing(facade: type) -> None:
    own = set(vars(facade))
    assert own - FACADE_PARTS == ROLE_CALLS[facade] - {"_prefill", "_decode"}
    overridden = {name for name in own - FACADE_PARTS if hasattr(KVCacheManager, name)}
    assert overridden == set()
    if "__init__" in own:  # only to pass the role's configuration on: the manager's own setup does the rest
        source = inspect.getsource(vars(facade)["__init__"])
        assert "super().__init__(" in source and source.count("\n") < 8


def test_nothing_checks_whether_a_method_was_overridden() -> None:
    """No ``type(self).m is not Base.m`` (or ``is``) between two attributes of one name: a part is asked,
    never detected."""
    suspects = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare) or not any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                continue
            sides = [node.left, *node.comparators]
            names = [s.attr for s in sides if isinstance(s, ast.Attribute)]
            if len(names) == 2 and names[0] == names[1]:
                suspects.append((path.relative_to(ROOT).as_posix(), node.lineno, names[0]))
    assert suspects == []


@pytest.mark.parametrize(
    ("name", "facade", "tiered", "hybrid"),
    [
        ("TieredKVCacheManager", KVCacheManager, True, False),
        ("HybridKVCacheManager", KVCacheManager, False, True),
        ("TieredHybridKVCacheManager", KVCacheManager, True, True),
        ("TieredPrefillManager", PrefillManager, True, False),
        ("TieredDecodeManager", DecodeManager, True, False),
        ("HybridPrefillManager", PrefillManager, False, True),
        ("HybridDecodeManager", DecodeManager, False, True),
        ("TieredHybridPrefillManager", PrefillManager, True, True),
        ("TieredHybridDecodeManager", DecodeManager, True, True),
    ],
)
def test_the_previous_names_build_the_one_manager_and_answer_isinstance_by_parts(
    name: str, facade: type, tiered: bool, hybrid: bool
) -> None:
    preset = getattr(kvblocks.presets, name)
    assert not issubclass(preset, KVCacheManager)
    options: dict[str, object] = {}
    if tiered:
        options["tiers"] = TierConfig(num_host_blocks=4)
    if hybrid:
        options["local_groups"] = [LocalGroup("sliding_window", span=6, num_blocks=8)]
    m = preset(8, 4, **options)
    assert type(m) is facade and isinstance(m, preset)
    assert (m.tiers is not None) == tiered and (m.num_groups > 1) == hybrid
    built = manager_for_role(
        CacheConfig(8, 4),
        DisaggConfig(role=facade.role),
        tiers=options.get("tiers"),  # type: ignore[arg-type]
        groups=options.get("local_groups", ()),  # type: ignore[arg-type]
    )
    assert type(built) is facade and isinstance(built, preset)
    assert not isinstance(facade(8, 4), preset)  # a manager without the parts is not one
    m.close()
    built.close()


@pytest.mark.parametrize("role", ["mixed", "prefill", "decode"])
@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("tiered", [False, True])
def test_a_dropped_manager_is_freed_at_once_whatever_its_parts(role: str, hybrid: bool, tiered: bool) -> None:
    """No part keeps a reference back to its manager (a role gets the manager with each call), so a manager an
    engine drops is freed by reference counting alone, as a cache of many blocks should be."""
    import gc
    import weakref

    from kvblocks.events import EventSink

    tiers = TierConfig(num_host_blocks=4) if tiered else None
    groups = [LocalGroup("sliding_window", span=6, num_blocks=8)] if hybrid else []
    m = manager_for_role(CacheConfig(8, 4), DisaggConfig(role=role), tiers=tiers, groups=groups, event_sink=EventSink())
    m.add_sequence("a", list(range(9)))
    if role != "decode":
        assert m.allocate("a", 9) is not None
    gone = weakref.ref(m)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del m
        assert gone() is None
    finally:
        if enabled:
            gc.enable()
