"""A local layer group (sliding window, chunked local): its pool, index, tables and every rule it owns.

A local group's table has one entry per block position of the sequence; positions its window left hold
:data:`PLACEHOLDER` once released::

    block size 4, window 6; a sequence committed up to token 14 (next token: 14, attends 9..14)
    positions           0    1    2    3
    full table          5    6    7    8
    window table        -1   -1   3    9       blocks 0 and 1 left the window: released, still cached

The group answers the manager's questions the same way every group kind does (:class:`GroupManager`):
what it lacks for an admission and what it then keeps and takes, growth, what a commit caches and
releases, a sequence's release, integrity. The window formulas are its kind's
(:mod:`kvblocks.core.groups`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvblocks.core.groups.block_index import FlatBlockIndex
from kvblocks.core.groups.hits import GroupHitRule, needed_blocks
from kvblocks.core.groups.registry import GROUP_KIND_RULES, kind_rules
from kvblocks.errors import ConfigError, IntegrityError
from kvblocks.events import EventSink
from kvblocks.hashing import BlockHash
from kvblocks.pool import BlockPool

__all__ = ["PLACEHOLDER", "LocalGroup", "LocalGroupManager"]

PLACEHOLDER = -1
"""A local group's table entry for a position that left the window (the block was released)."""


@dataclass(frozen=True)
class LocalGroup:
    """One sliding-window or chunked-local layer group: its kind, window or chunk (tokens), and pool size.

    ``block_size`` (None: the manager's) must be a multiple of the manager's block size, the size the
    hash chain is cut at: a group block of ``r`` chain blocks is cached under the hash of its last one::

        manager block size 4, group block size 8 (r = 2)
        chain hashes     h0   h1   h2   h3          tokens 0..15
        group blocks     [ b0: h1 ] [ b1: h3 ]
    """

    kind: str
    span: int
    num_blocks: int
    block_size: int | None = None

    def __post_init__(self) -> None:
        if not kind_rules(self.kind).releases:
            local = ", ".join(repr(name) for name, rules in GROUP_KIND_RULES.items() if rules.releases)
            raise ConfigError(f"a local group is one of {local}, got {self.kind!r}")
        for what in ("span", "num_blocks", "block_size"):
            value = getattr(self, what)
            if what == "block_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"a local group's {what} must be a positive int, got {value!r}")


class _EveryNth(Sequence[BlockHash]):
    """Chain hashes ``r - 1, 2r - 1, ...``: the keys of a group whose blocks are ``r`` chain blocks long."""

    __slots__ = ("_hashes", "_ratio")

    def __init__(self, hashes: Sequence[BlockHash], ratio: int) -> None:
        self._hashes = hashes
        self._ratio = ratio

    def __len__(self) -> int:
        return len(self._hashes) // self._ratio

    def __getitem__(self, position: int) -> BlockHash:  # type: ignore[override]
        if position < 0:
            raise IndexError(position)  # only the manager reads it, with group positions >= 0
        return self._hashes[(position + 1) * self._ratio - 1]


