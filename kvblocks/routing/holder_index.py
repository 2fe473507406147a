"""Which workers hold which blocks: the router's inverted index, compact, walked in O(log n) probes.

One row per distinct block, in flat arrays with open addressing (linear probing): the block's 64-bit
key, the id of its *holder mask* (a bitmask of worker bits), its parent's key, and the id of its *kid
vector*: how many children directly under it each worker holds. Both are interned -- every block held by
the same set of workers shares one Python int, and a chain's interior blocks share their kid vectors -- so
a (block, worker) entry costs nothing beyond its bit, and a row costs 25 bytes of arrays: 33-67 bytes per
distinct block at the table's 37-75% load.

The walk. A worker's cache is prefix-closed (it holds a block only with the block's parent), so along a
prompt's chain the set of workers holding block ``i`` only shrinks as ``i`` grows. :meth:`HolderIndex.runs`
finds where it shrinks by galloping and bisection -- O(log n) probes per distinct run length, instead of
one probe per block::

    prompt      h0   h1   h2   h3   h4   h5   h6   h7
    holders     abc  abc  abc  ab   ab   ab   ab   a      probes: h1 h3 (shrinks) h2 | h4 h6 h7 (shrinks)
    runs        c: 3, b: 7, a: 8

Exactness. The bisection trusts two facts, and checks for both:

* *The worker is prefix-closed.* Each worker's *orphans* -- blocks it holds without the parent *it*
  stated for them -- are counted exactly, update by update: a block stored before its parent is one, and
  removing a block makes orphans of the worker's own children under it (its count in the block's kid
  vector; another worker's children under it are no hole of this one's). A worker with orphans is
  *suspect* and its run is found by a plain scan; it is trusted again the moment its count returns to 0
  (the parent arrives, the orphans go, or it clears).
* *The prompt is one chain.* Each probed block's parent, as every worker the walk trusts there stated
  it, must be the prompt's block before it (a chained hash fixes every hash before it, so an honest
  prompt always passes). A probe that fails the check makes the whole walk a plain scan.

Parent links are per worker. A row keeps the parent its first writer stated; a worker that states
another one for the same block (a lie, or the truth against an earlier lie) has it kept beside the row
(``_stated``, flagged in the row), and its orphans, kid counts and link checks use its own. So no
worker's events change another worker's run: an honest worker's run is exact whatever the others send,
and a worker's false links can only mislead the walk about that worker itself (whose own claims it
cannot check anyway).

The index, by job: :mod:`kvblocks.routing.table` stores and places the rows (the keys, and how a sender is
kept from aiming them at one cluster), :mod:`kvblocks.routing.interned` holds the values rows share (holder
masks, kid vectors), :mod:`kvblocks.routing.walk` reads the rows (the walk); this module keeps them up to
date (stores, removals, clears, the orphan counts) and checks them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from kvblocks.errors import IntegrityError
from kvblocks.hashing import BlockHash
from kvblocks.routing.interned import Interned as _Interned
from kvblocks.routing.interned import bits as _bits
from kvblocks.routing.interned import bump as _bump
from kvblocks.routing.interned import count as _count
from kvblocks.routing.interned import counts as _counts
from kvblocks.routing.interned import mask as _mask
from kvblocks.routing.interned import unbump as _unbump
from kvblocks.routing.table import _PAD, _TOMB, M64, PROBE_LIMIT
from kvblocks.routing.walk import PrefixWalk

__all__ = ["M64", "PROBE_LIMIT", "HolderIndex"]

_OWN = 2  # has_parent[slot] flag: some holder stated another parent than the row's (bit 0: it has one)


class HolderIndex(PrefixWalk):
    """Block key -> mask of holder bits, with parent links for the closure checks (see the module docstring).

    >>> index = HolderIndex()
    >>> index.add(0, [1, 2, 3], None), index.add(1, [1, 2], None)
    (3, 2)
    >>> index.runs([1, 2, 3, 4], alive=0b11)  # (leading run, workers whose run it is)
    [(2, 2), (3, 1)]

    ``probe_limit``: how far past its home slot an insert may probe before the table is rebuilt under a
    fresh secret (tests lower it to exercise the rebuild).
    """

    def __init__(self, capacity: int = 1024, *, probe_limit: int = PROBE_LIMIT) -> None:
        super().__init__(capacity, probe_limit=probe_limit)
        self._stated: dict[int, dict[int, int | None]] = {}  # key -> bit -> the parent that worker stated,
        # where it is not the row's (see the module docstring)
        self._holders: _Interned[int] = _Interned(0)  # holder masks: id -> mask of worker bits
        self._kid_vectors: _Interned[tuple[int, ...]] = _Interned(())  # kid counts per worker (see _bump)
        self._pending_kids: dict[int, tuple[int, ...]] = {}  # kid vectors of keys that have no row
        self._held: dict[int, int] = {}  # bit -> rows holding it
        self._orphans: dict[int, int] = {}  # bit -> blocks it holds without their recorded parent
        self.suspect = 0  # bits of workers holding an orphan: their caches are not prefix-closed

    # ------------------------------------------------------------------ kid vectors and orphans

    def _kid_moved(self, parent: int, b: int, up: bool) -> int:
        """One (child, worker ``b``) pair more (``up``) or fewer under ``parent`` (its row, or pending);
        returns the parent's slot (-1: no row)."""
        slot = self._find(parent)
        if slot >= 0:
            vectors = self._kid_vectors
            old = self._kids[slot]
            new = vectors.intern((_bump if up else _unbump)(vectors.values[old], b))
            vectors.move(old, new)
            self._kids[slot] = new
            return slot
        planes = (_bump if up else _unbump)(self._pending_kids.get(parent, ()), b)
        if planes:
            self._pending_kids[parent] = planes
        else:
            self._pending_kids.pop(parent, None)
        return -1

    def _orphaned(self, bit: int, delta: int) -> None:
        """Worker ``bit`` holds ``delta`` more blocks without their recorded parent; suspect while any."""
        if delta:
            count = self._orphans.get(bit, 0) + delta
            if count:
                self._orphans[bit] = count
                self.suspect |= 1 << bit
            else:
                del self._orphans[bit]
                self.suspect &= ~(1 << bit)

    # ------------------------------------------------------------------ updates

    def add(self, bit: int, hashes: Iterable[BlockHash], parent: BlockHash | None) -> int:
        """Worker ``bit`` holds the chain ``hashes`` (``parent``'s children, in order). Returns how many it
        did not hold before."""
        return self.add_keys(bit, self.fold_all(hashes), None if parent is None else self.fold(parent))

    def add_keys(self, bit: int, keys: Sequence[int], parent: int | None) -> int:
        """:meth:`add` with keys already folded."""
        self._reserve(len(keys))
        b = 1 << bit
        holders, vectors = self._holders, self._kid_vectors
        masks, refs, dead = holders.values, holders.refs, holders.dead
        planes_of, kid_refs, kid_dead = vectors.values, vectors.refs, vectors.dead
        ids, kids, parents, has_parent = self._ids, self._kids, self._parents, self._has_parent
        table_keys, pending, shift = self._keys, self._pending_kids, self._shift
        mult, limit, stated = self._mult, self.probe_limit, self._stated
        parent_slot, parent_held = -1, False  # the slot of the chain's previous block; whether bit holds it
        if parent is not None:
            parent_slot = self._find(parent)
            parent_held = parent_slot >= 0 and bool(masks[ids[parent_slot]] & b)
        moves: dict[int, int] = {}  # old mask id -> new, memoised: a chain's blocks share their holders
        bumps: dict[int, int] = {}  # old kid-vector id -> new (one more pair of bit's), memoised likewise
        added = orphans = 0
        for key in keys:  # one probe finds the row, or where a new one goes (_find, inlined)
            slot = home = ((key * mult) & M64) >> shift
            tomb = -1
            while True:
                old = ids[slot]
                if old > 0:
                    if table_keys[slot] == key:
                        break
                elif not old:
                    break
                elif tomb < 0:
                    tomb = slot
                slot += 1
            if old > 0:
                if masks[old] & b:
                    parent, parent_slot, parent_held = key, slot, True
                    continue
            else:
                old = 0
                if slot - home > limit:  # a cluster this long is no accident: scatter it under a new secret
                    slot, tomb = self._reseeded_slot(key), -1
                    ids, kids, parents, has_parent = self._ids, self._kids, self._parents, self._has_parent
                    table_keys, shift, mult = self._keys, self._shift, self._mult
                    if parent is not None and parent_slot >= 0:
                        parent_slot = self._find(parent)
                if tomb >= 0:
                    slot = tomb
                else:
                    if slot == len(ids) - 1:  # the last slot stays empty, so that a probe always ends
                        self._extend(_PAD)
                    self._used += 1
                self._live += 1
                planes = pending.pop(key, ()) if pending else ()
                kid = vectors.intern(planes) if planes else 0
                vectors.move(0, kid)
                kids[slot] = kid
                table_keys[slot] = key
                if parent is None:
                    has_parent[slot] = 0
                    parents[slot] = 0
                else:
                    has_parent[slot] = 1
                    parents[slot] = parent
            kid = kids[slot]
            if kid:  # bit's blocks under this one were orphans (measured before a self-link below adds one)
                planes = planes_of[kid]
                orphans -= (planes[0] & b and 1) if len(planes) == 1 else _count(planes, b)
            new = moves.get(old)
            if new is None:
                new = moves[old] = holders.intern(masks[old] | b)
            if old:
                refs[old] -= 1
                if not refs[old]:
                    dead.append(old)
            refs[new] += 1
            ids[slot] = new
            if parent is not None:  # one pair more under the parent bit states (its row, or pending)
                if parent_slot >= 0:
                    up = kids[parent_slot]
                    bumped = bumps.get(up)
                    if bumped is None:
                        bumped = bumps[up] = vectors.intern(_bump(planes_of[up], b))
                    if up:  # vectors.move(up, bumped), inlined
                        kid_refs[up] -= 1
                        if not kid_refs[up]:
                            kid_dead.append(up)
                    kid_refs[bumped] += 1
                    kids[parent_slot] = bumped
                    if not parent_held and parent_slot != slot:  # (a block stated as its own parent holds it)
                        orphans += 1
                else:
                    found = self._kid_moved(parent, b, True)
                    if found < 0 or not masks[ids[found]] & b:
                        orphans += 1
                if old and (parents[slot] != parent or not has_parent[slot] & 1):  # not the row's: bit's own
                    stated.setdefault(key, {})[bit] = parent
                    has_parent[slot] |= _OWN
            elif old and has_parent[slot] & 1:
                stated.setdefault(key, {})[bit] = None
                has_parent[slot] |= _OWN
            added += 1
            parent, parent_slot, parent_held = key, slot, True
        holders.sweep()
        vectors.sweep()
        if added:
            self._held[bit] = self._held.get(bit, 0) + added
        self._orphaned(bit, orphans)
        return added

    def remove(self, bit: int, hashes: Iterable[BlockHash]) -> int:
        """Worker ``bit`` no longer holds ``hashes``. Returns how many it held."""
        return self.remove_keys(bit, self.fold_all(hashes))

    def remove_keys(self, bit: int, keys: Iterable[int]) -> int:
        """:meth:`remove` with keys already folded. Removing a block makes orphans of the worker's blocks
        under it (a hole: it is suspect until they go too, or the block comes back)."""
        b = 1 << bit
        holders, vectors = self._holders, self._kid_vectors
        masks, refs, dead = holders.values, holders.refs, holders.dead
        planes_of, kid_refs, kid_dead = vectors.values, vectors.refs, vectors.dead
        ids, kids, parents, has_parent = self._ids, self._kids, self._parents, self._has_parent
        table_keys, pending, shift = self._keys, self._pending_kids, self._shift
        mult = self._mult
        moves: dict[int, int] = {}  # old mask id -> new (0: no holder left), memoised as in add_keys
        drops: dict[int, int] = {}  # old kid-vector id -> new (one pair of bit's fewer)
        removed = orphans = 0
        for key in keys:  # _find, _kid_moved and the bit's drop, inlined: eviction events are the hot path
            slot = ((key * mult) & M64) >> shift
            while True:
                old = ids[slot]
                if old > 0:
                    if table_keys[slot] == key:
                        break
                elif not old:
                    break
                slot += 1
            if old <= 0 or not masks[old] & b:
                continue
            if has_parent[slot] == 1:
                up: int | None = parents[slot]
            else:  # no parent, or holders that disagree on it
                up = self._forget_stated(key, slot, bit) if has_parent[slot] else None
            if up is not None:  # one pair fewer under the parent (its row, or its pending vector)
                p = ((up * mult) & M64) >> shift
                while True:
                    v = ids[p]
                    if v > 0:
                        if table_keys[p] == up:
                            if not masks[v] & b:
                                orphans -= 1  # this block was an orphan
                            kid = kids[p]
                            dropped = drops.get(kid)
                            if dropped is None:
                                dropped = drops[kid] = vectors.intern(_unbump(planes_of[kid], b))
                            kid_refs[kid] -= 1  # vectors.move(kid, dropped), inlined
                            if not kid_refs[kid]:
                                kid_dead.append(kid)
                            if dropped:
                                kid_refs[dropped] += 1
                            kids[p] = dropped
                            break
                    elif not v:
                        orphans -= 1
                        planes = _unbump(pending.get(up, ()), b)
                        if planes:
                            pending[up] = planes
                        else:
                            pending.pop(up, None)
                        break
                    p += 1
            kid = kids[slot]
            if kid:  # bit's blocks under this one are orphans now
                planes = planes_of[kid]
                orphans += (planes[0] & b and 1) if len(planes) == 1 else _count(planes, b)
            new = moves.get(old)
            if new is None:
                mask = masks[old] & ~b
                new = moves[old] = holders.intern(mask) if mask else 0
            refs[old] -= 1
            if not refs[old]:
                dead.append(old)
            if new:
                refs[new] += 1
                ids[slot] = new
            else:  # the row goes; its kid vector waits in pending for the row to come back
                ids[slot] = _TOMB
                self._live -= 1
                if kid:
                    pending[key] = planes_of[kid]
                    vectors.move(kid, 0)
                    kids[slot] = 0
            removed += 1
        holders.sweep()
        vectors.sweep()
        if removed:
            self._held[bit] -= removed
            self._orphaned(bit, orphans)
        return removed

    def _forget_stated(self, key: int, slot: int, bit: int) -> int | None:
        """The parent worker ``bit`` stated for ``key``'s row (which it leaves), its own or the row's."""
        row = self._parents[slot] if self._has_parent[slot] & 1 else None
        own = self._stated.get(key)
        if own is None or bit not in own:
            return row
        up = own.pop(bit)
        if not own:
            del self._stated[key]
            self._has_parent[slot] &= ~_OWN
        return up

    def clear(self, bit: int) -> int:
        """Worker ``bit`` holds nothing any more. Returns how many blocks it held."""
        keys = self._keys
        removed = self.remove_keys(bit, [keys[slot] for slot in self._slots_of(1 << bit).tolist()])
        self._held.pop(bit, None)
        return removed

    def _slots_of(self, b: int) -> np.ndarray:
        """The slots of the rows whose holders include ``b``."""
        masks = self._holders.values
        with_bit = np.fromiter((bool(m & b) for m in masks), dtype=bool, count=len(masks))
        ids = np.frombuffer(self._ids, dtype=np.int32)
        slots = np.flatnonzero((ids > 0) & with_bit[np.maximum(ids, 0)])
        del ids
        return slots

    # ------------------------------------------------------------------ queries

    def holders(self, h: BlockHash) -> int:
        """The mask of the workers holding ``h`` (0 for none)."""
        slot = self._find(self.fold(h))
        return self._holders.values[self._ids[slot]] if slot >= 0 else 0

    def held(self, bit: int) -> int:
        """How many blocks worker ``bit`` holds."""
        return self._held.get(bit, 0)

    def __len__(self) -> int:
        return self._live

    def items(self) -> Iterator[tuple[int, int]]:
        """(key, holder mask) of every row."""
        masks, keys, ids = self._holders.values, self._keys, self._ids
        for slot in np.flatnonzero(np.frombuffer(ids, dtype=np.int32) > 0).tolist():
            yield keys[slot], masks[ids[slot]]

    # ------------------------------------------------------------------ integrity

    def check(self) -> None:
        """Rebuild every derived count from the rows and compare (tests; O(size))."""
        ids = np.frombuffer(self._ids, dtype=np.int32)
        live = np.flatnonzero(ids > 0).tolist()
        del ids
        if len(live) != self._live:
            raise IntegrityError(f"holder index: {len(live)} rows, {self._live} counted")
        holders, vectors = self._holders, self._kid_vectors
        refs: dict[int, int] = {}
        kid_refs: dict[int, int] = {}
        held: dict[int, int] = {}
        kids: dict[int, dict[int, int]] = {}  # parent key -> bit -> children it holds there
        orphans: dict[int, int] = {}
        for slot in live:
            v, key = self._ids[slot], self._keys[slot]
            refs[v] = refs.get(v, 0) + 1
            kid_refs[self._kids[slot]] = kid_refs.get(self._kids[slot], 0) + 1
            mask = holders.values[v]
            if not mask or holders.ids.get(mask) != v:
                raise IntegrityError(f"holder index: row {slot} has mask id {v} not interned")
            if self._find(key) != slot:
                raise IntegrityError(f"holder index: row {slot} is not found from its key")
            if not 0 <= slot - self._home(key) <= self.probe_limit:
                raise IntegrityError(f"holder index: row {slot} lies beyond the probe limit from its home")
            if key in self._pending_kids:
                raise IntegrityError(f"holder index: row {slot} has a pending kid vector too")
            recorded = self._parents[slot] if self._has_parent[slot] & 1 else None
            own = self._stated.get(key, {})
            if bool(own) != bool(self._has_parent[slot] & _OWN) or _mask(own) & ~mask or recorded in own.values():
                raise IntegrityError(f"holder index: row {slot}'s stated parents are stale")
            for bit in _bits(mask):
                held[bit] = held.get(bit, 0) + 1
                parent = own.get(bit, recorded)
                up = -1 if parent is None else self._find(parent)
                parent_mask = holders.values[self._ids[up]] if up >= 0 else 0
                if parent is not None:
                    under = kids.setdefault(parent, {})
                    under[bit] = under.get(bit, 0) + 1
                    if not parent_mask >> bit & 1:
                        orphans[bit] = orphans.get(bit, 0) + 1
        for table, counted, name in ((holders, refs, "mask"), (vectors, kid_refs, "kid vector")):
            for v in range(1, len(table.values)):
                if table.refs[v] != counted.get(v, 0):
                    raise IntegrityError(
                        f"holder index: {name} id {v} has {table.refs[v]} refs, {counted.get(v, 0)} rows"
                    )
        if {k: c for k, c in self._held.items() if c} != held:
            raise IntegrityError("holder index: per-worker counts are stale")
        recorded = {self._keys[s]: _counts(vectors.values[self._kids[s]]) for s in live if self._kids[s]}
        recorded.update((key, _counts(planes)) for key, planes in self._pending_kids.items())
        if recorded != kids:
            raise IntegrityError("holder index: child counts are stale")
        if self._orphans != orphans or self.suspect != sum(1 << bit for bit in orphans):
            raise IntegrityError("holder index: orphan counts are stale")
        if not all(self._stated.values()) or not set(self._stated) <= {self._keys[slot] for slot in live}:
            raise IntegrityError("holder index: a stated parent is kept for a block without a row")
