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

Keys and placement. An int hash in ``[0, 2**64)`` (vLLM's and SGLang's event forms, ``xxh3-64-1337``) is
its own key; any other hash (bytes digests, wider ints) is folded to 64 bits by xxh3-64 under a per-index
random seed, so folded keys collide only by chance (2**-64 a pair), never by construction. Every key is
placed by multiply-shift hashing under a per-index secret, a random odd multiplier from :mod:`secrets`:
``(key * mult mod 2**64) >> shift``, a universal family (two keys share a home slot with probability at
most 2 / capacity, whichever keys a sender picks), so a sender who cannot see the secret cannot aim keys
at one cluster. The probe length is bounded too: an insert whose probe runs more than ``probe_limit``
slots past its home (the secret leaked, or rare bad luck: random keys stay under ~250 at 10M rows) first
rebuilds the table under a fresh secret, redrawn until no run of occupied slots is longer than the limit.
So no row ever sits farther than the limit from its home, and a long cluster lasts only until the next
insert that crosses it. Results never depend on the placement.
"""

from __future__ import annotations

import operator
import secrets
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Generic, TypeVar

import numpy as np
import xxhash

from kvblocks.errors import IntegrityError, InvalidArgumentError, InvalidBlockHashError
from kvblocks.hashing import BlockHash

__all__ = ["HolderIndex"]

M64 = (1 << 64) - 1
PROBE_LIMIT = 512  # the farthest a row may sit past its home slot (honest tables: <~250 at 10M rows)
_MAX_LOAD = 0.75  # rows plus tombstones, of the table's capacity
_PAD = 64  # slack after the last home slot: probes run forward, never wrap
_WIDE_INT_SEED = 0x5BD1E9955BD1E995  # ints wider than 64 bits fold under another seed than bytes
_EMPTY, _TOMB = 0, -1  # ids[slot]: 0 empty, -1 deleted, > 0 the row's holder-mask id
_OWN = 2  # has_parent[slot] flag: some holder stated another parent than the row's (bit 0: it has one)


V = TypeVar("V", int, tuple[int, ...])


def _secret_multiplier() -> int:
    """A random odd multiplier, from the OS's randomness: senders cannot predict placement."""
    return secrets.randbits(64) | 1


class _Interned(Generic[V]):
    """Values many rows share, each stored once: ``values[id]``, ``ids[value]`` and ``refs[id]`` (rows
    using it). Id 0 is the empty value, never counted or freed. An id whose count reaches 0 is freed only
    by :meth:`sweep`, at the end of an update: an update memoises its id moves, and must not see an id
    reused under it."""

    __slots__ = ("dead", "free", "ids", "refs", "values")

    def __init__(self, empty: V) -> None:
        self.values: list[V] = [empty]
        self.ids: dict[V, int] = {empty: 0}
        self.refs = array("i", [0])
        self.free: list[int] = []
        self.dead: list[int] = []  # ids whose count reached 0 during the update

    def intern(self, value: V) -> int:
        v = self.ids.get(value)
        if v is None:
            if self.free:
                v = self.free.pop()
                self.values[v] = value
            else:
                v = len(self.values)
                self.values.append(value)
                self.refs.append(0)
            self.ids[value] = v
        return v

    def move(self, old: int, new: int) -> None:
        """A row stops using ``old`` and uses ``new`` (either may be 0)."""
        if old:
            self.refs[old] -= 1
            if not self.refs[old]:
                self.dead.append(old)
        if new:
            self.refs[new] += 1

    def sweep(self) -> None:
        """Free the ids no row uses any more."""
        refs, values, ids = self.refs, self.values, self.ids
        for v in self.dead:
            if not refs[v] and ids.get(values[v]) == v:
                del ids[values[v]]
                values[v] = values[0]
                self.free.append(v)
        self.dead.clear()


# A kid vector: how many children under one block each worker holds, bit-sliced -- plane k is the mask of
# the workers whose count has bit k set -- so that one worker's +1 or -1 is a few operations on ints, and
# the common vectors (a chain's interior blocks: one child per holder, the child's own holder mask) are
# shared like holder masks. E.g. worker 0 with 3 kids and worker 2 with 1: planes (0b101, 0b001).


def _bump(planes: tuple[int, ...], b: int) -> tuple[int, ...]:
    """``planes`` with worker mask ``b``'s count one higher (a binary carry through the planes)."""
    out = list(planes)
    for k, plane in enumerate(out):
        if not plane & b:
            out[k] = plane | b
            return tuple(out)
        out[k] = plane ^ b
    out.append(b)
    return tuple(out)


