"""Group 0, full attention: the group whose blocks are the hash chain's own.

Its pool holds every full-attention layer's blocks, its prefix tree caches them by chain hash, and a
sequence's table in it is the sequence's own table (``_Sequence.table``: the one the engine's block
tables, the step and every other group follow). What only this group does:

* a hit is a leading run of the tree (``[0, h)``), and a commit inserts the newly full blocks;
* when two sequences computed the same block, the second keeps its private copy and *pins* the tree's
  node, so the prefix it builds on stays cached; a sequence holds every block of its table and every
  pinned node, and releases them tail first (a pinned node right before its private copy's position)::

      table     [ 5 , 6 , 9 ]          block 9 duplicates node 7 (another sequence's commit came first)
      pins      {2: 7}
      release   9, 7, 6, 5             tail first: a suffix is never cached longer than its prefix

* new blocks come from its pool, evicting the tree's idle leaves (written back when it has tiers).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence

from kvblocks.accounting import BlockLifetimes
from kvblocks.config import CacheConfig
from kvblocks.core.groups.sources import GroupTiers, take_blocks
from kvblocks.core.pool import BlockPool
from kvblocks.core.prefix_tree import PrefixTree
from kvblocks.core.sequence import _Sequence
from kvblocks.errors import IntegrityError
from kvblocks.events import EventSink
from kvblocks.hashing import BlockHash, HashedTokens

__all__ = ["FullAttentionGroup"]


class FullAttentionGroup:
    """Group 0's pool, tree (recording evicted blocks' lifetimes) and tiers (None: none)."""

    __slots__ = ("block_size", "caching", "pool", "tiers", "tree")

    number = 0

    def __init__(self, config: CacheConfig, events: EventSink | None, tag: tuple[int | None, str | None]) -> None:
        self.block_size = config.block_size
        self.caching = config.enable_prefix_caching
        self.pool = BlockPool(config.num_blocks, eviction=config.eviction)
        group, kind = tag
        lifetimes = BlockLifetimes()
        self.tree = PrefixTree(
            self.pool, events=events, group=group, group_kind=kind, block_size=config.block_size, lifetimes=lifetimes
        )
        self.tiers: GroupTiers | None = None

    def take(self, count: int) -> list[int]:
        """``count`` fresh blocks, evicting idle leaves (written back when the group has tiers)."""
        pool = self.pool
        return pool.take_fresh(count) if count <= len(pool._fresh) else take_blocks(pool, self.tree, self.tiers, count)

    # ------------------------------------------------------------------ commit

    def cache(self, s: _Sequence, start: int, stop: int) -> None:
        """Blocks ``[start, stop)`` of admitted ``s`` are committed: they enter the tree (a duplicate of a node
        stays private and pins the node), and go down the tiers that write through."""
        content = s.content
        tree = self.tree
        # The tree's events name the blocks' tokens (package-private). stable: a sequence's hashes and
        # tokens only grow (HashedTokens.truncate replaces them), so its events read them when built.
        keeps = tree._events is not None or tree._tokens_of is not None
        tokens = content._tokens if keeps and isinstance(content, HashedTokens) else None
        table = s.table
        if table is None:  # pragma: no cover - the caller commits admitted sequences only
            raise IntegrityError("only an admitted sequence commits")
        if keeps:
            existing = tree.insert(
                content.hashes, table, start, stop, tokens=tokens, lora_name=s.lora_name, lora_id=s.lora_id, stable=True
            )
        else:  # nothing emitted or kept: the tokens and the adapter are not needed (a call without keywords)
            existing = tree.insert(content.hashes, table, start, stop)
        if existing:
            pins = s.pins if s.pins is not None else {}
            nodes = []
            for position, node in enumerate(existing, start):
                if node != table[position]:
                    pins[position] = node
                    nodes.append(node)
            self.pool.acquire(nodes)
            s.pins = pins
        tiers = self.tiers
        if tiers is not None and tiers.writes_through:
            tiers.written(tree.block_of, content.hashes, start, stop, tokens)

    def idle_duplicates(self, s: _Sequence, start: int, stop: int) -> int:
        """Cached blocks that committing blocks ``[start, stop)`` of ``s`` would pin while they are idle.

        Pinning one takes it out of the free supply, so a step counts them before it commits.
        """
        if not self.caching or stop <= start:
            return 0
        hashes = s.content.hashes
        table = s.table
        if table is None:  # pragma: no cover - a step commits admitted sequences only
            raise IntegrityError("only an admitted sequence commits")
        block_of = self.tree.block_of
        ref = self.pool._ref
        count = 0
        for position in range(start, stop):
            node = block_of(hashes[position])
            if node is not None and node != table[position] and not ref[node]:
                count += 1
        return count

    # ------------------------------------------------------------------ release

    @staticmethod
    def release_order(s: _Sequence) -> Iterable[int]:
        """The sequence's references, tail first (a pinned node right before its private copy's position)."""
        table = s.table
        if table is None:
            return ()
        pins = s.pins
        if not pins:
            return reversed(table)
        order = []
        for position in range(len(table) - 1, -1, -1):
            pinned = pins.get(position)
            if pinned is not None:
                order.append(pinned)
            order.append(table[position])
        return order

    def release(self, s: _Sequence, defer: list[list[int]] | None = None) -> None:
        """Admitted ``s`` leaves: its references go back tail first (into ``defer`` instead, for a copy in
        flight into its blocks or a save of them: released when that plan completes)."""
        if defer is None:
            self.pool._release_valid(self.release_order(s))  # the manager's own table: valid by construction
        else:
            defer.append(list(self.release_order(s)))

    def cut_back(self, s: _Sequence, valid: int) -> None:
        """An admission's copies fell short: the table keeps its first ``valid`` blocks; the rest (never
        committed) goes back to the fresh queue."""
        table = s.blocks()
        dropped = table[valid:]
        del table[valid:]
        self.pool._release_valid(reversed(dropped))

    # ------------------------------------------------------------------ checks

    def check_integrity(self, seqs: Mapping[Hashable, _Sequence], other_holders: Iterable[Iterable[int]]) -> None:
        """Pool and tree agree; every table is as long as its slots, holds no block twice, and is cached below its
        committed line; references equal the tables, pins and ``other_holders``; a node in use has its parent in
        use, and with LRU an idle node was released before its idle parent (another policy's order is its own:
        it keeps a blocked parent until its children are gone)."""
        pool = self.pool
        tree = self.tree
        pool.check_integrity()
        tree.check_integrity()
        size = self.block_size
        expected = [0] * pool.num_blocks
        for seq_id, s in seqs.items():
            table = s.table
            if table is None:
                if s.pins or s.num_covered or s.num_committed or s.lookahead:
                    raise IntegrityError(f"sequence {seq_id!r} is not admitted but carries table state")
                continue
            if len(table) != -(-(s.num_covered + s.lookahead) // size):
                raise IntegrityError(
                    f"sequence {seq_id!r}: {len(table)} blocks for {s.num_covered} tokens + {s.lookahead} lookahead"
                )
            if len(set(table)) != len(table):
                raise IntegrityError(f"sequence {seq_id!r} holds a block twice: {table}")
            if not s.num_committed <= min(s.num_covered, s.content.num_tokens):
                raise IntegrityError(f"sequence {seq_id!r} committed {s.num_committed} beyond its tokens or slots")
            self._check_table(seq_id, s, expected)
        for order in other_holders:
            for block in order:
                expected[block] += 1
        for block in range(pool.num_blocks):
            if pool.ref_count(block) != expected[block]:
                raise IntegrityError(
                    f"block {block} has ref count {pool.ref_count(block)} but {expected[block]} holders"
                )
        position = {b: i for i, b in enumerate(pool.idle_order())} if pool.eviction == "lru" else {}
        for b in range(pool.num_blocks):
            parent = tree.parent_of(b) if tree.hash_of(b) is not None else None
            if parent is None:
                continue
            if pool.ref_count(b) and not pool.ref_count(parent):
                raise IntegrityError(f"cached block {b} is in use but its parent {parent} is not")
            if b in position and parent in position and position[parent] < position[b]:
                raise IntegrityError(f"idle block {parent} was released before its idle child {b}")

    def _check_table(self, seq_id: Hashable, s: _Sequence, expected: list[int]) -> None:
        """Count ``s``'s references; every position below its committed line is the tree's node (or pins it)."""
        hashes: Sequence[BlockHash] = s.content.hashes
        registered = s.num_committed // self.block_size if self.caching else 0  # blocks the tree must hold for it
        pins = s.pins or {}
        block_of = self.tree.block_of
        for position, block in enumerate(s.table or ()):
            expected[block] += 1
            pinned = pins.get(position)
            if pinned is not None:
                expected[pinned] += 1
            if position < registered:
                node = block_of(hashes[position])
                if node is None or node != (block if pinned is None else pinned):
                    raise IntegrityError(f"sequence {seq_id!r} position {position}: cached node is {node}")
        if any(p >= registered for p in pins):
            raise IntegrityError(f"sequence {seq_id!r} pins a position beyond its registered blocks")
