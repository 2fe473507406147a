"""Values the rows of the holder index share, each stored once (:class:`Interned`), and the bit-sliced kid
vectors: how many children under one block each worker holds (:func:`bump`, :func:`unbump`, :func:`count`)."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

__all__ = ["Interned", "bits", "bump", "count", "counts", "mask", "unbump"]

V = TypeVar("V", int, tuple[int, ...])


class Interned(Generic[V]):
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


def bump(planes: tuple[int, ...], b: int) -> tuple[int, ...]:
    """``planes`` with worker mask ``b``'s count one higher (a binary carry through the planes)."""
    out = list(planes)
    for k, plane in enumerate(out):
        if not plane & b:
            out[k] = plane | b
            return tuple(out)
        out[k] = plane ^ b
    out.append(b)
    return tuple(out)


def unbump(planes: tuple[int, ...], b: int) -> tuple[int, ...]:
    """``planes`` with worker mask ``b``'s count (at least 1) one lower, empty planes at the top dropped."""
    out = list(planes)
    for k, plane in enumerate(out):
        out[k] = plane ^ b
        if plane & b:
            break
    while out and not out[-1]:
        out.pop()
    return tuple(out)


def count(planes: tuple[int, ...], b: int) -> int:
    """Worker mask ``b``'s count."""
    count, weight = 0, 1
    for plane in planes:
        if plane & b:
            count += weight
        weight <<= 1
    return count


def mask(bits: Iterable[int]) -> int:
    mask = 0
    for bit in bits:
        mask |= 1 << bit
    return mask


def bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        mask ^= low
        yield low.bit_length() - 1


def counts(planes: tuple[int, ...]) -> dict[int, int]:
    """bit -> count of a kid vector (the integrity check)."""
    union = 0
    for plane in planes:
        union |= plane
    return {bit: count(planes, 1 << bit) for bit in bits(union)}
