"""The rows of the router's holder index (:class:`kvblocks.routing.holder_index.HolderIndex`): flat columns
with open addressing (linear probing), placed under a per-table secret.

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
from collections.abc import Iterable

import numpy as np
import xxhash

from kvblocks.errors import InvalidArgumentError, InvalidBlockHashError
from kvblocks.hashing import BlockHash
from kvblocks.hashing.tokens import checked_block_hash

__all__ = ["M64", "PROBE_LIMIT", "KeyTable"]

M64 = (1 << 64) - 1
PROBE_LIMIT = 512  # the farthest a row may sit past its home slot (honest tables: <~250 at 10M rows)
_MAX_LOAD = 0.75  # rows plus tombstones, of the table's capacity
_PAD = 64  # slack after the last home slot: probes run forward, never wrap
_WIDE_INT_SEED = 0x5BD1E9955BD1E995  # ints wider than 64 bits fold under another seed than bytes
_EMPTY, _TOMB = 0, -1  # ids[slot]: 0 empty, -1 deleted, > 0 the row's holder-mask id


def _secret_multiplier() -> int:
    """A random odd multiplier, from the OS's randomness: senders cannot predict placement."""
    return secrets.randbits(64) | 1


def _longest_cluster(pos: np.ndarray) -> int:
    """The longest run of consecutive slots among the sorted, distinct ``pos``."""
    if not len(pos):
        return 0
    breaks = np.flatnonzero(np.diff(pos) != 1)
    edges = np.concatenate(([-1], breaks, [len(pos) - 1]))
    return int(np.diff(edges).max())


class KeyTable:
    """One row per 64-bit key, in flat columns (``array``: 25 bytes a row): the key, its parent's key, whether
    it has one (``has_parent``), the id of its holder mask (``ids``: 0 empty, -1 a tombstone) and of its kid
    vector (``kids``). What the ids mean is :class:`~kvblocks.routing.holder_index.HolderIndex`'s business;
    this class places rows, finds them, grows and rebuilds the table (see the module docstring).

    ``probe_limit``: how far past its home slot an insert may probe before the table is rebuilt under a
    fresh secret (tests lower it to exercise the rebuild).
    """

    def __init__(self, capacity: int = 1024, *, probe_limit: int = PROBE_LIMIT) -> None:
        if isinstance(probe_limit, bool) or not isinstance(probe_limit, int) or probe_limit < 1:
            raise InvalidArgumentError(f"probe_limit must be an int >= 1, got {probe_limit!r}")
        self.probe_limit = probe_limit
        self._seed = secrets.randbits(64)  # folds non-int hashes; fixed for the index's life (keys keep it)
        self._mult = _secret_multiplier()  # places keys; drawn again on every rehash
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

    def read_key(self, h: object, position: int) -> int:
        """:meth:`fold` of a prompt's hash the walk reads, refused as
        :func:`~kvblocks.hashing.validate_block_hashes` refuses it, naming ``position``: a route checks the
        hashes it reads, not the ones past the run it matched."""
        return self.fold(checked_block_hash(h, position))

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