def _unbump(planes: tuple[int, ...], b: int) -> tuple[int, ...]:
    """``planes`` with worker mask ``b``'s count (at least 1) one lower, empty planes at the top dropped."""
    out = list(planes)
    for k, plane in enumerate(out):
        out[k] = plane ^ b
        if plane & b:
            break
    while out and not out[-1]:
        out.pop()
    return tuple(out)


def _count(planes: tuple[int, ...], b: int) -> int:
    """Worker mask ``b``'s count."""
    count, weight = 0, 1
    for plane in planes:
        if plane & b:
            count += weight
        weight <<= 1
    return count


def _longest_cluster(pos: np.ndarray) -> int:
    """The longest run of consecutive slots among the sorted, distinct ``pos``."""
    if not len(pos):
        return 0
    breaks = np.flatnonzero(np.diff(pos) != 1)
    edges = np.concatenate(([-1], breaks, [len(pos) - 1]))
    return int(np.diff(edges).max())


def _mask(bits: Iterable[int]) -> int:
    mask = 0
    for bit in bits:
        mask |= 1 << bit
    return mask


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        mask ^= low
        yield low.bit_length() - 1


def _counts(planes: tuple[int, ...]) -> dict[int, int]:
    """bit -> count of a kid vector (the integrity check)."""
    union = 0
    for plane in planes:
        union |= plane
    return {bit: _count(planes, 1 << bit) for bit in _bits(union)}


