"""A local layer group (sliding window, chunked local, ...): its pool, index, tables and every rule it owns.

A local group's table has one entry per block position of the sequence; positions its kind releases
hold :data:`PLACEHOLDER`::

    block size 4, window 6; a sequence committed up to token 14 (next token: 14, attends 9..14)
    positions           0    1    2    3
    full table          5    6    7    8
    window table        -1   -1   3    9       blocks 0 and 1 left the window: released, still cached

Which positions are released is the kind's to say (:meth:`~kvblocks.core.groups.KindRules.released`, as
sorted ranges): a leading run for a window, the gap between the prompt and the window for a
retained-prefix window. Per sequence the group keeps the positions it released
(:attr:`LocalGroupManager.released`) and the prompt the kind's formulas may need; a kind may keep fewer
entries than positions (a circular buffer: one). A tiered admission whose copies fall short cuts a table
back with :meth:`LocalGroupManager.cut_back`.

The group answers the manager's questions the same way every group kind does (:class:`GroupManager`):
what it lacks for an admission and what it then keeps and takes, growth, what a commit caches and
releases, a sequence's release, integrity. The formulas are its kind's (:mod:`kvblocks.core.groups`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast, overload

from kvblocks.core.groups.block_index import FlatBlockIndex
from kvblocks.core.groups.hits import GroupHitRule, needed_blocks
from kvblocks.core.groups.protocol import Ask, GroupCopies
from kvblocks.core.groups.registry import GROUP_KIND_RULES, kind_rules
from kvblocks.core.groups.rules import Positions, covers, minus, union
from kvblocks.core.groups.sources import DEVICE, HOST, REMOTE, STORED, GroupTiers, take_blocks
from kvblocks.core.pool import BlockPool
from kvblocks.errors import ConfigError, IntegrityError
from kvblocks.events import EventSink
from kvblocks.hashing import BlockHash

__all__ = ["PLACEHOLDER", "LocalGroup", "LocalGroupManager"]

PLACEHOLDER = -1
"""A local group's table entry for a position its kind released (it left the window)."""


