"""What kvblocks is measured against, written here in the simplest honest form.

* ``pickle_xxh3_hashes``: how vLLM names a block -- pickle the tuple
  ``(parent_hash, tuple(block_tokens), extra_keys)`` and hash the bytes with xxh3-128.
* ``pickle_sha256_hashes``: the same with SHA-256.
* ``FloorManager``: the least any prefix-caching manager can do -- a dict from block
  hash to block id and a deque of free blocks; no tree, no leaf-only eviction, no
  statistics, no validation. It hashes tokens with the same kvblocks code, so the
  comparison isolates the bookkeeping.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import deque
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import xxhash

from kvblocks.hashing import BlockHasher, HashedTokens, PrecomputedHashes

_PROTOCOL = pickle.HIGHEST_PROTOCOL
_NONE_HASH = b"\x00" * 16


def pickle_xxh3_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    out: list[bytes] = []
    parent = _NONE_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = tuple(token_ids[start : start + block_size])
        parent = xxhash.xxh3_128_digest(pickle.dumps((parent, block, None), protocol=_PROTOCOL))
        out.append(parent)
    return out


def pickle_sha256_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    out: list[bytes] = []
    parent = _NONE_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = tuple(token_ids[start : start + block_size])
        parent = hashlib.sha256(pickle.dumps((parent, block, None), protocol=_PROTOCOL)).digest()
        out.append(parent)
    return out


class FloorCached(NamedTuple):
    device: int


class _FloorSeq:
    __slots__ = ("committed", "content", "covered", "registered", "table")

    def __init__(self, content: HashedTokens | PrecomputedHashes) -> None:
        self.content = content
        self.table: list[int] | None = None
        self.covered = self.committed = self.registered = 0


class FloorManager:
    """dict(hash -> block) + deque(free blocks), with the manager's call shapes."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.hasher = BlockHasher(block_size)
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.cached: dict[object, int] = {}
        self.hash_of: list[object] = [None] * num_blocks
        self.ref = [0] * num_blocks
        self.seqs: dict[Hashable, _FloorSeq] = {}

    def add_sequence(self, seq_id, token_ids=None, *, block_hashes=None, num_tokens=None) -> None:
        if block_hashes is not None:
            content = PrecomputedHashes(block_hashes, num_tokens, self.block_size)
        else:
            content = HashedTokens(self.hasher, token_ids)
        self.seqs[seq_id] = _FloorSeq(content)

    def append_tokens(self, seq_id, token_ids) -> None:
        self.seqs[seq_id].content.extend(token_ids)

    def _hits(self, s: _FloorSeq) -> list[int]:
        hashes = s.content.hashes
        limit = min(len(hashes), (s.content.num_tokens - 1) // self.block_size)
        cached = self.cached
        out = []
        for i in range(limit):
            b = cached.get(hashes[i])
            if b is None:
                break
            out.append(b)
        return out

    def lookup(self, seq_id) -> FloorCached:
        return FloorCached(len(self._hits(self.seqs[seq_id])) * self.block_size)

    def _take(self, count: int) -> list[int] | None:
        ref, free, hash_of, cached = self.ref, self.free_blocks, self.hash_of, self.cached
        out = []
        while len(out) < count:
            if not free:
                for b in out:  # give them back
                    ref[b] = 0
                    free.appendleft(b)
                return None
            b = free.popleft()
            if ref[b]:  # stale entry: the block was hit after it was freed
                continue
            h = hash_of[b]
            if h is not None:
                if cached.get(h) == b:
                    del cached[h]
                hash_of[b] = None
            ref[b] = 1
            out.append(b)
        return out

    def allocate(self, seq_id, num_new_tokens: int) -> list[int] | None:
        s = self.seqs[seq_id]
        size = self.block_size
        if s.table is None:
            hits = self._hits(s)
            for b in hits:
                self.ref[b] += 1
            covered = len(hits) * size + num_new_tokens
            new = self._take(-(-covered // size) - len(hits))
            if new is None:
                for b in hits:
                    self.ref[b] -= 1
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

    def commit(self, seq_id, num_computed_tokens: int) -> None:
        s = self.seqs[seq_id]
        full = num_computed_tokens // self.block_size
        hashes, table, cached, hash_of = s.content.hashes, s.table, self.cached, self.hash_of
        for i in range(s.registered, full):
            h = hashes[i]
            if h not in cached:
                cached[h] = table[i]
                hash_of[table[i]] = h
        s.registered = max(s.registered, full)
        s.committed = num_computed_tokens

    def free(self, seq_id) -> None:
        s = self.seqs.pop(seq_id)
        ref, free = self.ref, self.free_blocks
        for b in reversed(s.table or ()):
            ref[b] -= 1
            if ref[b] == 0:
                free.append(b)


class PreviousPlanner:
    """The vLLM connector's scheduler-side save planning as the last release did it (``TransferPlanner.scheduled``
    and ``take_loads`` before issue 29): per scheduled request, the whole real blocks its step fills, minus
    those stored or planned lately -- no provenance, no guards. What ``TransferPlanner.plan_step`` is compared
    against: the cost of never saving a block computed over a failed load."""

    def __init__(self, is_known, block_size: int, recent_saves: int = 1 << 16) -> None:  # type: ignore[no-untyped-def]
        self.is_known = is_known
        self.block_size = block_size
        self.recent_saves = recent_saves
        self.requests: dict[Hashable, list] = {}  # request -> [hashes, block ids, num saved]
        self.planned: dict[bytes, None] = {}
        self.loads: list[tuple[Hashable, tuple[bytes, ...], tuple[int, ...]]] = []

    def allocated(
        self, request_id: Hashable, hashes: Sequence[bytes], block_ids: Sequence[int], first: int, stop: int
    ) -> None:
        self.requests[request_id] = [hashes, list(block_ids), stop]
        self.loads.append((request_id, tuple(hashes[first:stop]), tuple(block_ids[first:stop])))

    def step(self, scheduled: Sequence[tuple[Hashable, int, int, Sequence[int] | None, Sequence[int]]]) -> list:
        loads, self.loads = self.loads, []
        saves = []
        for request_id, computed, new, table, more in scheduled:
            tracked = self.requests[request_id]
            if table is not None:
                tracked[1] = list(table)
            tracked[1].extend(more)
            hashes, ids, start = tracked
            full = min(len(hashes), (computed + new) // self.block_size, len(ids))
            if full <= start:
                continue
            tracked[2] = full
            picked = [
                (h, ids[i])
                for i, h in enumerate(hashes[start:full], start)
                if h not in self.planned and not self.is_known(h)
            ]
            for h, _ in picked:
                self.planned[h] = None
            while len(self.planned) > self.recent_saves:
                del self.planned[next(iter(self.planned))]
            if picked:
                saves.append((request_id, tuple(h for h, _ in picked), tuple(b for _, b in picked)))
        return [loads, saves]
