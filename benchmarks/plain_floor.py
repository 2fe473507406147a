"""A prefix-caching floor that shares no code with kvblocks: builtin ``hash``, dicts and an ``OrderedDict`` LRU.

:class:`~benchmarks.baselines.FloorManager` hashes tokens with kvblocks' own hasher, so a slowdown in kvblocks'
hashing or token packing slows the floor too and the ratio cannot see it. This one chains blocks with builtin
``hash((parent, tuple(tokens)))`` and imports nothing from kvblocks; its bookkeeping is the least a manager
with these call shapes can do::

    cached   dict  block hash -> block          (a committed full block, findable)
    idle     OrderedDict  block -> None         (cached blocks no sequence holds, least recent first)
    fresh    list  blocks holding nothing

``step`` does what ``KVCacheManager.step`` does per running sequence (commit what the pass computed, append the
sampled tokens, give it room for them), so one scheduling loop drives both.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import NamedTuple


class PlainCached(NamedTuple):
    device: int


class _Seq:
    __slots__ = ("committed", "covered", "hashes", "registered", "table", "tokens")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.hashes: list[int] = []
        self.table: list[int] = []
        self.covered = self.committed = self.registered = 0


class PlainFloor:
    """dict + OrderedDict LRU + builtin ``hash``, with the manager's call shapes (``step`` included)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.fresh = list(range(num_blocks - 1, -1, -1))
        self.idle: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[int, int] = {}
        self.hash_of: list[int | None] = [None] * num_blocks
        self.ref = [0] * num_blocks
        self.seqs: dict[Hashable, _Seq] = {}

    def _hash_up_to(self, s: _Seq, blocks: int) -> list[int]:
        hashes, tokens, size = s.hashes, s.tokens, self.block_size
        parent = hashes[-1] if hashes else 0
        for i in range(len(hashes), blocks):
            parent = hash((parent, tuple(tokens[i * size : (i + 1) * size])))
            hashes.append(parent)
        return hashes

    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        self.seqs[seq_id] = _Seq(list(token_ids))

    def append_tokens(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        self.seqs[seq_id].tokens.extend(token_ids)

    def _hits(self, s: _Seq) -> list[int]:
        limit = (len(s.tokens) - 1) // self.block_size
        hashes = self._hash_up_to(s, limit)
        cached = self.cached
        out = []
        for i in range(limit):
            b = cached.get(hashes[i])
            if b is None:
                break
            out.append(b)
        return out

    def lookup(self, seq_id: Hashable) -> PlainCached:
        return PlainCached(len(self._hits(self.seqs[seq_id])) * self.block_size)

    def _take(self, count: int) -> list[int] | None:
        fresh, idle = self.fresh, self.idle
        if count > len(fresh) + len(idle):
            return None
        out = []
        for _ in range(count):
            if fresh:
                b = fresh.pop()
            else:
                b, _ = idle.popitem(last=False)
                del self.cached[self.hash_of[b]]  # type: ignore[arg-type]  # an idle block is cached
                self.hash_of[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def allocate(self, seq_id: Hashable, num_new_tokens: int, num_cached_tokens: int | None = None) -> list[int] | None:
        s = self.seqs[seq_id]
        size, ref, idle = self.block_size, self.ref, self.idle
        if not s.table:
            hits = self._hits(s)
            for b in hits:
                if ref[b] == 0:
                    del idle[b]
                ref[b] += 1
            covered = len(hits) * size + num_new_tokens
            new = self._take(-(-covered // size) - len(hits))
            if new is None:
                self._drop(hits)
                return None
            s.table = hits + new
            s.covered = covered
            s.committed = len(hits) * size
            s.registered = len(hits)
            return s.table
        covered = s.covered + num_new_tokens
        need = -(-covered // size) - len(s.table)
        if need > 0:
            new = self._take(need)
            if new is None:
                return None
            s.table += new
        s.covered = covered
        return s.table

    def commit(self, seq_id: Hashable, num_computed_tokens: int) -> None:
        self._commit(self.seqs[seq_id], num_computed_tokens)

    def _commit(self, s: _Seq, num_computed_tokens: int) -> None:
        full = num_computed_tokens // self.block_size
        if full > s.registered:
            hashes = self._hash_up_to(s, full)
            table, cached, hash_of = s.table, self.cached, self.hash_of
            for i in range(s.registered, full):
                h = hashes[i]
                if h not in cached:
                    cached[h] = table[i]
                    hash_of[table[i]] = h
            s.registered = full
        s.committed = num_computed_tokens

    def step(
        self, seq_ids: Sequence[Hashable], computed: Sequence[int], sampled: Sequence[Sequence[int]]
    ) -> list[Hashable]:
        """Per sequence: commit ``computed``, append ``sampled``, room for them; the ids that got no room."""
        short = []
        seqs, size = self.seqs, self.block_size
        for seq_id, n, tokens in zip(seq_ids, computed, sampled):
            s = seqs[seq_id]
            self._commit(s, n)
            s.tokens.extend(tokens)
            covered = len(s.tokens)
            need = -(-covered // size) - len(s.table)
            if need > 0:
                new = self._take(need)
                if new is None:
                    short.append(seq_id)
                    continue
                s.table += new
            s.covered = covered
        return short

    def _drop(self, blocks: list[int]) -> None:
        ref, idle, fresh, hash_of = self.ref, self.idle, self.fresh, self.hash_of
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                if hash_of[b] is not None:
                    idle[b] = None
                else:
                    fresh.append(b)

    def free(self, seq_id: Hashable) -> None:
        self._drop(self.seqs.pop(seq_id).table)
