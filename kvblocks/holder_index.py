"""Which workers hold which blocks: the router's inverted index, compact, walked in O(log n) probes.

One row per distinct block, in flat arrays with open addressing (linear probing): the block's 64-bit
key, the id of its *holder mask* (a bitmask of worker bits), its parent's key, and ``kids``: how many
(child block, holder) pairs sit directly under it. Holder masks are interned -- every block held by the
same set of workers shares one Python int -- so a (block, worker) entry costs nothing beyond its bit, and
a row costs 25 bytes of arrays: 33-67 bytes per distinct block at the table's 37-75% load.

The walk. A worker's cache is prefix-closed (it holds a block only with the block's parent), so along a
prompt's chain the set of workers holding block ``i`` only shrinks as ``i`` grows. :meth:`HolderIndex.runs`
finds where it shrinks by galloping and bisection -- O(log n) probes per distinct run length, instead of
one probe per block::

    prompt      h0   h1   h2   h3   h4   h5   h6   h7
    holders     abc  abc  abc  ab   ab   ab   ab   a      probes: h1 h3 (shrinks) h2 | h4 h6 h7 (shrinks)
    runs        c: 3, b: 7, a: 8

Exactness. The bisection trusts two facts, and checks for both:

* *The worker is prefix-closed.* A worker stops being trusted ("suspect") when it stores a block whose
  parent it does not hold (events out of order) or removes a block while anyone holds a child of it
  (``kids > 0``: it may have left a hole). A suspect's run is found by a plain scan; the scan's cost is
  counted, and once it outweighs the worker's size its closure is verified (one pass over its rows) and,
  where it holds, trust returns. A worker that drops everything is trusted again at once.
* *The prompt is one chain.* Each probed block's recorded parent must be the prompt's block before it
  (a chained hash fixes every hash before it, so an honest prompt always passes). A probe that fails the
  check makes the whole walk a plain scan.

Keys. An int hash in ``[0, 2**64)`` (vLLM's and SGLang's event forms, ``xxh3-64-1337``) is its own key;
any other hash (bytes digests, wider ints) is folded to 64 bits by xxh3-64 under a per-index random seed,
so folded keys collide only by chance (2**-64 a pair), never by construction.
"""

from __future__ import annotations

import operator
import secrets
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import xxhash

from kvblocks.errors import IntegrityError, InvalidBlockHashError
from kvblocks.hashing import BlockHash

__all__ = ["HolderIndex"]

M64 = (1 << 64) - 1
_GOLD = 0x9E3779B97F4A7C15  # Fibonacci hashing: the key times 2**64/phi, top bits taken
_MAX_LOAD = 0.75  # rows plus tombstones, of the table's capacity
_PAD = 64  # slack after the last home slot: probes run forward, never wrap
_WIDE_INT_SEED = 0x5BD1E9955BD1E995  # ints wider than 64 bits fold under another seed than bytes
_EMPTY, _TOMB = 0, -1  # ids[slot]: 0 empty, -1 deleted, > 0 the row's holder-mask id


