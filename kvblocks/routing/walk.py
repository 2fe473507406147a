"""The walk of the holder index: a prompt's leading run on each worker, in O(log n) probes per distinct run
length (the galloping and bisection of :mod:`kvblocks.routing.holder_index`'s docstring, and the plain scan
it falls back on)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvblocks.hashing import BlockHash
from kvblocks.routing.interned import Interned
from kvblocks.routing.interned import bits as _bits
from kvblocks.routing.table import M64, KeyTable

__all__ = ["PrefixWalk"]


class PrefixWalk(KeyTable):
    """The read side of :class:`~kvblocks.routing.holder_index.HolderIndex`: :meth:`longest_run` and
    :meth:`runs` over rows whose ids name holder masks (the index keeps them up to date)."""

    _holders: Interned[int]
    _stated: dict[int, dict[int, int | None]]
    suspect: int

    def _probes(self, hashes: Sequence[BlockHash]) -> tuple[Callable[[int], int], Callable[[int, int], bool]]:
        """``probe(i)``: the holders of the prompt's block ``i``; ``linked(i, who)``: each worker of ``who``
        (holders of block ``i``) stated the prompt's block ``i - 1`` as its parent. Both remember what they
        looked up."""
        read_key = self.read_key
        masks, ids, parents, has_parent = self._holders.values, self._ids, self._parents, self._has_parent
        slots: dict[int, int] = {}  # probed position -> slot (-1: no row)
        folded: dict[int, int] = {}  # position -> key, for the positions probed or link-checked
        keys, shift, mult = self._keys, self._shift, self._mult

        def key_at(i: int) -> int:
            key = folded.get(i)
            if key is None:
                h = hashes[i]
                key = folded[i] = h if type(h) is int and 0 <= h <= M64 else read_key(h, i)
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
        if not n or not probe(0) & alive:
            return 0, 0  # nobody holds the first block (a miss): one probe, whatever the prompt's length
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
