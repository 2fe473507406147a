"""docs/configuration.md documents every configuration field, with the default the code really has.

Each configuration class (or constructor) has a section whose heading names it by its dotted path in
backticks, and a table under it with one row per field::

    | `field` | type | `default` or **required** | meaning and valid values | raised when invalid |

The tests fail when a field (or keyword parameter) is added without a row, when a row documents a field
that no longer exists, and when a default changes without its row changing.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

DATACLASSES = [
    "kvblocks.config.CacheConfig",
    "kvblocks.tiers.config.TierConfig",
    "kvblocks.disagg.DisaggConfig",
    "kvblocks.routing.RouterConfig",
    "kvblocks.backends.spec.KVCacheSpec",
    "kvblocks.hybrid.LocalGroup",
    "kvblocks.hybrid.RecurrentGroup",
    "kvblocks.hybrid.CrossAttentionGroup",
]
CALLABLES = [
    "kvblocks.tiers.FileStorage",
    "kvblocks.tiers.RedisStorage",
    "kvblocks.tiers.MemoryStorage",
    "kvblocks.tiers.writer.AsyncWriter",
    "kvblocks.backends.spec.KVCacheSpec.mla",
]

REQUIRED = "**required**"
HEADING = re.compile(r"^(#{1,6})\s+(.*\S)\s*$")
CELL_SPLIT = re.compile(r"(?<!\\)\|")  # a cell may hold an escaped pipe: \|
FIELD_CELL = re.compile(r"^`([A-Za-z_]\w*)`$")


class Required:
    """The documented or real default of a field that has none."""

    def __repr__(self) -> str:
        return "<required>"


REQUIRED_DEFAULT = Required()


def resolve(dotted: str) -> Any:
    """The object named by ``dotted``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def sections(text: str) -> list[tuple[str, str]]:
    """``(heading, body)`` for every heading outside code fences; a body runs to the next heading of any level."""
    found: list[tuple[str, list[str]]] = []
    in_fence = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        elif in_fence:
            continue
        elif match := HEADING.match(line):
            found.append((match.group(2), []))
        elif found:
            found[-1][1].append(line)
    return [(heading, "\n".join(lines)) for heading, lines in found]


def section_of(dotted: str) -> str:
    """The body of the one section whose heading names ``dotted`` in backticks."""
    matches = [body for heading, body in sections(PAGE.read_text()) if f"`{dotted}`" in heading]
    assert len(matches) == 1, f"docs/configuration.md needs exactly one heading naming `{dotted}`, found {len(matches)}"
    return matches[0]


def parse_default(cell: str, where: str) -> Any:
    if cell == REQUIRED:
        return REQUIRED_DEFAULT
    if len(cell) >= 2 and cell[0] == cell[-1] == "`":
        try:
            return ast.literal_eval(cell[1:-1])
        except (ValueError, SyntaxError):
            pytest.fail(f"{where}: default {cell} is not a Python literal")
    pytest.fail(f"{where}: default cell {cell!r} is neither `literal` nor {REQUIRED}")


def documented(dotted: str) -> dict[str, Any]:
    """Field name -> documented default, from the table rows of ``dotted``'s section."""
    rows: dict[str, Any] = {}
    for line in section_of(dotted).splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in CELL_SPLIT.split(line.strip("|"))]
        match = FIELD_CELL.match(cells[0])
        if not match:
            continue  # the header row, the separator row
        name = match.group(1)
        where = f"{dotted} row `{name}`"
        assert len(cells) == 5, f"{where}: expected 5 cells (field, type, default, meaning, error), got {len(cells)}"
        assert name not in rows, f"{where}: documented twice"
        assert all(cells[1:]), f"{where}: a cell is empty"
        rows[name] = parse_default(cells[2], where)
    return rows


def dataclass_defaults(cls: type) -> dict[str, Any]:
    """Field name -> real default; fields with a default_factory are left out of the comparison."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = None  # documented, default not compared
        else:
            out[f.name] = REQUIRED_DEFAULT
    return out


def factory_fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.default_factory is not dataclasses.MISSING}


def parameter_defaults(fn: Callable[..., Any]) -> dict[str, Any]:
    """Keyword-passable parameter -> real default (``self``, ``cls``, ``*args`` and ``**kwargs`` excluded)."""
    target = fn.__init__ if inspect.isclass(fn) else fn
    out = {}
    for name, p in inspect.signature(target).parameters.items():
        if name in ("self", "cls") or p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            continue
        out[name] = REQUIRED_DEFAULT if p.default is p.empty else p.default
    return out


def check(dotted: str, real: dict[str, Any], skip_default: set[str]) -> None:
    body = section_of(dotted)
    docs = documented(dotted)
    for name in real:
        assert f"`{name}`" in body, f"`{name}` of {dotted} is not mentioned in its section"
    assert not set(real) - set(docs), f"{dotted}: no table row for {sorted(set(real) - set(docs))}"
    assert not set(docs) - set(real), f"{dotted}: rows for names it does not have: {sorted(set(docs) - set(real))}"
    for name, value in real.items():
        if name in skip_default:
            continue
        shown = docs[name]
        assert repr(shown) == repr(value), (
            f"{dotted}.{name}: docs/configuration.md says the default is {shown!r}, the code has {value!r}"
        )


@pytest.mark.parametrize("dotted", DATACLASSES)
def test_every_dataclass_field_is_documented_with_its_default(dotted: str) -> None:
    cls = resolve(dotted)
    assert dataclasses.is_dataclass(cls), f"{dotted} is not a dataclass"
    check(dotted, dataclass_defaults(cls), factory_fields(cls))


@pytest.mark.parametrize("dotted", CALLABLES)
def test_every_constructor_parameter_is_documented_with_its_default(dotted: str) -> None:
    check(dotted, parameter_defaults(resolve(dotted)), set())


def test_every_policy_value_is_explained() -> None:
    from kvblocks.tiers import HOST_POLICIES, STORAGE_POLICIES

    body = section_of("HOST_POLICIES")
    assert section_of("STORAGE_POLICIES") == body, "one section explains both policy tuples"
    values = set()
    for line in body.splitlines():
        cells = [c.strip() for c in CELL_SPLIT.split(line.strip().strip("|"))]
        if line.strip().startswith("|") and re.fullmatch(r'`"[^"]*"`', cells[0]):
            assert len(cells) == 3 and all(cells), f"policy row {cells[0]} needs a host and a storage meaning"
            values.add(ast.literal_eval(cells[0][1:-1]))
    assert values == set(HOST_POLICIES) | set(STORAGE_POLICIES)


def test_the_parser_sees_what_it_should() -> None:
    """Guards the test itself: a parser that found nothing would pass everything."""
    assert documented("kvblocks.config.CacheConfig")["num_blocks"] is REQUIRED_DEFAULT
    assert documented("kvblocks.config.CacheConfig")["hash_scheme"] == "xxh3-128"
    assert documented("kvblocks.tiers.config.TierConfig")["storage_timeout_s"] == 5.0
    assert documented("kvblocks.routing.RouterConfig")["tier_weights"][0] == ("device", 1.0)
    assert len(documented("kvblocks.tiers.writer.AsyncWriter")) == 5
    with pytest.raises(pytest.fail.Exception):
        parse_default("5", "example")
    assert repr(parse_default("`5`", "example")) != repr(5.0)  # an int documented for a float default fails
