"""PrefixTree: which cached block holds which prefix, and which block to evict next.

One node per cached full block, keyed by its chained hash. Because a hash names a
whole prefix, a node's parent is simply the node of the previous hash::

    hashes of a sequence   h0 ── h1 ── h2 ── h3
    nodes (block ids)      [5] ─ [9] ─ [2]            h3 not cached
    match(h0..h3)      ->  blocks (5, 9, 2): a 3-block prefix

Invariants:

* every node's parent is a node, so a cached suffix never outlives its prefix
  (:meth:`check_integrity` verifies it);
* eviction removes leaves only, in the order of the pool's eviction policy (by
  construction: a block with cached children is never chosen).

Eviction order comes from the pool's :class:`~kvblocks.core.eviction.EvictionPolicy`; the
default, LRU, takes blocks in the order their last holder released them. The manager
releases a sequence's blocks tail first and a holder of a node always holds its
ancestors, so an idle parent is always released after its idle children: the oldest
idle block is a leaf and eviction is O(1). When the tree is driven otherwise and the
oldest idle block has cached children, eviction skips ahead to the oldest idle *leaf*
-- still exact LRU among leaves, just not O(1) in that case. Another policy keeps an
interior candidate (S3-FIFO moves it to its main queue) until it becomes a leaf.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from itertools import islice

from kvblocks.accounting import BlockLifetimes
from kvblocks.core.pool import BlockPool
from kvblocks.errors import (
    IntegrityError,
    InvalidArgumentError,
    InvalidBlockHashError,
    InvalidBlockIdError,
    SequenceStateError,
)
from kvblocks.event_codec import EVENT_GROUP_KINDS, is_group_tag, removed_event, stored_event, stored_range_event
from kvblocks.events import AllBlocksCleared, BlockStored, EventSink
from kvblocks.hashing import BlockHash
from kvblocks.hashing.tokens import block_token_bytes

__all__ = ["PrefixMatch", "PrefixTree"]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest cached prefix of a hash chain: its blocks and their hashes, in order."""

    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class PrefixTree:
    """The content index of one tier: chained block hash -> block id, with leaf-only LRU eviction.

    >>> pool = BlockPool(4)
    >>> tree = PrefixTree(pool)
    >>> blocks = pool.take_fresh(2)
    >>> tree.insert([b"h0", b"h1"], blocks)       # nothing was cached before
    []
    >>> tree.match([b"h0", b"h1", b"h2"]).block_ids
    (0, 1)
    >>> pool.release(blocks[::-1])                # tail first
    >>> tree.evict(1)                             # the leaf goes first
    [1]
    """

    __slots__ = (
        "_block_of",
        "_events",
        "_hash_of",
        "_num_children",
        "_parent_of",
        "_removed",
        "_root",
        "_stored",
        "_stored_range",
        "_tokens_of",
        "block_size",
        "group",
        "group_kind",
        "lifetimes",
        "num_evicted",
        "pool",
        "tier",
    )

    def __init__(
        self,
        pool: BlockPool,
        *,
        tier: str = "device",
        events: EventSink | None = None,
        group: int | None = None,
        group_kind: str | None = None,
        block_size: int | None = None,
        lifetimes: BlockLifetimes | None = None,
    ) -> None:
        """``group`` / ``group_kind`` tag every event this tree emits: the full-attention group of a hybrid
        model's manager is group 0 of kind ``"full"``; both None (a single-group cache) leave events untagged.
        ``block_size`` (tokens per block) goes into its ``BlockStored`` events, and lets :meth:`insert`
        give them the blocks' token ids. ``lifetimes`` records how long the blocks it evicts lived and sat idle
        (the device tree's; it costs nothing off the eviction path: the policy hands over the victims' idle
        stamps as it drops them)."""
        if not is_group_tag(group, group_kind):
            raise InvalidArgumentError(
                f"group must be an int >= 0 and group_kind one of {', '.join(EVENT_GROUP_KINDS)}, both or neither; "
                f"got {group!r}, {group_kind!r}"
            )
        if block_size is not None and (type(block_size) is not int or block_size < 1):
            raise InvalidArgumentError(f"block_size must be None or an int >= 1, got {block_size!r}")
        self.pool = pool
        self.tier = tier
        self.block_size = block_size
        self.group = group
        self.group_kind = group_kind
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: list[BlockHash | None] = pool._key  # type: ignore[assignment]  # the pool's content keys
        # The root is a virtual node with id num_blocks: a chain's first block is its child, so child
        # counting needs no branch. _parent_of is meaningful for nodes only.
        self._root = pool.num_blocks
        self._parent_of: list[int] = [self._root] * pool.num_blocks
        self._num_children: list[int] = [0] * (pool.num_blocks + 1)
        self._events = events
        # what its events are built with, off the hot path (EventSink.record)
        self._stored = partial(stored_event, tier, group, group_kind, block_size)
        self._stored_range = partial(stored_range_event, tier, group, group_kind, block_size)
        self._removed = partial(removed_event, tier, group, group_kind)
        self.lifetimes = lifetimes
        self.num_evicted = 0
        """Blocks evicted since construction (a counter, never reset)."""
        self._tokens_of: list[bytes | None] | None = None  # per block, its token ids (keep_token_ids)

    def keep_token_ids(self) -> None:
        """Keep each cached block's token ids (as ``array('I')`` bytes), so that :meth:`evict` can name them
        with its parent's hash: a host tier that publishes events writes evicted blocks back as chains, as
        SGLang publishes host pages. About ``4 * block_size`` bytes per cached block; needs ``block_size``."""
        if self.block_size is None:
            raise InvalidArgumentError("a tree keeps token ids only with a block_size")
        if self._tokens_of is None:
            self._tokens_of = [None] * self.pool.num_blocks

    # ------------------------------------------------------------------ queries

    @property
    def events(self) -> EventSink | None:
        """The sink this tree emits to (None: it emits nothing)."""
        return self._events

    def __len__(self) -> int:
        return len(self._block_of)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._block_of

    def block_of(self, block_hash: BlockHash) -> int | None:
        return self._block_of.get(block_hash)

    def hash_of(self, block: int) -> BlockHash | None:
        return self._hash_of[block]

    def parent_of(self, block: int) -> int | None:
        """The node holding the previous hash of node ``block``'s chain (None: a chain's first block, or no node)."""
        p = self._parent_of[block]
        return None if p == self._root or self._hash_of[block] is None else p

    def num_children(self, block: int) -> int:
        return self._num_children[block]

    def match_length(self, hashes: Sequence[BlockHash], limit: int | None = None) -> int:
        """How many leading ``hashes`` (at most ``limit``) are cached. Pure."""
        block_of = self._block_of
        stop = len(hashes) if limit is None else max(0, min(limit, len(hashes)))
        n = 0
        for h in hashes if stop == len(hashes) else islice(hashes, stop):
            if h not in block_of:
                break
            n += 1
        return n

    def matched_blocks(self, hashes: Sequence[BlockHash], limit: int | None = None) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes`` (at most ``limit`` blocks). Pure."""
        get = self._block_of.get
        stop = len(hashes) if limit is None else max(0, min(limit, len(hashes)))
        out: list[int] = []
        append = out.append
        for h in hashes if stop == len(hashes) else islice(hashes, stop):
            b = get(h)
            if b is None:
                break
            append(b)
        return out

    def match(self, hashes: Sequence[BlockHash], limit: int | None = None) -> PrefixMatch:
        """The longest cached prefix of ``hashes`` as an immutable result. Pure: nothing is touched."""
        blocks = self.matched_blocks(hashes, limit)
        return PrefixMatch(tuple(blocks), tuple(hashes[: len(blocks)]))

    def snapshot_events(self) -> list[BlockStored]:
        """The whole index as ``BlockStored`` events, one per chain, parents before children. Pure.

        Applying them to an empty index rebuilds exactly this tree's hashes and their
        parents (what an :class:`kvblocks.events.EventPublisher` sends as a snapshot).
        A chain runs down while a node has exactly one cached child.

        >>> pool = BlockPool(4)
        >>> tree = PrefixTree(pool)
        >>> _ = tree.insert([b"a", b"b"], pool.take_fresh(2))
        >>> _ = tree.insert([b"a", b"c"], pool.take_fresh(2), start=1)
        >>> [(e.block_hashes, e.parent_hash) for e in tree.snapshot_events()]
        [((b'a',), None), ((b'b',), b'a'), ((b'c',), b'a')]
        """
        hash_of = self._hash_of
        parent_of = self._parent_of
        root = self._root
        children: dict[int, list[int]] = {}
        for b in self._block_of.values():
            children.setdefault(parent_of[b], []).append(b)
        out: list[BlockStored] = []
        stack = children.get(root, [])[::-1]
        while stack:
            b = stack.pop()
            p = parent_of[b]
            parent_hash = None if p == root else hash_of[p]
            chain: list[BlockHash] = [hash_of[b]]  # type: ignore[list-item]  # b is a node
            kids = children.get(b)
            while kids is not None and len(kids) == 1:
                b = kids[0]
                chain.append(hash_of[b])  # type: ignore[arg-type]
                kids = children.get(b)
            out.append(
                BlockStored(tuple(chain), parent_hash, self.tier, None, self.group, self.group_kind, self.block_size)
            )
            if kids:
                stack.extend(reversed(kids))
        return out

    # ------------------------------------------------------------------ insert

    def insert(
        self,
        hashes: Sequence[BlockHash],
        blocks: Sequence[int],
        start: int = 0,
        stop: int | None = None,
        *,
        tokens: Sequence[int] | None = None,
        lora_name: str | None = None,
        lora_id: int | None = None,
        stable: bool = False,
    ) -> list[int]:
        """Make ``blocks[start:stop]`` findable under ``hashes[start:stop]``; return what was already cached.

        ``hashes`` is one chain (``hashes[i]`` extends ``hashes[i-1]``), so the hashes
        already cached form a leading run. The return value lists the cached block of
        each position in that run -- usually empty. A caller whose own block differs
        from the returned one computed a duplicate: its block stays private and the
        tree keeps the first. The new blocks must be in use (their KV was just written)
        and the parent ``hashes[start-1]`` must be cached. Emits one ``BlockStored``, carrying
        the new blocks' token ids when ``tokens`` (the sequence's tokens, from its first) and
        the tree's ``block_size`` are known, and ``lora_name`` / ``lora_id``. ``stable``: ``hashes`` and ``tokens``
        only grow (positions below ``stop`` never change), so the event reads its parts from them when it
        is built (:func:`~kvblocks.event_codec.stored_range_event`) instead of copying them now. On any
        error nothing changes.
        """
        stop = len(hashes) if stop is None else stop
        if not 0 <= start <= stop <= min(len(hashes), len(blocks)):
            raise InvalidArgumentError(
                f"insert range [{start}, {stop}) does not fit {len(hashes)} hashes and {len(blocks)} blocks"
            )
        block_of = self._block_of
        if stop - start == 1 and start and self._tokens_of is None:
            # A decode's commit: one block after a cached parent. The checks of the loop below, in one pass;
            # anything unusual takes the general path, which names the problem.
            h = hashes[start]
            b = blocks[start]
            kind = type(h)
            if (kind is bytes or kind is int) and type(b) is int and 0 <= b < self._root:
                parent_block = block_of.get(hashes[start - 1])
                if parent_block is not None:
                    node = block_of.get(h)
                    if node is not None:
                        return [node]
                    if self._hash_of[b] is None and self.pool._ref[b]:
                        block_of[h] = b
                        self._hash_of[b] = h
                        self._parent_of[b] = parent_block
                        self._num_children[parent_block] += 1
                        if self._events is not None:
                            self._emit_stored(self._events, hashes, start, stop, tokens, lora_name, lora_id, stable)
                        return []
        parent = self._root
        if start > 0:
            parent_block = block_of.get(hashes[start - 1])
            if parent_block is None:
                raise InvalidBlockHashError(
                    f"cannot insert at position {start}: the parent hash {hashes[start - 1]!r} is not cached"
                )
            parent = parent_block
        first_new = start
        existing: list[int] = []
        while first_new < stop:
            node = block_of.get(hashes[first_new])
            if node is None:
                break
            existing.append(node)
            first_new += 1
        if first_new == stop:
            return existing
        if existing:
            parent = existing[-1]
        try:
            sound = min(blocks[first_new:stop]) >= 0  # the one bad id that list indexing would not catch
        except TypeError:
            sound = False
        reached = self._link(hashes, blocks, first_new, stop, parent) if sound else first_new
        if reached < stop:
            self._unlink(hashes, blocks, first_new, reached)
            raise self._insert_problem(hashes, blocks, first_new, reached)
        tokens_of = self._tokens_of
        if tokens_of is not None:
            self._keep_tokens(tokens_of, tokens, blocks, first_new, stop)
        if self._events is not None:
            self._emit_stored(self._events, hashes, first_new, stop, tokens, lora_name, lora_id, stable)
        return existing

    def _link(self, hashes: Sequence[BlockHash], blocks: Sequence[int], first: int, stop: int, parent: int) -> int:
        """Link ``blocks[first:stop]`` under ``hashes[first:stop]``, each the child of the one before it (the first
        the child of ``parent``), the ids known not to be negative. Returns ``stop``, or the first position it
        refused: a block already a node (or given twice), a block nobody holds, a hash seen twice (or not
        hashable), an id out of range or not an int. Positions before that one are linked (the caller unlinks
        them)."""
        block_of = self._block_of
        hash_of = self._hash_of
        parent_of = self._parent_of
        num_children = self._num_children
        ref = self.pool._ref  # package-private: the tree is the pool's content index
        i = first
        try:
            for i in range(first, stop):
                h = hashes[i]
                block = blocks[i]
                if type(block) is not int:  # a bool or a float is not a block id (the short path's rule too)
                    return i
                b = block
                if hash_of[b] is not None or not ref[b] or h in block_of:
                    return i
                block_of[h] = b
                hash_of[b] = h
                parent_of[b] = parent
                num_children[parent] += 1
                parent = b
        except (IndexError, TypeError, OverflowError):  # what a bad block id or hash raises (in C: an id past 2**63)
            return i
        return stop

    def _emit_stored(
        self,
        events: EventSink,
        hashes: Sequence[BlockHash],
        first: int,
        stop: int,
        tokens: Sequence[int] | None,
        lora_name: str | None,
        lora_id: int | None,
        stable: bool,
    ) -> None:
        """Record the ``BlockStored`` of the blocks just inserted at ``[first, stop)`` (see :meth:`insert`)."""
        lora = lora_name if lora_id is None else (lora_name, lora_id)
        if stable:
            events.record(self._stored_range, hashes, first, stop, tokens, lora)
            return
        parent_hash = hashes[first - 1] if first > 0 else None
        size = self.block_size
        token_ids = None if tokens is None or size is None else tokens[first * size : stop * size]
        if type(token_ids) is array and token_ids.typecode == "I":  # its bytes: nothing the GC tracks
            token_ids = token_ids.tobytes()
        events.record(self._stored, hashes[first:stop], parent_hash, token_ids, lora)

    def _keep_tokens(
        self, tokens_of: list[bytes | None], tokens: Sequence[int] | None, blocks: Sequence[int], first: int, stop: int
    ) -> None:
        """Note the token ids of the blocks just inserted at positions ``[first, stop)`` (None where not given)."""
        size: int = self.block_size  # type: ignore[assignment]  # keep_token_ids needs it
        for position in range(first, stop):
            tokens_of[blocks[position]] = block_token_bytes(tokens, position, size)

    def _unlink(self, hashes: Sequence[BlockHash], blocks: Sequence[int], first: int, stop: int) -> None:
        """Undo the links an aborted insert made for positions ``first..stop-1`` (leaves, newest first)."""
        for i in range(stop - 1, first - 1, -1):
            b = blocks[i]
            del self._block_of[hashes[i]]
            self._hash_of[b] = None
            self._num_children[self._parent_of[b]] -= 1

    def _insert_problem(self, hashes: Sequence[BlockHash], blocks: Sequence[int], first: int, i: int) -> Exception:
        """Why position ``i`` of an insert was refused (checked in the insert loop's order)."""
        n = self.pool.num_blocks
        bad = [x for x in blocks[first:] if not (type(x) is int and 0 <= x < n)]
        if bad:
            return InvalidBlockIdError(f"block id {bad[0]!r} is not an int in 0..{n - 1}")
        b = blocks[i]
        if self._hash_of[b] is not None or b in blocks[first:i]:
            return InvalidBlockIdError(f"block {b} is already a node (or appears twice in one insert)")
        if not self.pool._ref[b]:
            return InvalidBlockIdError(f"block {b} is not in use; only a held block can be inserted")
        if hashes[i] in hashes[first:i]:
            return InvalidBlockHashError(f"hash at position {i} appears earlier in the same chain")
        return InvalidBlockHashError(f"hash at position {i} is cached but an earlier position is not: not one chain")

    # ------------------------------------------------------------------ eviction

    def evict(
        self,
        count: int,
        removed_hashes: list[BlockHash] | None = None,
        removed_chains: list[tuple[BlockHash | None, bytes | None]] | None = None,
    ) -> list[int]:
        """Evict up to ``count`` idle leaves, in the pool's eviction order; return their ids.

        The pool's :class:`~kvblocks.core.eviction.EvictionPolicy` chooses (LRU: least recently released
        first); an interior block it offers is kept until it becomes a leaf. The returned blocks are
        FRESH in the pool (at the back of its fresh queue). Fewer than ``count`` come back only when
        no idle block is left. Emits one ``BlockRemoved`` for the batch. With ``removed_hashes``, the
        evicted blocks' hashes are appended to it, in the same order (a lower tier writes them back); with
        ``removed_chains``, each one's parent hash (None: a chain's first block) and token ids (bytes of an
        ``array('I')``, or None unless :meth:`keep_token_ids`).
        """
        if type(count) is not int or count < 0:
            raise InvalidArgumentError(f"cannot evict {count!r} blocks")
        # package-private: the tree is the pool's content index. The policy drops the victims from the
        # idle set and unlinks each from its parent's child count (a parent may follow its last child).
        pool = self.pool
        lifetimes = self.lifetimes
        if lifetimes is None:
            evicted = pool._policy.victims(count, self._num_children, self._parent_of)
        else:
            stamps: list[float] = []  # when each victim became idle
            evicted = pool._policy.victims(count, self._num_children, self._parent_of, stamps)
            if evicted and not lifetimes.passes_over(len(evicted)):
                lifetimes.observe(pool.clock(), pool._taken_at, zip(evicted, stamps), len(evicted))
        block_of = self._block_of
        hash_of = self._hash_of
        events = self._events
        tokens_of = self._tokens_of
        removed = removed_hashes
        if removed is None and events is not None:
            removed = []
        if removed_chains is not None:  # before any is unlinked: a parent follows its last child in the batch
            root, parent_of = self._root, self._parent_of
            for b in evicted:
                parent = parent_of[b]
                removed_chains.append(
                    (None if parent == root else hash_of[parent], None if tokens_of is None else tokens_of[b])
                )
        for b in evicted:
            h = hash_of[b]
            del block_of[h]  # type: ignore[arg-type]
            hash_of[b] = None
            if removed is not None:
                removed.append(h)  # type: ignore[arg-type]
        if tokens_of is not None:
            for b in evicted:
                tokens_of[b] = None
        pool._fresh.extend(evicted)
        self.num_evicted += len(evicted)
        if evicted and events is not None:
            # our own list when the caller gave none (nobody changes it later), else the batch's part of theirs
            mine = removed if removed_hashes is None else removed[-len(evicted) :]  # type: ignore[index]
            events.record(self._removed, mine)
        return evicted

    def clear(self) -> list[int]:
        """Drop every cached block; all must be idle. Returns the dropped ids. Emits ``AllBlocksCleared``."""
        in_use = len(self._block_of) - self.pool.num_idle
        if in_use:
            raise SequenceStateError(f"cannot clear the {self.tier} cache: {in_use} cached blocks are in use")
        pool = self.pool
        dropped = list(pool.idle_order())
        tokens_of = self._tokens_of
        for b in dropped:
            self._num_children[b] = 0
            pool.evict(b)
            if tokens_of is not None:
                tokens_of[b] = None
        self._num_children[self._root] = 0
        self._block_of.clear()
        self.num_evicted += len(dropped)
        if self._events is not None:
            self._events.emit(AllBlocksCleared(self.tier, self.group, self.group_kind))
        return dropped

    # ------------------------------------------------------------------ checks

    def check_integrity(self) -> None:
        """Raise :class:`IntegrityError` unless the index, the shape and the pool agree."""
        pool = self.pool
        children = [0] * (pool.num_blocks + 1)
        for key, b in self._block_of.items():
            if self._hash_of[b] != key:
                raise IntegrityError(f"hash {key!r} maps to block {b}, which records hash {self._hash_of[b]!r}")
            p = self._parent_of[b]
            if p != self._root and self._hash_of[p] is None:
                raise IntegrityError(f"block {b}'s parent {p} is not cached")
            children[p] += 1
        if children[self._root] != self._num_children[self._root]:
            raise IntegrityError(f"{self._num_children[self._root]} chains counted, {children[self._root]} exist")
        for b in range(pool.num_blocks):
            h = self._hash_of[b]
            if h is None:
                if self._num_children[b]:
                    raise IntegrityError(f"block {b} is not a node but counts children")
            elif self._block_of.get(h) != b:
                raise IntegrityError(f"block {b} records hash {h!r}, which is not indexed to it")
            if children[b] != self._num_children[b]:
                raise IntegrityError(f"block {b} counts {self._num_children[b]} children, has {children[b]}")
        if len(self._block_of) < pool.num_idle:
            raise IntegrityError("more idle blocks than cached nodes")