class HolderIndex:
    """Block key -> mask of holder bits, with parent links for the closure checks (see the module docstring).

    >>> index = HolderIndex()
    >>> index.add(0, [1, 2, 3], None), index.add(1, [1, 2], None)
    (3, 2)
    >>> index.runs([1, 2, 3, 4], alive=0b11)  # (leading run, workers whose run it is)
    [(2, 2), (3, 1)]
    """

    def __init__(self, capacity: int = 1024) -> None:
        self._seed = secrets.randbits(64)
        self._masks: list[int] = [0]  # id -> mask; id 0 is "held by nobody"
        self._mask_ids: dict[int, int] = {}
        self._refs = array("i", [0])  # rows using each mask id
        self._free_ids: list[int] = []
        self._dead: list[int] = []  # ids whose refs reached 0 during an update, freed at its end
        self._pending_kids: dict[int, int] = {}  # kids of keys that have no row (their parent is gone)
        self._held: dict[int, int] = {}  # bit -> rows holding it
        self.suspect = 0  # bits of workers whose caches may not be prefix-closed
        self._scan_cost: dict[int, int] = {}  # bit -> plain-scan probes spent on it since its last check
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

    def _find(self, key: int) -> int:
        """The slot of ``key``'s row, or -1."""
        ids, keys = self._ids, self._keys
        i = ((key * _GOLD) & M64) >> self._shift
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
        """Rebuild at ``capacity`` without tombstones. Rows sorted by home slot are placed at
        ``max(home, previous + 1)``: a cumulative max, so the whole rebuild is a few numpy passes."""
        ids = np.frombuffer(self._ids, dtype=np.int32)
        live = np.flatnonzero(ids > 0)
        keys = np.frombuffer(self._keys, dtype=np.uint64)[live]
        shift = np.uint64(64 - (capacity.bit_length() - 1))
        home = ((keys * np.uint64(_GOLD)) >> shift).astype(np.int64)
        order = np.argsort(home, kind="stable")
        rank = np.arange(len(order), dtype=np.int64)
        pos = np.maximum.accumulate(home[order] - rank) + rank if len(order) else rank
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

    # ------------------------------------------------------------------ holder masks

    def _intern(self, mask: int) -> int:
        v = self._mask_ids.get(mask)
        if v is None:
            if self._free_ids:
                v = self._free_ids.pop()
                self._masks[v] = mask
            else:
                v = len(self._masks)
                self._masks.append(mask)
                self._refs.append(0)
            self._mask_ids[mask] = v
        return v

    def _retarget(self, slot: int, old: int, new: int) -> None:
        """Point row ``slot`` from mask id ``old`` to ``new`` (either may be 0: no row before / after)."""
        refs = self._refs
        if old:
            refs[old] -= 1
            if not refs[old]:
                self._dead.append(old)
        if new:
            refs[new] += 1
            self._ids[slot] = new

    def _sweep(self) -> None:
        """Free the mask ids no row uses any more (deferred: a freed id must not be reused mid-update)."""
        for v in self._dead:
            if not self._refs[v] and self._mask_ids.get(self._masks[v]) == v:
                del self._mask_ids[self._masks[v]]
                self._masks[v] = 0
                self._free_ids.append(v)
        self._dead.clear()

    def _add_kid(self, parent: int, delta: int) -> None:
        slot = self._find(parent)
        if slot >= 0:
            self._kids[slot] += delta
            return
        count = self._pending_kids.get(parent, 0) + delta
        if count:
            self._pending_kids[parent] = count
        else:
            self._pending_kids.pop(parent, None)

    # ------------------------------------------------------------------ updates

    def add(self, bit: int, hashes: Iterable[BlockHash], parent: BlockHash | None) -> int:
        """Worker ``bit`` holds the chain ``hashes`` (``parent``'s children, in order). Returns how many it
        did not hold before."""
        return self.add_keys(bit, self.fold_all(hashes), None if parent is None else self.fold(parent))

    def add_keys(self, bit: int, keys: Sequence[int], parent: int | None) -> int:
        """:meth:`add` with keys already folded."""
        self._reserve(len(keys))
        b = 1 << bit
        masks, ids, kids = self._masks, self._ids, self._kids
        parents, has_parent = self._parents, self._has_parent
        if parent is not None:
            parent_slot = self._find(parent)
            if parent_slot < 0 or not masks[ids[parent_slot]] & b:
                self.suspect |= b  # a block before its parent: not prefix-closed (for now)
        else:
            parent_slot = -1
        moves: dict[int, int] = {}  # old mask id -> new, memoised: a chain's blocks share their holders
        table_keys, refs, dead, pending, shift = self._keys, self._refs, self._dead, self._pending_kids, self._shift
        added = 0
        for key in keys:  # one probe finds the row, or where a new one goes (_find, inlined)
            slot = ((key * _GOLD) & M64) >> shift
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
                if (parents[slot] if has_parent[slot] else None) != parent:
                    self.suspect |= b  # two stories of this block's parent: trust the recorded one only
                if masks[old] & b:
                    parent, parent_slot = key, slot
                    continue
            else:
                old = 0
                if tomb >= 0:
                    slot = tomb
                else:
                    if slot == len(ids) - 1:  # the last slot stays empty, so that a probe always ends
                        self._extend(_PAD)
                    self._used += 1
                self._live += 1
                kids[slot] = pending.pop(key, 0) if pending else 0
                table_keys[slot] = key
                if parent is None:
                    has_parent[slot] = 0
                    parents[slot] = 0
                else:
                    has_parent[slot] = 1
                    parents[slot] = parent
            new = moves.get(old)
            if new is None:
                new = moves[old] = self._intern(masks[old] | b)
            if old:
                refs[old] -= 1
                if not refs[old]:
                    dead.append(old)
            refs[new] += 1
            ids[slot] = new
            if has_parent[slot]:
                recorded = parents[slot]
                if recorded == parent and parent_slot >= 0:
                    kids[parent_slot] += 1
                else:
                    self._add_kid(recorded, 1)
            added += 1
            parent, parent_slot = key, slot
        self._sweep()
        if added:
            self._held[bit] = self._held.get(bit, 0) + added
        return added

    def remove(self, bit: int, hashes: Iterable[BlockHash]) -> int:
        """Worker ``bit`` no longer holds ``hashes``. Returns how many it held."""
        return self.remove_keys(bit, self.fold_all(hashes))

    def remove_keys(self, bit: int, keys: Iterable[int]) -> int:
        """:meth:`remove` with keys already folded. A worker that removes a block someone holds a child
        of (after the whole batch: a chain removed head first is not a hole) becomes suspect."""
        b = 1 << bit
        masks, ids, table_keys, kids = self._masks, self._ids, self._keys, self._kids
        parents, has_parent, refs, dead = self._parents, self._has_parent, self._refs, self._dead
        pending, shift = self._pending_kids, self._shift
        moves: dict[int, int] = {}  # old mask id -> new (0: no holder left), memoised as in add_keys
        removed: list[tuple[int, int]] = []  # (key, slot): no rehash happens in a removal, slots hold
        for key in keys:  # _find, _add_kid and the bit's drop, inlined: eviction events are the hot path
            slot = ((key * _GOLD) & M64) >> shift
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
            if has_parent[slot]:  # one kid fewer under its parent (or the parent's pending count)
                up = parents[slot]
                p = ((up * _GOLD) & M64) >> shift
                while True:
                    v = ids[p]
                    if v > 0:
                        if table_keys[p] == up:
                            kids[p] -= 1
                            break
                    elif not v:
                        count = pending.get(up, 0) - 1
                        if count:
                            pending[up] = count
                        else:
                            pending.pop(up, None)
                        break
                    p += 1
            new = moves.get(old)
            if new is None:
                mask = masks[old] & ~b
                new = moves[old] = self._intern(mask) if mask else 0
            refs[old] -= 1
            if not refs[old]:
                dead.append(old)
            if new:
                refs[new] += 1
                ids[slot] = new
            else:
                ids[slot] = _TOMB
                self._live -= 1
                if kids[slot]:
                    pending[key] = pending.get(key, 0) + kids[slot]
            removed.append((key, slot))
        self._sweep()
        if removed:
            self._held[bit] -= len(removed)
            if not self._held[bit]:
                self._trust(bit)
            elif not self.suspect & b:
                kids, pending = self._kids, self._pending_kids
                for key, slot in removed:  # a row removed whole keeps its kids count in pending
                    if (kids[slot] if ids[slot] > 0 else pending.get(key, 0)) > 0:
                        self.suspect |= b
                        break
        return len(removed)

    def _drop_bit(self, slot: int, b: int) -> None:
        old = self._ids[slot]
        if self._has_parent[slot]:
            self._add_kid(self._parents[slot], -1)
        mask = self._masks[old] & ~b
        if mask:
            self._retarget(slot, old, self._intern(mask))
            return
        self._retarget(slot, old, 0)
        self._ids[slot] = _TOMB
        self._live -= 1
        if self._kids[slot]:
            key = self._keys[slot]
            self._pending_kids[key] = self._pending_kids.get(key, 0) + self._kids[slot]

    def clear(self, bit: int) -> int:
        """Worker ``bit`` holds nothing any more. Returns how many blocks it held."""
        b = 1 << bit
        slots = self._slots_of(b)
        for slot in slots.tolist():
            self._drop_bit(slot, b)
        self._sweep()
        self._held.pop(bit, None)
        self._trust(bit)
        return len(slots)

    def _slots_of(self, b: int) -> np.ndarray:
        """The slots of the rows whose holders include ``b``."""
        with_bit = np.fromiter((bool(m & b) for m in self._masks), dtype=bool, count=len(self._masks))
        ids = np.frombuffer(self._ids, dtype=np.int32)
        slots = np.flatnonzero((ids > 0) & with_bit[np.maximum(ids, 0)])
        del ids
        return slots

    def _trust(self, bit: int) -> None:
        self.suspect &= ~(1 << bit)
        self._scan_cost.pop(bit, None)

    def verify(self, bit: int) -> bool:
        """Check worker ``bit``'s closure (every block it holds has its parent held by it, or is a root);
        trust it again if so. One pass over its rows."""
        b = 1 << bit
        masks, ids, parents, has_parent = self._masks, self._ids, self._parents, self._has_parent
        for slot in self._slots_of(b).tolist():
            if has_parent[slot]:
                p = self._find(parents[slot])
                if p < 0 or not masks[ids[p]] & b:
                    self._scan_cost[bit] = 0
                    return False
        self._trust(bit)
        return True

    # ------------------------------------------------------------------ queries

    def holders(self, h: BlockHash) -> int:
        """The mask of the workers holding ``h`` (0 for none)."""
        slot = self._find(self.fold(h))
        return self._masks[self._ids[slot]] if slot >= 0 else 0

    def held(self, bit: int) -> int:
        """How many blocks worker ``bit`` holds."""
        return self._held.get(bit, 0)

    def __len__(self) -> int:
        return self._live

    def items(self) -> Iterator[tuple[int, int]]:
        """(key, holder mask) of every row."""
        masks, keys, ids = self._masks, self._keys, self._ids
        for slot in np.flatnonzero(np.frombuffer(ids, dtype=np.int32) > 0).tolist():
            yield keys[slot], masks[ids[slot]]

    def _probes(self, hashes: Sequence[BlockHash]) -> tuple[Callable[[int], int], Callable[[int], bool]]:
        """``probe(i)``: the holders of the prompt's block ``i``; ``linked(i)``: a held block ``i``'s
        recorded parent is the prompt's block ``i - 1``. Both remember what they looked up."""
        fold = self.fold
        masks, ids, parents, has_parent = self._masks, self._ids, self._parents, self._has_parent
        slots: dict[int, int] = {}  # probed position -> slot (-1: no row)
        folded: dict[int, int] = {}  # position -> key, for the positions probed or link-checked
        keys, shift = self._keys, self._shift

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
                slot = ((key * _GOLD) & M64) >> shift
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

        def linked(i: int) -> bool:  # held block i's recorded parent is the prompt's block i - 1
            slot = slots[i]
            if not i:
                return True
            return has_parent[slot] == 1 and parents[slot] == key_at(i - 1)

        return probe, linked

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
                if not linked(mid):
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
            if cur and not linked(pos):
                return self._plain(probe, n, alive, min_run)
        while cur and pos < n:
            m = probe(pos) & cur
            if m != cur:  # the run of the workers that dropped out ends here
                groups[pos] = groups.get(pos, 0) | (cur & ~m)
                cur = m
                if not cur:
                    break
            if not linked(pos):
                return self._plain(probe, n, alive, min_run)
            # cur holds blocks ..pos; find the first block it does not all hold: the last block first
            # (a fully cached prompt ends here), then galloping from pos and bisecting
            lo, hi = pos, n
            if pos < n - 1:
                if probe(n - 1) & cur == cur:
                    if not linked(n - 1):
                        return self._plain(probe, n, alive, min_run)
                    lo = n - 1
                else:
                    hi, step = n - 1, 1
                    while lo + step < hi:
                        j = lo + step
                        if probe(j) & cur != cur:
                            hi = j
                            break
                        if not linked(j):
                            return self._plain(probe, n, alive, min_run)
                        lo, step = j, step * 2
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if probe(mid) & cur == cur:
                    if not linked(mid):
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
        self._scan(probe, n, alive, groups, count=False)
        return sorted((run, mask) for run, mask in groups.items() if run >= min_run)

    def _scan(
        self, probe: Callable[[int], int], n: int, alive: int, groups: dict[int, int], count: bool = True
    ) -> None:
        """One probe per block while any of ``alive`` holds them all (the suspects' path, and the
        fallback for a prompt that is not one chain). Suspects' probes count toward their verification."""
        i, cur = 0, alive
        while cur and i < n:
            m = probe(i) & cur
            if m != cur:
                groups[i] = groups.get(i, 0) | (cur & ~m)
                cur = m
            i += 1
        if cur:
            groups[i] = groups.get(i, 0) | cur
        if count:
            self._charge(alive, i)

    def _charge(self, suspects: int, probes: int) -> None:
        """Scans of a suspect cost its probes; past its size (+ a floor) its closure is verified."""
        while suspects:
            low = suspects & -suspects
            suspects ^= low
            bit = low.bit_length() - 1
            cost = self._scan_cost.get(bit, 0) + probes
            if cost > 256 + self._held.get(bit, 0):
                self.verify(bit)  # resets the cost, or trusts the worker again
            else:
                self._scan_cost[bit] = cost

    # ------------------------------------------------------------------ integrity

    def check(self) -> None:
        """Rebuild every derived count from the rows and compare (tests; O(size))."""
        ids = np.frombuffer(self._ids, dtype=np.int32)
        live = np.flatnonzero(ids > 0).tolist()
        del ids
        if len(live) != self._live:
            raise IntegrityError(f"holder index: {len(live)} rows, {self._live} counted")
        refs: dict[int, int] = {}
        held: dict[int, int] = {}
        kids: dict[int, int] = {}
        by_key: dict[int, int] = {}
        for slot in live:
            v = self._ids[slot]
            refs[v] = refs.get(v, 0) + 1
            mask = self._masks[v]
            if not mask or self._mask_ids.get(mask) != v:
                raise IntegrityError(f"holder index: row {slot} has mask id {v} not interned")
            if self._find(self._keys[slot]) != slot:
                raise IntegrityError(f"holder index: row {slot} is not found from its key")
            by_key[self._keys[slot]] = slot
            while mask:
                low = mask & -mask
                mask ^= low
                held[low.bit_length() - 1] = held.get(low.bit_length() - 1, 0) + 1
            if self._has_parent[slot]:
                pairs = self._masks[v].bit_count()
                kids[self._parents[slot]] = kids.get(self._parents[slot], 0) + pairs
        for v in range(1, len(self._masks)):
            if self._refs[v] != refs.get(v, 0):
                raise IntegrityError(f"holder index: mask id {v} has {self._refs[v]} refs, {refs.get(v, 0)} rows")
        if {k: c for k, c in self._held.items() if c} != held:
            raise IntegrityError("holder index: per-worker counts are stale")
        recorded = {self._keys[s]: self._kids[s] for s in live if self._kids[s]}
        recorded.update(self._pending_kids)
        if recorded != kids:
            raise IntegrityError("holder index: child counts are stale")
