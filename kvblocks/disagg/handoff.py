"""The handoff's wire format: :class:`PrefillHandoff` and its :class:`HandoffGroup` s, what a decode node
reads from another node's bytes (format versions, group kinds, parsing and validation)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, cast

from kvblocks.accounting import CachedTokens
from kvblocks.core.groups import kind_rules
from kvblocks.errors import AccountingError, HandoffError, InvalidBlockHashError
from kvblocks.hashing import BlockHash, hashes_from_json, hashes_to_json
from kvblocks.strict_json import MAX_INT, StrictJSONError, brief, is_text, parse

__all__ = [
    "GROUPS_HANDOFF_VERSION",
    "HANDOFF_GROUP_KINDS",
    "HANDOFF_VERSION",
    "LOCAL_GROUP_KINDS",
    "PLACEHOLDER",
    "HandoffGroup",
    "PrefillHandoff",
    "first_held_block",
]

HANDOFF_VERSION = 1
"""The format of a handoff without per-group tables (one group of full-attention layers)."""
GROUPS_HANDOFF_VERSION = 2
"""The format of a handoff that carries per-group tables: a reader of version 1 only, which would
ignore them and move the full-attention KV alone, refuses it instead."""
LOCAL_GROUP_KINDS = ("sliding_window", "chunked_local")
HANDOFF_GROUP_KINDS = (*LOCAL_GROUP_KINDS, "recurrent")
"""Kinds of the groups a handoff carries beside full attention: local groups' tables, recurrent groups' states."""
PLACEHOLDER = -1
"""A local group's entry for a block position the prefill node released (it left the window)."""


def _hashes_from_json(raw: object) -> tuple[BlockHash, ...]:
    try:
        return hashes_from_json(raw)
    except InvalidBlockHashError as e:
        raise HandoffError(f"{e} in handoff") from None


def first_held_block(kind: str, span: int, block_size: int, num_tokens: int) -> int:
    """The first block position a local group holds once ``num_tokens`` tokens are committed: the first
    any token from ``num_tokens`` on attends to (its window's or chunk's start). The hybrid manager's rule."""
    return kind_rules(kind).first_needed(num_tokens, block_size, span)


