"""Strict JSON for bytes that come from outside the process (event batches, handoffs).

:func:`json.loads` is not a safe decoder of untrusted bytes on its own: deep nesting
raises ``RecursionError``, an integer of more than 4300 digits a bare ``ValueError``,
bytes that are not UTF-8 are guessed to be UTF-16 or UTF-32, ``NaN`` is accepted and
a repeated key silently keeps its last value (two readers may disagree about what a
message said). :func:`parse` refuses all of these with one exception type, and
:func:`brief` names a bad value in an error message without walking all of it. A leading
byte order mark is ignored, as RFC 8259 allows (editors on Windows write one).
"""

from __future__ import annotations

import json
import reprlib
import sys
from typing import Any, TypeGuard

__all__ = ["MAX_INT", "StrictJSONError", "brief", "is_text", "parse", "parse_versioned"]

MAX_INT = 2**63 - 1
"""The largest count or number a wire format of kvblocks accepts (a signed 64-bit int: any engine can hold it)."""

_brief = reprlib.Repr()
_brief.maxlevel = 3
_brief.maxstring = 60
_brief.maxother = 60
_brief.maxlong = 60


class StrictJSONError(ValueError):
    """The bytes are not one strict JSON document; callers re-raise it as their own documented error."""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise StrictJSONError("a JSON object repeats a key")
    return out


def _constant(name: str) -> Any:
    raise StrictJSONError(f"{name} is not a JSON number")


def parse(data: object) -> Any:
    """One JSON document from UTF-8 ``data`` (bytes, bytearray, memoryview or str); raises only
    :class:`StrictJSONError`."""
    if not isinstance(data, bytes | bytearray | memoryview | str):
        raise StrictJSONError(f"expected bytes, got {type(data).__name__}")
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
        return json.loads(text, object_pairs_hook=_object, parse_constant=_constant)
    except StrictJSONError:
        raise
    except RecursionError:  # Python's words for it name the decoder's internals
        raise StrictJSONError("nested too deeply") from None
    except (ValueError, TypeError, MemoryError) as error:
        # ValueError covers bad UTF-8, bad JSON and an int beyond Python's digit limit.
        raise StrictJSONError(f"not valid JSON: {_reason(error)}") from None


def _reason(error: BaseException) -> str:
    if isinstance(error, ValueError) and "int_max_str_digits" in str(error):  # its advice is for a programmer
        return f"an integer of more than {sys.get_int_max_str_digits():,} digits"
    return brief(str(error))


def parse_versioned(data: object, what: str, version: int, error: type[Exception]) -> dict[str, Any]:
    """One strict JSON object whose ``"version"`` is ``version``; anything else raises ``error`` naming ``what``."""
    try:
        raw = parse(data)
    except StrictJSONError as e:
        raise error(f"{what}: {e}") from None
    if type(raw) is not dict:
        raise error(f"{what} must be a JSON object")
    found = raw.get("version")
    if type(found) is not int or found != version:
        raise error(f"{what} format version {brief(found)}; this kvblocks reads {version}")
    return raw


def brief(value: object) -> str:
    """A short repr of ``value``, safe for any parsed JSON (bounded depth and length)."""
    try:
        return _brief.repr(value)
    except (ValueError, RecursionError):  # pragma: no cover - ints beyond the digit limit do not parse
        return f"<{type(value).__name__}>"


def is_text(value: object) -> TypeGuard[str]:
    """Whether ``value`` is a str that encodes as UTF-8 (JSON escapes can smuggle lone surrogates)."""
    if type(value) is not str:
        return False
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