@dataclass(frozen=True)
class LocalGroup:
    """One local layer group: its kind (sliding window, chunked local, ...), span (window or chunk, tokens) and
    pool size.

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
        if not kind_rules(self.kind).local:
            local = ", ".join(repr(name) for name, rules in GROUP_KIND_RULES.items() if rules.local)
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

    @overload
    def __getitem__(self, position: int) -> BlockHash: ...
    @overload
    def __getitem__(self, position: slice) -> Sequence[BlockHash]: ...
    def __getitem__(self, position: int | slice) -> BlockHash | Sequence[BlockHash]:
        if isinstance(position, slice):
            return [self[p] for p in range(*position.indices(len(self)))]
        if position < 0:
            raise IndexError(position)  # only the manager reads it, with group positions >= 0
        return self._hashes[(position + 1) * self._ratio - 1]


@dataclass(slots=True)
class _Plan:
    """What an admission found, for :meth:`LocalGroupManager.take_admission`: the table's length, the positions
    it leaves released (and those of them only the one pass explains), the new positions, and the blocks the
    positions below the hit come from: kept on device (``kept``, at ``window``), or ``held`` through tiers or
    a handoff ((position, block, where); ``remote`` the prefill node's table)."""

    length: int
    gone: Positions
    inflight: Positions
    fresh: Positions
    prompt: int | None
    kept: list[int] = field(default_factory=list)
    window: range = range(0)
    held: list[tuple[int, int, int]] | None = None
    remote: Sequence[int] | None = None


class LocalGroupManager:
    """A local group: its rule, pool, index and the tables of admitted sequences (keyed by ``id(sequence)``).

    ``tiers`` (None: none) is the group's :class:`~kvblocks.tiers.stack.TierStack`: the blocks its index
    evicts move down to it, and it serves hits beside the device.
    """

    __slots__ = (
        "_inflight",
        "_prompts",
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
        self.rule = GroupHitRule(group.kind, block_size, group.span)
        self.kind = self.rule.kind_rules  # the formulas, once, in the kind
        if not self.kind.prefix_cached and block_size != chain_block_size:
            raise ConfigError(
                f"a {group.kind} group is never prefix-cached and takes no block_size of its own, got {block_size}"
            )
        self.span = group.span
        self.block_size = block_size
        self.ratio = block_size // chain_block_size  # chain blocks per group block
        self.pool = BlockPool(group.num_blocks)
        self.index = FlatBlockIndex(self.pool, events=events, group=number, group_kind=self.kind.event_name)
        self.tables: dict[int, list[int]] = {}  # id(_Sequence) -> table
        self.released: dict[int, Positions] = {}
        """id(sequence) -> the positions it released (PLACEHOLDER there): read it, change it through the group.
        Replaced, not changed, when it releases more: an unchanged object means nothing was released since."""
        self._prompts: dict[int, int | None] = {}  # id(_Sequence) -> the tokens it knew when admitted
        self._inflight: dict[int, Positions] = {}  # id(_Sequence) -> positions a one-pass admission never took
        self.tiers: GroupTiers | None = None

    # ------------------------------------------------------------------ formulas

    def keys(self, hashes: Sequence[BlockHash]) -> Sequence[BlockHash]:
        """The group's block keys: position ``p`` -> the chain hash its block ends with."""
        return hashes if self.ratio == 1 else _EveryNth(hashes, self.ratio)

    def table_length(self, chain_blocks: int) -> int:
        """A sequence's table length when the full-attention table has ``chain_blocks`` blocks (one entry per
        position, unless the kind keeps fewer)."""
        entries = self.kind.table_entries
        return -(-chain_blocks // self.ratio) if entries is None else entries

    def next_move(self, next_token: int) -> int:
        """The smallest token count from which the positions released at ``next_token`` may grow."""
        return self.kind.next_move(next_token, self.block_size, self.span)

    def take(self, count: int) -> list[int]:
        """``count`` fresh blocks, evicting idle cached ones (written back when the group has tiers)."""
        pool = self.pool
        return pool.take_fresh(count) if count <= len(pool._fresh) else take_blocks(pool, self.index, self.tiers, count)

    # ------------------------------------------------------------------ a sequence's positions

    def require_block_per_position(self, what: str) -> None:
        """Raise :class:`ConfigError` unless the kind's tables hold one entry per position: ``what`` serves only
        those (it copies blocks position by position)."""
        if self.kind.table_entries is not None:
            raise ConfigError(f"{what} does not serve {self.kind.name} groups: their tables are not a block a position")

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
        return None if None in kept else cast("list[int]", kept)

    # ------------------------------------------------------------------ admission and growth

    def admission(self, ask: Ask, remote: Sequence[int] | None) -> tuple[int, Any] | None:
        """(blocks short, what :meth:`take_admission` needs); None when the group no longer holds what the hit
        needs (on device, or in its tiers). Pure. Every group kind answers it: the manager asks every group,
        then every group takes.

        The window is placed at ``ask.window_token``: the positions its kind releases there are not taken (an
        admission's one pass, through ``ask.prompt`` and ``ask.covered``, may leave more: the kind says),
        those below the hit are kept (on device), copied in (host, storage) or, for a handoff (``remote``: the
        group's table on the prefill node), copied from the prefill node where this node does not hold them;
        the others are new (a handoff's are copied too)::

            block size 4, window 6, a handoff of a 17-token prompt, decode-side hit 8 tokens
            position       0    1    2    3    4
            window at 17   -    -    -    x    x      position 3 is past the hit: new, copied; 4 too
        """
        kind = self.kind
        size = self.block_size
        prompt = ask.prompt
        length = self.table_length(ask.total)
        pool = self.pool
        if remote is None and self.tiers is None and kind.leading and not kind.one_pass:  # a window's admission
            kept = self.hit_blocks(ask.hashes, ask.hit_tokens)  # the hit's window, all on device, or None
            if kept is None:
                return None
            cached = ask.hits // self.ratio
            first = cached - len(kept)  # the positions before the hit's window are released
            fresh: Positions = (range(cached, length),) if length > cached else ()
            plan = _Plan(length, (range(0, first),) if first else (), (), fresh, prompt, kept, range(first, cached))
            return length - cached + ask.reserve - (pool.num_free - pool.count_idle(kept)), plan
        if remote is None:  # computed here: the engine's one pass may end where the kind needs less
            end = None if prompt is None or ask.covered is None else min(prompt, ask.covered)
            gone = _clip(kind.admission_released(ask.window_token, end, size, self.span, prompt), length)
            inflight = minus(gone, kind.released(ask.window_token, size, self.span, prompt))
        else:  # a handoff: the prompt was computed elsewhere
            gone = _clip(kind.released(ask.window_token, size, self.span, prompt), length)
            inflight = ()
        if remote is None and self.tiers is None:  # the common case: every needed block is on device
            kept = self.hit_blocks(ask.hashes, ask.hit_tokens)
            if kept is None:
                return None
            window = needed_blocks(self.rule, ask.hit_tokens)
            fresh = minus(range(0, length), union(gone, window))
            plan = _Plan(length, gone, inflight, fresh, prompt, kept=kept, window=window)
            return sum(map(len, fresh)) + ask.reserve - (pool.num_free - pool.count_idle(kept)), plan
        below = minus(range(0, min(ask.hits // self.ratio, length)), gone)
        held = self._sources(ask, remote, below)
        if held is None:
            return None
        kept = [block for _, block, where in held if where == DEVICE]
        fresh = minus(range(0, length), union(gone, below))
        plan = _Plan(length, gone, inflight, fresh, prompt, held=held, remote=remote)
        need = sum(map(len, fresh)) + len(held) - len(kept)
        return need + ask.reserve - (pool.num_free - pool.count_idle(kept)), plan

    def _sources(self, ask: Ask, remote: Sequence[int] | None, below: Positions) -> list[tuple[int, int, int]] | None:
        """(position, block, where) of each position ``below`` the hit the table holds, for an admission through
        tiers or a handoff; None when a needed block is nowhere. Pure."""
        keys = self.keys(ask.hashes)
        block_of = self.index.block_of
        tiers = None if remote is not None else self.tiers  # a handoff is matched on device only
        held = []
        for r in below:
            for position in r:
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
        return held

    def take_admission(self, key: int, ask: Ask, prepared: Any) -> GroupCopies | None:
        """Keep the blocks the hit needs, take the new ones (the caller checked the room); the copies that
        fill the new ones (None when there are none)."""
        plan: _Plan = prepared
        table = [PLACEHOLDER] * plan.length
        copies = None
        if plan.held is None:  # every needed block on device
            kept = plan.kept
            self.pool._acquire_valid(kept)
            if kept:
                table[plan.window.start : plan.window.stop] = kept
            count = sum(map(len, plan.fresh))
            taken = self.take(count) if count else []
        else:
            held = plan.held
            self.pool._acquire_valid([block for _, block, where in held if where == DEVICE])
            from_host = [block for _, block, where in held if where == HOST]
            if from_host and self.tiers is not None:
                self.tiers.acquire_host(from_host)  # before an eviction can write back into the host tier
            copied = sum(1 for *_, where in held if where != DEVICE)
            taken = self.take(sum(map(len, plan.fresh)) + copied)
            new = iter(taken[:copied])
            del taken[:copied]
            copies = GroupCopies()
            for position, block, where in held:
                if where == DEVICE:
                    table[position] = block
                    continue
                target = next(new)
                table[position] = target
                if where == HOST:
                    copies.swaps.append((block, target, position))
                elif where == STORED:
                    copies.loads.append((target, position))
                else:
                    copies.moves.append((block, target))
        remote = plan.remote
        done = 0
        for r in plan.fresh:  # new positions, in runs
            targets = taken[done : done + len(r)]
            done += len(r)
            table[r.start : r.stop] = targets
            if remote is not None and copies is not None:  # a handoff: the prompt's blocks come from the prefill node
                copies.moves += zip((remote[p] for p in r), targets)
        self.tables[key] = table
        self.released[key] = plan.gone
        self._prompts[key] = plan.prompt
        if plan.inflight:
            self._inflight[key] = plan.inflight
        return copies if copies else None

    def growth_short(self, key: int, total: int) -> int:
        """Blocks the group lacks to grow the sequence's table to ``total`` chain blocks. Pure."""
        length = total if self.ratio == 1 and self.kind.table_entries is None else self.table_length(total)
        return length - len(self.tables[key]) - self.pool.num_free

    def resize(self, key: int, total: int) -> None:
        """Grow (or shrink: a smaller lookahead) the table to ``total`` chain blocks; the surplus tail goes back."""
        table = self.tables[key]
        after = self.table_length(total)
        if after > len(table):
            table += self.take(after - len(table))
        elif after < len(table):
            surplus = table[after:]
            del table[after:]
            self.pool._release_valid(reversed(surplus))

    # ------------------------------------------------------------------ commit and release

    def committed(self, key: int, hashes: Sequence[BlockHash], before: int, n: int, cache: bool) -> int:
        """The sequence committed from ``before`` to ``n`` tokens: cache its newly full blocks (when ``cache``),
        then release what no token from ``n`` on attends to (cached if committed). Returns :meth:`next_move`
        ``(n)``: the commit that may release more."""
        table = self.tables[key]
        gone = self.released[key]
        kind = self.kind
        size = self.block_size
        cache = cache and kind.prefix_cached
        if kind.leading and (not gone or (len(gone) == 1 and not gone[0].start)):  # one leading run, longer now
            done = gone[0].stop if gone else 0
            if cache:  # a duplicate stays private; released positions are never indexed
                first_new = before // size
                stop = n // size  # a leading kind caches every full block
                if stop > first_new:
                    keys = hashes if self.ratio == 1 else _EveryNth(hashes, self.ratio)
                    self.index.insert_run(keys, table, first_new if first_new > done else done, stop)
            first = kind.first_needed(n, size, self.span)
            if first > done:
                leaving = table[done:first]  # unless a role cut them back, none is released yet
                if PLACEHOLDER in leaving:
                    leaving = [b for b in leaving if b != PLACEHOLDER]
                self.pool._release_valid(leaving)  # oldest first: they leave the window in that order
                table[done:first] = [PLACEHOLDER] * (first - done)
                self.released[key] = (range(0, first),)
        else:
            prompt = self._prompts[key]
            if cache:
                self._index(self.keys(hashes), table, gone, before // size, kind.cached_stop(n, size, prompt))
            now = kind.released(n, size, self.span, prompt)
            if now and now != gone:
                self._release_more(key, table, gone, now)
        tiers = self.tiers
        if cache and tiers is not None and tiers.writes_through:
            tiers.written(self.index.block_of, self.keys(hashes), before // size, n // size)
        return kind.next_move(n, size, self.span)

    def _release_more(self, key: int, table: list[int], gone: Positions, now: Positions) -> None:
        """Release the positions of ``now`` not in ``gone`` (cached blocks stay findable, idle)."""
        if not covers(gone, now):
            leaving = []
            for r in minus(now, gone):
                leaving += [b for b in table[r.start : r.stop] if b != PLACEHOLDER]
                table[r.start : r.stop] = [PLACEHOLDER] * len(r)
            self.pool._release_valid(leaving)
            self.released[key] = union(gone, now)

    def _index(self, keys: Sequence[BlockHash], table: list[int], gone: Positions, start: int, stop: int) -> None:
        """Index the held positions of ``[start, stop)``."""
        if start >= stop:
            return
        if not gone or gone[-1].stop <= start:
            self.index.insert_run(keys, table, start, stop)
            return
        for r in minus(range(start, stop), gone):
            self.index.insert_run(keys, table, r.start, r.stop)

    def release(self, key: int, defer: list[list[int]] | None = None) -> None:
        """The sequence leaves: the blocks it still holds go back, tail first (into ``defer`` instead, when a
        copy in flight still writes into them: released when that copy is reported)."""
        gone = self.released.pop(key)
        self._prompts.pop(key)
        self._inflight.pop(key, None)
        table = self.tables.pop(key)
        held = table[gone[0].stop :] if gone and gone[0].start == 0 else table  # the leading run is released
        if PLACEHOLDER in held:
            held = [b for b in held if b != PLACEHOLDER]
        held.reverse()
        if defer is None:
            self.pool._release_valid(held)
        else:
            defer.append(held)

    def cut_back(self, key: int, hit: int, chain_block_size: int) -> None:
        """An admission's copies fell short: the table keeps what a hit of ``hit`` chain blocks needs; the rest
        (never committed) goes back, the positions the kind releases there first, then the tail."""
        table = self.tables[key]
        end = self.table_length(hit)
        had = self.released[key]
        tokens = hit * chain_block_size
        gone = _clip(union(had, self.kind.released(tokens, self.block_size, self.span, self._prompts[key])), end)
        leaving = [table[p] for r in minus(gone, had) for p in r if table[p] != PLACEHOLDER]
        dropped = [b for b in reversed(table[end:]) if b != PLACEHOLDER]
        del table[end:]
        for r in gone:
            table[r.start : r.stop] = [PLACEHOLDER] * len(r)
        self.pool._release_valid(leaving)
        self.pool._release_valid(dropped)
        self.released[key] = gone
        inflight = _clip(self._inflight.pop(key, ()), end)
        if inflight:
            self._inflight[key] = inflight

    def index_landed(self, key: int, hashes: Sequence[BlockHash], committed: int) -> None:
        """An admission's copies landed: the blocks it holds below ``committed`` tokens become findable."""
        if self.kind.prefix_cached:
            stop = self.kind.cached_stop(committed, self.block_size, self._prompts[key])
            self._index(self.keys(hashes), self.tables[key], self.released[key], 0, stop)

    # ------------------------------------------------------------------ checks

    def check_integrity(self, live: dict[int, tuple[object, int, int]], other_holders: Iterable[Iterable[int]]) -> None:
        """Pool and index agree, references equal the tables (plus ``other_holders``), every table is as long
        as the kind says for the full one, it holds PLACEHOLDER exactly where the group released, and no block
        the kind releases is held. ``live``: id(sequence) -> (sequence id, full-attention table length, the
        token its window is placed at)."""
        number = self.number
        pool = self.pool
        pool.check_integrity()
        self.index.check_integrity()
        if not self.kind.prefix_cached and len(self.index):
            raise IntegrityError(f"group {number} is never prefix-cached but its index holds blocks")
        expected = [0] * pool.num_blocks
        if not set(self.tables) == set(live) == set(self.released) == set(self._prompts) >= set(self._inflight):
            raise IntegrityError(f"group {number} has tables for other sequences than the admitted ones")
        for key, table in self.tables.items():
            seq_id, chain_blocks, window_token = live[key]
            if len(table) != self.table_length(chain_blocks):
                raise IntegrityError(f"group {number}: {seq_id!r}'s table has {len(table)} positions")
            gone = _placeholders(table)
            if gone != self.released[key]:
                raise IntegrityError(
                    f"group {number}: {seq_id!r} released {self.released[key]}, its table is {PLACEHOLDER} at {gone}"
                )
            now = self.kind.released(window_token, self.block_size, self.span, self._prompts[key])
            lost = minus(gone, union(now, self._inflight.get(key, ())))
            if lost:
                raise IntegrityError(f"group {number}: {seq_id!r} lost position {lost[0].start} in its window")
            outside = minus(_clip(now, len(table)), gone)
            if outside:
                raise IntegrityError(f"group {number}: {seq_id!r} holds position {outside[0].start} outside its window")
            for block in table:
                if block != PLACEHOLDER:
                    expected[block] += 1
        for order in other_holders:
            for block in order:
                expected[block] += 1
        for block in range(pool.num_blocks):
            if pool.ref_count(block) != expected[block]:
                raise IntegrityError(f"group {number}: block {block} has {pool.ref_count(block)} references")


def _clip(positions: Positions, length: int) -> Positions:
    """``positions`` below ``length``."""
    if not positions or positions[-1].stop <= length:
        return positions
    return tuple(r for r in (range(r.start, min(r.stop, length)) for r in positions) if r)


def _placeholders(table: list[int]) -> Positions:
    """The positions where ``table`` holds :data:`PLACEHOLDER`."""
    out: list[range] = []
    start = -1
    for position, block in enumerate(table):
        if block == PLACEHOLDER:
            if start < 0:
                start = position
        elif start >= 0:
            out.append(range(start, position))
            start = -1
    if start >= 0:
        out.append(range(start, len(table)))
    return tuple(out)