class HolderIndex:
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
        if isinstance(probe_limit, bool) or not isinstance(probe_limit, int) or probe_limit < 1:
            raise InvalidArgumentError(f"probe_limit must be an int >= 1, got {probe_limit!r}")
        self.probe_limit = probe_limit
        self._seed = secrets.randbits(64)  # folds non-int hashes; fixed for the index's life (keys keep it)
        self._mult = _secret_multiplier()  # places keys; drawn again on every rehash
        self._stated: dict[int, dict[int, int | None]] = {}  # key -> bit -> the parent that worker stated,
        # where it is not the row's (see the module docstring)
        self._holders: _Interned[int] = _Interned(0)  # holder masks: id -> mask of worker bits
        self._kid_vectors: _Interned[tuple[int, ...]] = _Interned(())  # kid counts per worker (see _bump)
        self._pending_kids: dict[int, tuple[int, ...]] = {}  # kid vectors of keys that have no row
        self._held: dict[int, int] = {}  # bit -> rows holding it
        self._orphans: dict[int, int] = {}  # bit -> blocks it holds without their recorded parent
        self.suspect = 0  # bits of workers holding an orphan: their caches are not prefix-closed
        self._live = 0
        self._used = 0  # live rows + tombstones
        self._allocate(max(16, 1 << (max(capacity, 1) - 1).bit_length()))

    # ------------------------------------------------------------------ storage

    def _allocate(self, capacity: int, pad: int = _PAD) -> None:
        self._cap = capacity
        self._shift = 64 - (capacity.bit_length() - 1)
        size = capacity + pad
        self._keys = array("Q", bytes(8 * size))
        self._parents = array("Q", bytes(8 * size))
        self._has_parent = array("B", bytes(size))
        self._ids = array("i", bytes(4 * size))
        self._kids = array("i", bytes(4 * size))

    def fold(self, h: BlockHash) -> int:
        """The 64-bit key of a block hash (itself for an int in ``[0, 2**64)``)."""
        if type(h) is int and 0 <= h <= M64:
            return h
        if isinstance(h, bytes):
            return xxhash.xxh3_64_intdigest(h, self._seed)
        if not isinstance(h, bool):
            try:
                wide = operator.index(h)  # numpy integers index as the ints they are
            except TypeError:
                raise InvalidBlockHashError(f"a block hash is an int or bytes, got {type(h).__name__}") from None
            if 0 <= wide <= M64:
                return wide
            data = wide.to_bytes(wide.bit_length() // 8 + 1, "big", signed=True)
            return xxhash.xxh3_64_intdigest(data, self._seed ^ _WIDE_INT_SEED)  # apart from bytes digests
        raise InvalidBlockHashError(f"a block hash is an int or bytes, got {type(h).__name__}")

    def fold_all(self, hashes: Iterable[BlockHash]) -> list[int]:
        """``[fold(h) for h in hashes]``, in C when every hash is a 64-bit int (an event's usual batch):
        ``array('Q')`` refuses anything else, and a ``bool`` (which it would take) sends the batch to the
        per-item path, which refuses it."""
        hashes = hashes if type(hashes) is list else list(hashes)
        try:
            packed = array("Q", hashes)
        except (TypeError, OverflowError):
            packed = None
        if packed is None or bool in set(map(type, hashes)):
            fold = self.fold
            return [fold(h) for h in hashes]
        return packed.tolist()

    def _home(self, key: int) -> int:
        """The slot where ``key``'s probe starts."""
        return ((key * self._mult) & M64) >> self._shift

    def _find(self, key: int) -> int:
        """The slot of ``key``'s row, or -1."""
        ids, keys = self._ids, self._keys
        i = self._home(key)
        while True:
            v = ids[i]
            if v > 0:
                if keys[i] == key:
                    return i
            elif v == _EMPTY:
                return -1
            i += 1

    def _extend(self, more: int) -> None:
        """More slack after the last slot, in place: slots and the arrays themselves stay valid."""
        for column in (self._keys, self._parents, self._has_parent, self._ids, self._kids):
            column.frombytes(bytes(column.itemsize * more))

    def _reserve(self, more: int) -> None:
        """Room for ``more`` new rows without a rehash (so slots held across an update stay valid)."""
        if self._used + more <= _MAX_LOAD * self._cap:
            return
        need = self._live + more
        capacity = self._cap
        while need > _MAX_LOAD * capacity / 2:
            capacity *= 2
        self._rehash(capacity)

    def _rehash(self, capacity: int) -> None:
        """Rebuild at ``capacity`` (or more) without tombstones, under a fresh placement secret. Rows sorted
        by home slot are placed at ``max(home, previous + 1)``: a cumulative max, so the whole rebuild is a
        few numpy passes. A placement with a run of occupied slots longer than the probe limit is drawn
        again (every fourth draw at twice the capacity), so that right after it every probe, of a key
        present or not, ends within the limit."""
        ids = np.frombuffer(self._ids, dtype=np.int32)
        live = np.flatnonzero(ids > 0)
        keys = np.frombuffer(self._keys, dtype=np.uint64)[live]
        attempt = 0
        while True:
            attempt += 1
            mult = _secret_multiplier()
            shift = np.uint64(64 - (capacity.bit_length() - 1))
            home = ((keys * np.uint64(mult)) >> shift).astype(np.int64)
            order = np.argsort(home, kind="stable")
            rank = np.arange(len(order), dtype=np.int64)
            pos = np.maximum.accumulate(home[order] - rank) + rank if len(order) else rank
            if _longest_cluster(pos) <= self.probe_limit:
                break
            if not attempt % 4:
                capacity *= 2
        self._mult = mult
        columns = [
            (keys[order], "Q", np.uint64),
            (np.frombuffer(self._parents, dtype=np.uint64)[live][order], "Q", np.uint64),
            (np.frombuffer(self._has_parent, dtype=np.uint8)[live][order], "B", np.uint8),
            (ids[live][order], "i", np.int32),
            (np.frombuffer(self._kids, dtype=np.int32)[live][order], "i", np.int32),
        ]
        del ids
        overflow = int(pos[-1]) - capacity + 1 if len(pos) else 0
        size = capacity + max(_PAD, 2 * overflow + _PAD)
        built = []
        for values, code, dtype in columns:
            column = np.zeros(size, dtype=dtype)
            column[pos] = values
            built.append(array(code, column.tobytes()))
        self._keys, self._parents, self._has_parent, self._ids, self._kids = built
        self._cap = capacity
        self._shift = 64 - (capacity.bit_length() - 1)
        self._used = self._live

    def _reseeded_slot(self, key: int) -> int:
        """An insert of ``key`` probed past the limit (its secret leaked, or rare bad luck): rebuild under
        a fresh secret and return the empty slot where ``key`` goes now (within the limit: see _rehash)."""
        self._rehash(self._cap)
        ids = self._ids
        slot = self._home(key)
        while ids[slot]:
            slot += 1
        return slot

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

    def _probes(self, hashes: Sequence[BlockHash]) -> tuple[Callable[[int], int], Callable[[int, int], bool]]:
        """``probe(i)``: the holders of the prompt's block ``i``; ``linked(i, who)``: each worker of ``who``
        (holders of block ``i``) stated the prompt's block ``i - 1`` as its parent. Both remember what they
        looked up."""
        fold = self.fold
        masks, ids, parents, has_parent = self._holders.values, self._ids, self._parents, self._has_parent
        slots: dict[int, int] = {}  # probed position -> slot (-1: no row)
        folded: dict[int, int] = {}  # position -> key, for the positions probed or link-checked
        keys, shift, mult = self._keys, self._shift, self._mult

        def key_at(i: int) -> int:
            key = folded.get(i)
            if key is None:
                h = hashes[i]
                key = folded[i] = h if type(h) is int and 0 <= h <= M64 else fold(h)
            return key

        def probe(i: int) -> int:  # fold and _find, inlined: this is the walk's whole cost
            slot = slots.get(i)
            if slot is None:
                key = key_at(i)
                slot = ((key * mult) & M64) >> shift
                while True:
                    v = ids[slot]
                    if v > 0:
                        if keys[slot] == key:
                            break
                    elif not v:
                        slot = -1
                        break
                    slot += 1
                slots[i] = slot
            return masks[ids[slot]] if slot >= 0 else 0

        def linked(i: int, who: int) -> bool:  # every worker of who states block i - 1 as held block i's parent
            slot = slots[i]
            if not i:
                return True
            flag = has_parent[slot]
            if flag == 1:
                return parents[slot] == key_at(i - 1)
            return flag > 1 and self._stated_by_all(keys[slot], slot, key_at(i - 1), who)

        return probe, linked

    def _stated_by_all(self, key: int, slot: int, parent: int, who: int) -> bool:
        """Each worker of ``who`` stated ``parent`` as ``key``'s (a row whose holders disagree)."""
        own = self._stated[key]
        row = self._parents[slot] if self._has_parent[slot] & 1 else None
        return all(own.get(bit, row) == parent for bit in _bits(who))

    def longest_run(self, hashes: Sequence[BlockHash], alive: int) -> tuple[int, int] | None:
        """The longest leading run any of ``alive`` holds, and the mask of the workers holding it, by
        bisection over "anyone holds block ``j``" (the last block tried first): O(log n) probes however
        the runs below it are spread. None when a suspect is among ``alive`` or a probe's link fails
        (then :meth:`runs` answers)."""
        if alive & self.suspect:
            return None
        n = len(hashes)
        probe, linked = self._probes(hashes)
        lo, hi, top = -1, n, 0  # someone holds block lo (-1: vacuously); nobody holds block hi (n: past the end)
        mid = n - 1
        while hi - lo > 1:
            held = probe(mid) & alive
            if held:
                if not linked(mid, held):
                    return None
                lo, top = mid, held
            else:
                hi = mid
            mid = (lo + hi) // 2
        return lo + 1, top

    def runs(self, hashes: Sequence[BlockHash], alive: int, min_run: int = 0) -> list[tuple[int, int]]:
        """(leading run, mask of the ``alive`` workers whose run it is), one entry per distinct run
        length, shortest first. Workers of ``alive`` holding nothing get run 0. With ``min_run``, only
        the runs of at least that many blocks, and the walk starts at block ``min_run - 1``: whoever
        holds it holds every block before it."""
        n = len(hashes)
        if not alive or min_run > n:
            return []
        probe, linked = self._probes(hashes)
        groups: dict[int, int] = {}
        suspects = alive & self.suspect
        if suspects:
            self._scan(probe, n, suspects, groups)
        pos, cur = 0, alive & ~suspects
        if min_run > 1 and cur:
            pos = min_run - 1
            cur &= probe(pos)
            if cur and not linked(pos, cur):
                return self._plain(probe, n, alive, min_run)
        while cur and pos < n:
            m = probe(pos) & cur
            if m != cur:  # the run of the workers that dropped out ends here
                groups[pos] = groups.get(pos, 0) | (cur & ~m)
                cur = m
                if not cur:
                    break
            if not linked(pos, cur):
                return self._plain(probe, n, alive, min_run)
            # cur holds blocks ..pos; find the first block it does not all hold: the last block first
            # (a fully cached prompt ends here), then galloping from pos and bisecting
            lo, hi = pos, n
            if pos < n - 1:
                if probe(n - 1) & cur == cur:
                    if not linked(n - 1, cur):
                        return self._plain(probe, n, alive, min_run)
                    lo = n - 1
                else:
                    hi, step = n - 1, 1
                    while lo + step < hi:
                        j = lo + step
                        if probe(j) & cur != cur:
                            hi = j
                            break
                        if not linked(j, cur):
                            return self._plain(probe, n, alive, min_run)
                        lo, step = j, step * 2
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if probe(mid) & cur == cur:
                    if not linked(mid, cur):
                        return self._plain(probe, n, alive, min_run)
                    lo = mid
                else:
                    hi = mid
            pos = hi
        if cur:
            groups[pos] = groups.get(pos, 0) | cur
        return sorted((run, mask) for run, mask in groups.items() if run >= min_run)

    def _plain(self, probe: Callable[[int], int], n: int, alive: int, min_run: int) -> list[tuple[int, int]]:
        groups: dict[int, int] = {}
        self._scan(probe, n, alive, groups)
        return sorted((run, mask) for run, mask in groups.items() if run >= min_run)

    @staticmethod
    def _scan(probe: Callable[[int], int], n: int, alive: int, groups: dict[int, int]) -> None:
        """One probe per block while any of ``alive`` holds them all (the suspects' path, and the
        fallback for a prompt that is not one chain)."""
        i, cur = 0, alive
        while cur and i < n:
            m = probe(i) & cur
            if m != cur:
                groups[i] = groups.get(i, 0) | (cur & ~m)
                cur = m
            i += 1
        if cur:
            groups[i] = groups.get(i, 0) | cur

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
