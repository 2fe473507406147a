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

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvblocks.core.groups.block_index import FlatBlockIndex
from kvblocks.core.groups.hits import GroupHitRule, needed_blocks
from kvblocks.core.groups.protocol import Ask, GroupCopies
from kvblocks.core.groups.registry import GROUP_KIND_RULES, kind_rules
from kvblocks.core.groups.sources import DEVICE, HOST, REMOTE, STORED, GroupTiers, take_blocks
from kvblocks.errors import ConfigError, IntegrityError
from kvblocks.events import EventSink
from kvblocks.hashing import BlockHash
from kvblocks.pool import BlockPool

_Sources = tuple[int, list[tuple[int, int, int]], "Sequence[int] | None"]

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

    ``tiers`` (None: none) is the group's :class:`~kvblocks.tiers.stack.TierStack`: the blocks its index
    evicts move down to it, and it serves hits beside the device.
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
        "tiers",
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
        self.tiers: GroupTiers | None = None

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
        """``count`` fresh blocks, evicting idle cached ones (written back when the group has tiers)."""
        return take_blocks(self.pool, self.index, self.tiers, count)

    # ------------------------------------------------------------------ hits

    def served(self, hashes: Sequence[BlockHash]) -> Callable[[int], bool]:
        """Whether block position ``p`` is cached on device (a hash past the known ones never is)."""
        keys = self.keys(hashes)
        count = len(keys)
        block_of = self.index._block_of  # the package's own index: read its table directly on this hot path

        def cached(position: int) -> bool:
            return position < count and keys[position] in block_of

        return cached

    def held(self, hashes: Sequence[BlockHash]) -> Callable[[int], bool]:
        """Whether block position ``p`` is on device or in the group's tiers (a hit through tiers). Pure."""
        tiers = self.tiers
        if tiers is None:
            return self.served(hashes)
        keys = self.keys(hashes)
        count = len(keys)
        block_of = self.index._block_of
        holds = tiers.holds
        return lambda position: position < count and (keys[position] in block_of or holds(keys[position]))

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

    def admission(self, ask: Ask, remote: Sequence[int] | None) -> tuple[int, Any] | None:
        """(blocks short, what :meth:`take_admission` needs); None when the group no longer holds what the hit
        needs (on device, or in its tiers). Pure. Every group kind answers it: the manager asks every group,
        then every group takes.

        The window is placed at ``ask.window_token``: its positions below the hit are kept (on device),
        copied in (host, storage) or, for a handoff (``remote``: the group's table on the prefill node),
        copied from the prefill node where this node does not hold them; positions from the hit on are new
        (a handoff's are copied too)::

            block size 4, window 6, a handoff of a 17-token prompt, decode-side hit 8 tokens
            position       0    1    2    3    4
            window at 17   -    -    -    x    x      position 3 is past the hit: new, copied; 4 too
        """
        pool = self.pool
        if remote is None and self.tiers is None:  # the common case: every needed block is on device
            kept = self.hit_blocks(ask.hashes, ask.hit_tokens)
            if kept is None:
                return None
            need = self.blocks_for(ask.total) - ask.hits // self.ratio
            return need + ask.reserve - (pool.num_free - pool.count_idle(kept)), kept
        sources = self._sources(ask, remote)
        if sources is None:
            return None
        first, held, _ = sources
        kept = [block for _, block, where in held if where == DEVICE]
        fresh = self.blocks_for(ask.total) - max(first, ask.hits // self.ratio) + len(held) - len(kept)
        return fresh + ask.reserve - (pool.num_free - pool.count_idle(kept)), sources

    def _sources(self, ask: Ask, remote: Sequence[int] | None) -> _Sources | None:
        """(first position the window holds, (position, block, where) of each position below the hit it holds,
        ``remote``) for an admission through tiers or a handoff; None when a needed block is nowhere. Pure."""
        keys = self.keys(ask.hashes)
        first = self.first_needed(ask.window_token)
        block_of = self.index.block_of
        tiers = None if remote is not None else self.tiers  # a handoff is matched on device only
        held = []
        for position in range(first, ask.hits // self.ratio):
            key = keys[position]
            block = block_of(key)
            if block is not None:
                held.append((position, block, DEVICE))
                continue
            found = tiers.where(key) if tiers is not None else None
            if found is not None:
                held.append((position, found[1], found[0]))
            elif remote is not None:
                held.append((position, remote[position], REMOTE))
            else:
                return None
        return first, held, remote

    def take_admission(self, key: int, ask: Ask, prepared: Any) -> GroupCopies | None:
        """Keep the blocks the hit needs, take the new ones (the caller checked the room); the copies that
        fill the new ones (None when there are none)."""
        cached = ask.hits // self.ratio
        end = self.blocks_for(ask.total)
        if type(prepared) is list:  # every needed block on device
            kept: list[int] = prepared
            self.pool._acquire_valid(kept)
            first = cached - len(kept)
            table = [PLACEHOLDER] * first + kept
            if end > cached:
                table += self.take(end - cached)
            self.tables[key] = table
            self.released[key] = first
            return None
        sources: _Sources = prepared
        first, held, remote = sources
        self.pool._acquire_valid([block for _, block, where in held if where == DEVICE])
        from_host = [block for _, block, where in held if where == HOST]
        if from_host and self.tiers is not None:
            self.tiers.acquire_host(from_host)  # before an eviction can write back into the host tier
        start = max(first, cached)
        fresh = iter(self.take(end - start + sum(1 for *_, where in held if where != DEVICE)))
        table = [PLACEHOLDER] * first
        copies = GroupCopies()
        for position, block, where in held:
            if where == DEVICE:
                table.append(block)
                continue
            target = next(fresh)
            table.append(target)
            if where == HOST:
                copies.swaps.append((block, target, position))
            elif where == STORED:
                copies.loads.append((target, position))
            else:
                copies.moves.append((block, target))
        for position in range(start, end):
            target = next(fresh)
            table.append(target)
            if remote is not None:  # a handoff: the prompt's blocks come from the prefill node
                copies.moves.append((remote[position], target))
        self.tables[key] = table
        self.released[key] = first
        return copies if copies else None

    def growth_short(self, key: int, total: int) -> int:
        """Blocks the group lacks to grow the sequence's table to ``total`` chain blocks. Pure."""
        grow = (total if self.ratio == 1 else self.blocks_for(total)) - len(self.tables[key])
        return grow - self.pool.num_free

    def resize(self, key: int, total: int) -> None:
        """Grow (or shrink: a smaller lookahead) the table to ``total`` chain blocks; the surplus tail goes back."""
        table = self.tables[key]
        after = self.blocks_for(total)
        if after > len(table):
            table += self.take(after - len(table))
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
        tiers = self.tiers
        if cache and tiers is not None and tiers.writes_through:
            size = self.block_size
            tiers.written(self.index.block_of, self.keys(hashes), before // size, n // size)

    def release(self, key: int, defer: list[list[int]] | None = None) -> None:
        """The sequence leaves: the blocks it still holds go back, tail first (into ``defer`` instead, when a
        copy in flight still writes into them: released when that copy is reported)."""
        table = self.tables.pop(key)
        held = table[self.released.pop(key) :]  # positions before are released (placeholders)
        if PLACEHOLDER in held:
            held = [b for b in held if b != PLACEHOLDER]
        held.reverse()
        if defer is None:
            self.pool._release_valid(held)
        else:
            defer.append(held)

    def cut_back(self, key: int, hit: int, chain_block_size: int) -> None:
        """An admission's copies fell short: the table keeps what a hit of ``hit`` chain blocks needs; the rest
        (never committed) goes back."""
        table = self.tables[key]
        first = self.first_needed(hit * chain_block_size)
        end = self.blocks_for(hit)
        leaving = [b for b in table[:first] if b != PLACEHOLDER]
        dropped = [b for b in reversed(table[end:]) if b != PLACEHOLDER]
        table[:] = [PLACEHOLDER] * first + table[first:end]
        self.pool._release_valid(leaving)
        self.pool._release_valid(dropped)
        self.released[key] = first

    def index_landed(self, key: int, hashes: Sequence[BlockHash], committed: int) -> None:
        """An admission's copies landed: the blocks it holds below ``committed`` tokens become findable."""
        self.index.insert_run(self.keys(hashes), self.tables[key], self.released[key], committed // self.block_size)

    # ------------------------------------------------------------------ checks

    def check_integrity(self, live: dict[int, tuple[object, int, int]], other_holders: Iterable[Iterable[int]]) -> None:
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
        for order in other_holders:
            for block in order:
                expected[block] += 1
        for block in range(pool.num_blocks):
            if pool.ref_count(block) != expected[block]:
                raise IntegrityError(f"group {number}: block {block} has {pool.ref_count(block)} references")