@dataclass(frozen=True)
class HandoffGroup:
    """A group's part of a handoff beside full attention.

    A local group: its kind, span (window or chunk, tokens) and, per block position of the prompt, the
    prefill node's block (:data:`PLACEHOLDER` where it was released: the decode node needs only the
    blocks of the window at the prompt's end). A recurrent group: kind ``"recurrent"``, span its
    checkpoint spacing (tokens), and one entry: the prefill node's state id holding the state after the
    whole prompt (a recurrent state is one per sequence, whatever its length)."""

    kind: str
    span: int
    blocks: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "span": self.span, "blocks": list(self.blocks)}

    @classmethod
    def from_json(cls, raw: object) -> HandoffGroup:
        if type(raw) is not dict or set(raw) != _GROUP_FIELDS:
            raise HandoffError(f"malformed handoff group: expected an object of kind, span, blocks, got {brief(raw)}")
        blocks = raw["blocks"]
        if type(blocks) is not list:
            raise HandoffError(f"malformed handoff group: blocks must be a list, got {brief(blocks)}")
        return cls(raw["kind"], raw["span"], tuple(blocks))

    def validate(self, num_prompt_tokens: int, block_size: int) -> None:
        """Kind known, span a positive count; a local group: one entry per prompt block, a block id exactly
        where the window at the prompt's end reaches, PLACEHOLDER before it; a recurrent group: one state id."""
        if not is_text(self.kind) or self.kind not in HANDOFF_GROUP_KINDS:
            raise HandoffError(
                f"handoff group kind must be one of {', '.join(HANDOFF_GROUP_KINDS)}, got {brief(self.kind)}"
            )
        if not _is_wire_count(self.span) or self.span == 0:
            raise HandoffError(f"handoff group span must be a positive int of at most 63 bits, got {brief(self.span)}")
        blocks = self.blocks
        if self.kind == "recurrent":
            if type(blocks) is not tuple or len(blocks) != 1 or not _is_wire_count(blocks[0]):
                raise HandoffError(f"a recurrent handoff group carries one state id (an int >= 0), got {brief(blocks)}")
            return
        total = -(-num_prompt_tokens // block_size)
        if type(blocks) is not tuple or len(blocks) != total:
            raise HandoffError(f"handoff group has {_length(blocks)} blocks for {total} prompt blocks")
        if not _are_wire_counts(blocks, PLACEHOLDER):
            raise HandoffError("handoff group blocks must be ints in -1..2**63-1")
        first = first_held_block(self.kind, self.span, block_size, num_prompt_tokens)
        if any(b == PLACEHOLDER for b in blocks[first:]) or any(b != PLACEHOLDER for b in blocks[:first]):
            raise HandoffError(
                f"handoff {self.kind} group of span {self.span}: positions from {first} on need a block, "
                f"those before it are released (PLACEHOLDER)"
            )

    @property
    def layout(self) -> tuple[str, int]:
        return (self.kind, self.span)


_GROUP_FIELDS = frozenset(("kind", "span", "blocks"))


def _length(value: object) -> str:
    return str(len(value)) if isinstance(value, tuple) else brief(value)


@dataclass(frozen=True)
class PrefillHandoff:
    """What a decode node needs to take over a prefilled request (serialisable with :meth:`to_bytes`).

    ``source_blocks`` cover the whole prompt, the partial last block included;
    ``block_hashes`` name its full blocks; ``cached`` is what the prefill node found cached.
    ``groups`` are the tables of a hybrid model's local groups 1, 2, ... (``source_blocks`` is group 0,
    full attention): empty for a model of full attention only, whose bytes are then format version 1
    exactly as before; a handoff with groups is format :data:`GROUPS_HANDOFF_VERSION`.
    """

    seq_id: str | int
    num_prompt_tokens: int
    block_hashes: tuple[BlockHash, ...]
    source_blocks: tuple[int, ...]
    cached: CachedTokens
    scheme: str
    block_size: int
    key_space: str
    version: int = HANDOFF_VERSION
    groups: tuple[HandoffGroup, ...] = ()

    def to_bytes(self) -> bytes:
        raw: dict[str, Any] = {
            "version": self.version,
            "seq_id": self.seq_id,
            "num_prompt_tokens": self.num_prompt_tokens,
            "block_hashes": hashes_to_json(self.block_hashes),
            "source_blocks": list(self.source_blocks),
            "cached": [self.cached.device, self.cached.host, self.cached.storage],
            "scheme": self.scheme,
            "block_size": self.block_size,
            "key_space": self.key_space,
        }
        if self.groups:
            raw["groups"] = [g.to_json() for g in self.groups]
        return json.dumps(raw, separators=(",", ":")).encode()

    @property
    def group_blocks(self) -> tuple[tuple[int, ...], ...]:
        """The prefill node's blocks per group, group 0 (``source_blocks``) first, then each of ``groups``
        (a local group's table with PLACEHOLDER where released; a recurrent group's one state id)."""
        return (self.source_blocks, *(g.blocks for g in self.groups))

    @property
    def group_layout(self) -> tuple[tuple[str, int], ...]:
        """(kind, span) of each local group (empty: full attention only)."""
        return tuple(g.layout for g in self.groups)

    @classmethod
    def from_bytes(cls, data: bytes) -> PrefillHandoff:
        """Parse a handoff; raises :class:`HandoffError` and nothing else.

        The bytes come from another node: anything but one strict JSON object in UTF-8
        (:func:`kvblocks.strict_json.parse`: bounded nesting, no repeated keys, no NaN), another
        format version, a field of a wrong type or out of range, or counts that do not fit
        together is refused.
        """
        raw = _parse_handoff(data)
        missing = _HANDOFF_FIELDS.difference(raw)
        if missing:
            raise HandoffError(f"malformed handoff: missing {', '.join(sorted(missing))}")
        prompt, cached, source = raw["num_prompt_tokens"], raw["cached"], raw["source_blocks"]
        if not _is_wire_count(prompt) or type(source) is not list:
            raise HandoffError("malformed handoff: num_prompt_tokens or source_blocks of a wrong type")
        if type(cached) is not list or len(cached) != 3 or not all(_is_wire_count(c) for c in cached):
            raise HandoffError(f"malformed handoff: cached must be 3 counts, got {brief(cached)}")
        try:
            cached_tokens = CachedTokens(*cached, num_prompt_tokens=prompt)
        except AccountingError as e:
            raise HandoffError(f"malformed handoff: {e}") from None
        handoff = cls(
            seq_id=raw["seq_id"],
            num_prompt_tokens=prompt,
            block_hashes=_hashes_from_json(raw["block_hashes"]),
            source_blocks=tuple(source),
            cached=cached_tokens,
            scheme=raw["scheme"],
            block_size=raw["block_size"],
            key_space=raw["key_space"],
            version=raw["version"],
            groups=_groups_from_json(raw),
        )
        handoff.validate()
        return handoff

    def validate(self) -> None:
        """Types, counts, block ids, hashes against the prompt length (checked once per object)."""
        if self.__dict__.get("_validated"):
            return
        if not (is_text(self.seq_id) or type(self.seq_id) is int):
            raise HandoffError(f"handoff seq_id must be a str or an int, got {brief(self.seq_id)}")
        for name in ("num_prompt_tokens", "block_size"):
            value = getattr(self, name)
            if not _is_wire_count(value) or value == 0:
                raise HandoffError(f"handoff {name} must be a positive int of at most 63 bits, got {brief(value)}")
        for name in ("scheme", "key_space"):
            if not is_text(getattr(self, name)):
                raise HandoffError(f"handoff {name} must be a str, got {brief(getattr(self, name))}")
        if type(self.groups) is not tuple or not all(isinstance(g, HandoffGroup) for g in self.groups):
            raise HandoffError(f"handoff groups must be a tuple of HandoffGroup, got {brief(self.groups)}")
        expected = GROUPS_HANDOFF_VERSION if self.groups else HANDOFF_VERSION
        if type(self.version) is not int or self.version != expected:
            raise HandoffError(
                f"handoff format version {brief(self.version)}; a handoff "
                f"{'with' if self.groups else 'without'} per-group tables is version {expected}"
            )
        size = self.block_size
        if len(self.block_hashes) != self.num_prompt_tokens // size:
            raise HandoffError(
                f"handoff names {len(self.block_hashes)} full blocks for {self.num_prompt_tokens} tokens of {size}"
            )
        if len(self.source_blocks) != -(-self.num_prompt_tokens // size):
            raise HandoffError(
                f"handoff has {len(self.source_blocks)} source blocks for {self.num_prompt_tokens} tokens"
            )
        if not _are_wire_counts(self.source_blocks):
            raise HandoffError("handoff source blocks must be ints in 0..2**63-1")
        if not isinstance(self.cached, CachedTokens) or self.cached.num_prompt_tokens != self.num_prompt_tokens:
            raise HandoffError("handoff cached tokens must be a CachedTokens of the same prompt")
        for group in self.groups:
            group.validate(self.num_prompt_tokens, size)
        object.__setattr__(self, "_validated", True)  # immutable: once sound, always sound


_HANDOFF_FIELDS = frozenset(
    ("seq_id", "num_prompt_tokens", "block_hashes", "source_blocks", "cached", "scheme", "block_size", "key_space")
)


def _parse_handoff(data: object) -> dict[str, Any]:
    """One strict JSON object of a known handoff format version (1, or 2 with per-group tables)."""
    try:
        raw = parse(data)
    except StrictJSONError as e:
        raise HandoffError(f"handoff: {e}") from None
    if type(raw) is not dict:
        raise HandoffError("handoff must be a JSON object")
    found = raw.get("version")
    if type(found) is not int or found not in (HANDOFF_VERSION, GROUPS_HANDOFF_VERSION):
        raise HandoffError(
            f"handoff format version {brief(found)}; this kvblocks reads {HANDOFF_VERSION} and {GROUPS_HANDOFF_VERSION}"
        )
    return raw


def _groups_from_json(raw: dict[str, Any]) -> tuple[HandoffGroup, ...]:
    """Version 2 carries a non-empty list of groups; version 1 none (validate checks the pairing)."""
    if "groups" not in raw:
        return ()
    groups = raw["groups"]
    if type(groups) is not list or not groups:
        raise HandoffError(f"malformed handoff: groups must be a non-empty list, got {brief(groups)}")
    return tuple(HandoffGroup.from_json(g) for g in groups)


def _is_wire_count(value: object) -> bool:
    """An int in ``0..MAX_INT``: what a count or block id on the wire may be (no bools, floats or absurd sizes)."""
    return type(value) is int and 0 <= value <= MAX_INT


def _are_wire_counts(values: tuple[object, ...], lowest: int = 0) -> bool:
    """Whether every value is an int (no bool) in ``lowest..MAX_INT``: one C pass per check, not a call per value."""
    if not values:
        return True
    if set(map(type, values)) != {int}:
        return False
    ints = cast("tuple[int, ...]", values)
    return lowest <= min(ints) and max(ints) <= MAX_INT