class LocalGroupManager:
    """A local group: its rule, pool, index and the tables of admitted sequences (keyed by ``id(sequence)``).

    ``take_blocks(count)`` is how it gets new blocks: its own :meth:`take` (evicting idle cached ones), or
    what a tier stack puts there (the same, writing the evicted blocks back).
    """

    __slots__ = (
        "block_size",
        "index",
        "kind",
        "number",
        "pool",
        "ratio",
        "released",
        "rule",
        "span",
        "tables",
        "take_blocks",
    )

    def __init__(self, group: LocalGroup, chain_block_size: int, number: int, events: EventSink | None) -> None:
        block_size = group.block_size or chain_block_size
        if block_size % chain_block_size:
            raise ConfigError(
                f"a local group's block_size {block_size} must be a multiple of the manager's {chain_block_size}"
            )
        self.number = number  # the group's index in the manager
        self.rule = GroupHitRule(group.kind, block_size, group.span)  # type: ignore[arg-type]
        self.kind = self.rule.kind_rules  # the window formulas, once, in the kind
        self.span = group.span
        self.block_size = block_size
        self.ratio = block_size // chain_block_size  # chain blocks per group block
        self.pool = BlockPool(group.num_blocks)
        self.index = FlatBlockIndex(self.pool, events=events, group=number, group_kind=self.kind.event_name)
        self.tables: dict[int, list[int]] = {}  # id(_Sequence) -> table
        self.released: dict[int, int] = {}  # id(_Sequence) -> leading positions already released
        self.take_blocks: Callable[[int], list[int]] = self.take

    # ------------------------------------------------------------------ formulas

    def keys(self, hashes: Sequence[BlockHash]) -> Sequence[BlockHash]:
        """The group's block keys: position ``p`` -> the chain hash its block ends with."""
        return hashes if self.ratio == 1 else _EveryNth(hashes, self.ratio)

    def blocks_for(self, chain_blocks: int) -> int:
        """The group's table length when the full-attention table has ``chain_blocks`` blocks."""
        return -(-chain_blocks // self.ratio)

    def first_needed(self, next_token: int) -> int:
        """The first block position any token from ``next_token`` on attends to (its window's or chunk's start)."""
        return self.kind.first_needed(next_token, self.block_size, self.span)

    def next_move(self, next_token: int) -> int:
        """The smallest token count from which :meth:`first_needed` may exceed its value at ``next_token``."""
        return self.kind.next_move(next_token, self.block_size, self.span)

    def take(self, count: int) -> list[int]:
        pool = self.pool
        short = count - pool.num_fresh
        if short > 0:
            self.index.evict(short)
        return pool.take_fresh(count)

    # ------------------------------------------------------------------ hits

    def served(self, hashes: Sequence[BlockHash]) -> Callable[[int], bool]:
        """Whether block position ``p`` is cached on device (a hash past the known ones never is)."""
        keys = self.keys(hashes)
        count = len(keys)
        block_of = self.index._block_of  # the package's own index: read its table directly on this hot path

        def cached(position: int) -> bool:
            return position < count and keys[position] in block_of

        return cached

    def hit_blocks(self, hashes: Sequence[BlockHash], hit_tokens: int) -> list[int] | None:
        """The blocks a hit at ``hit_tokens`` keeps (those its window needs there), or None when the group
        does not hold them all. Pure."""
        window = needed_blocks(self.rule, hit_tokens)
        block_of = self.index._block_of.get  # the package's own index, read directly on the admission path
        if self.ratio == 1:  # keys are the chain's hashes: one C-level pass over the window
            kept = list(map(block_of, hashes[window.start : window.stop]))
        else:
            keys = self.keys(hashes)
            kept = [block_of(keys[p]) for p in window]
        return None if None in kept else kept  # type: ignore[return-value]

    # ------------------------------------------------------------------ admission and growth

    def admission(
        self, hashes: Sequence[BlockHash], hits: int, total: int, hit_tokens: int, encoder: int
    ) -> tuple[int, Any] | None:
        """(blocks short, what :meth:`take_admission` needs) for an admission of ``hits`` cached chain blocks
        (``hit_tokens`` tokens) growing to ``total`` chain blocks; None when the group no longer holds what the
        hit needs. Pure. Every group kind answers it: the manager asks every group, then every group takes."""
        kept = self.hit_blocks(hashes, hit_tokens)
        if kept is None:
            return None
        pool = self.pool
        need = self.blocks_for(total) - hits // self.ratio
        return need - (pool.num_free - pool.count_idle(kept)), kept

    def take_admission(self, key: int, hits: int, total: int, hit_tokens: int, kept: list[int]) -> None:
        """Keep the window blocks the hit needs, take the new ones (the caller checked the room)."""
        self.pool._acquire_valid(kept)
        cached = hits // self.ratio  # a hit ends on a boundary of every group (hit_step)
        first = cached - len(kept)
        table = [PLACEHOLDER] * first + kept
        new = self.blocks_for(total) - cached
        if new:
            table += self.take_blocks(new)
        self.tables[key] = table
        self.released[key] = first

    def growth_short(self, key: int, total: int) -> int:
        """Blocks the group lacks to grow the sequence's table to ``total`` chain blocks. Pure."""
        grow = (total if self.ratio == 1 else self.blocks_for(total)) - len(self.tables[key])
        return grow - self.pool.num_free

    def resize(self, key: int, total: int) -> None:
        """Grow (or shrink: a smaller lookahead) the table to ``total`` chain blocks; the surplus tail goes back."""
        table = self.tables[key]
        after = self.blocks_for(total)
        if after > len(table):
            table += self.take_blocks(after - len(table))
        elif after < len(table):
            surplus = table[after:]
            del table[after:]
            self.pool._release_valid(reversed(surplus))

    # ------------------------------------------------------------------ commit and release

    def committed(self, key: int, hashes: Sequence[BlockHash], before: int, n: int, cache: bool) -> None:
        """The sequence committed from ``before`` to ``n`` tokens: cache its newly full blocks (when ``cache``),
        then release what no token from ``n`` on attends to (cached if committed)."""
        table = self.tables[key]
        released = self.released
        done = released[key]
        if cache:  # a duplicate stays private; released positions are never indexed
            first_new = before // self.block_size
            self.index.insert_run(
                self.keys(hashes), table, first_new if first_new > done else done, n // self.block_size
            )
        first = self.first_needed(n)
        if first > done:
            leaving = table[done:first]  # blocks from `done` on (check_integrity), unless a role cut it back
            if PLACEHOLDER in leaving:
                leaving = [b for b in leaving if b != PLACEHOLDER]
            self.pool._release_valid(leaving)  # oldest first: they leave the window in that order
            table[done:first] = [PLACEHOLDER] * (first - done)
            released[key] = first

    def release(self, key: int) -> None:
        """The sequence leaves: the blocks it still holds go back, tail first."""
        table = self.tables.pop(key)
        held = table[self.released.pop(key) :]  # positions before are released (placeholders)
        if PLACEHOLDER in held:
            held = [b for b in held if b != PLACEHOLDER]
        held.reverse()
        self.pool._release_valid(held)

    # ------------------------------------------------------------------ checks

    def check_integrity(
        self,
        live: dict[int, tuple[object, int, int]],
        other_holders: Callable[[list[int]], None],
    ) -> None:
        """Pool and index agree, references equal the tables (plus ``other_holders``), every table is as long
        as the full one, and no block outside the window is held. ``live``: id(sequence) -> (sequence id,
        full-attention table length, the token its window is placed at)."""
        number = self.number
        pool = self.pool
        pool.check_integrity()
        self.index.check_integrity()
        expected = [0] * pool.num_blocks
        if set(self.tables) != set(live):
            raise IntegrityError(f"group {number} has tables for other sequences than the admitted ones")
        for key, table in self.tables.items():
            seq_id, chain_blocks, window_token = live[key]
            if len(table) != self.blocks_for(chain_blocks):
                raise IntegrityError(f"group {number}: {seq_id!r}'s table has {len(table)} positions")
            first = self.first_needed(window_token)
            for position, block in enumerate(table):
                if block == PLACEHOLDER:
                    if position >= first:
                        raise IntegrityError(f"group {number}: {seq_id!r} lost position {position} in its window")
                    continue
                if position < first:
                    raise IntegrityError(f"group {number}: {seq_id!r} holds position {position} outside its window")
                expected[block] += 1
        other_holders(expected)
        for block in range(pool.num_blocks):
            if pool.ref_count(block) != expected[block]:
                raise IntegrityError(f"group {number}: block {block} has {pool.ref_count(block)} references")
