"""Token ids and block hashes as the hashers take them: packing token ids as u32 and checking hashes.

Token ids are packed into an ``array('I')`` (u32, hashed little-endian); a block hash is a non-empty ``bytes``
digest or an ``int`` >= 0, and the hashes of one sequence form a chain, so none repeats.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import cast

import numpy as np

from kvblocks.errors import ConfigError, InvalidBlockHashError, InvalidTokenError

__all__ = ["TOKEN_LIMIT", "BlockHash", "block_token_bytes", "pack_tokens", "validate_block_hashes"]

BlockHash = bytes | int
"""A block's chained hash: ``bytes`` for xxh3-128 and sha256, ``int`` for xxh3-64-1337
(and for precomputed ids such as trace hash ids)."""
TOKEN_LIMIT = 1 << 32  # tokens are packed as u32

_BIG_ENDIAN = sys.byteorder == "big"
if array("I").itemsize != 4:  # pragma: no cover - every supported platform has 4-byte unsigned int
    raise ImportError("kvblocks needs array('I') to be 4 bytes wide")


def _check_index(value: object, what: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{what} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise ConfigError(f"{what} must be >= {minimum}, got {value}")
    return int(value)


def pack_tokens(token_ids: Iterable[int]) -> array[int]:
    """Copy ``token_ids`` into a fresh ``array('I')``, refusing anything that is not a u32.

    Accepts lists/tuples of ``int`` or numpy integers, numpy integer arrays and
    ``array`` objects; numpy integers pack exactly like Python ints. Raises
    :class:`InvalidTokenError` naming the first bad position.
    """
    if type(token_ids) is list:  # the common shape: fromlist packs a list a third faster than array("I", ...)
        packed = array("I")
        try:
            packed.fromlist(token_ids)
        except (OverflowError, TypeError):
            raise bad_token(token_ids) from None
        return packed
    if isinstance(token_ids, np.ndarray):
        return _pack_ndarray(token_ids)
    if isinstance(token_ids, (str, bytes, bytearray, memoryview)):
        raise InvalidTokenError(f"token ids must be a sequence of integers, got {type(token_ids).__name__}")
    if not isinstance(token_ids, (list, tuple, array, range)):
        try:  # an iterator can be read once: keep what it yields, to report a bad position
            token_ids = list(token_ids)
        except TypeError:
            raise InvalidTokenError(
                f"token ids must be a sequence of integers, got {type(token_ids).__name__}"
            ) from None
    try:
        return array("I", token_ids)
    except (OverflowError, TypeError):
        raise bad_token(token_ids) from None


def _pack_ndarray(arr: np.ndarray) -> array[int]:
    if arr.ndim != 1:
        raise InvalidTokenError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise InvalidTokenError(f"token ids must have an integer dtype, got {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= TOKEN_LIMIT):
        raise bad_token(arr.tolist())
    out = array("I")
    out.frombytes(arr.astype("=u4", copy=False).tobytes())
    return out


def block_token_bytes(tokens: Sequence[int] | None, position: int, size: int) -> bytes | None:
    """Block ``position``'s token ids of a sequence's ``tokens`` (from its first) as ``array('I')`` bytes -- what
    a cache keeps of a block's tokens for its events; None when ``tokens`` is None or falls short of the block.

    >>> block_token_bytes([1, 2, 3, 4, 5], 1, 2) == array("I", [3, 4]).tobytes(), block_token_bytes([1], 0, 2)
    (True, None)
    """
    if tokens is None or len(tokens) < (position + 1) * size:
        return None
    part = tokens[position * size : (position + 1) * size]
    return part.tobytes() if type(part) is array else array("I", part).tobytes()


def bad_token(tokens: Sequence[object]) -> InvalidTokenError:
    for index, tok in enumerate(tokens):
        if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
            return InvalidTokenError(f"token id at position {index} is not an integer: {tok!r}")
        if not 0 <= tok < TOKEN_LIMIT:
            return InvalidTokenError(f"token id at position {index} is out of range [0, 2**32): {tok}")
    return InvalidTokenError("token ids could not be packed as u32")  # pragma: no cover


def validate_block_hashes(hashes: Iterable[BlockHash], *, distinct: bool = True) -> list[BlockHash]:
    """Return ``hashes`` as a new list, refusing anything but distinct ints >= 0 or non-empty bytes.

    The hashes of one sequence are one chain, so none may repeat: a repeat would make
    the chain a cycle in the prefix tree. ``distinct=False`` lets repeats pass, for a reader that builds
    no tree from them (the router scores a prompt; a repeat just ends its chain there).
    """
    out = list(hashes)
    if not _plainly_valid(out):
        _check_each(out)
    if distinct and len(set(out)) != len(out):
        first_seen: dict[BlockHash, int] = {}
        for index, h in enumerate(out):
            if first_seen.setdefault(h, index) != index:
                raise InvalidBlockHashError(f"block hash at position {index} repeats an earlier one: not a chain")
    return out


def _plainly_valid(hashes: list[BlockHash]) -> bool:
    """All plain ints in ``[0, 2**64)`` or all non-empty ``bytes``: checked in C passes (a 2,048-block prompt's
    per-item check costs more than routing it). False: :func:`_check_each` decides (and names the position)."""
    kinds = set(map(type, hashes))
    if kinds == {int}:
        try:  # refuses negatives (and, harmlessly, wide ints: the per-item path takes them)
            array("Q", cast(list[int], hashes))
        except OverflowError:
            return False
        return True
    return kinds == {bytes} and all(hashes)


def _check_each(out: list[BlockHash]) -> None:
    """Refuse the first hash that is not an int >= 0 or non-empty bytes; numpy integers become ints."""
    for index, h in enumerate(out):
        out[index] = checked_block_hash(h, index)


def checked_block_hash(h: object, position: int) -> BlockHash:
    """``h`` as a block hash (a numpy integer becomes its int), or :class:`InvalidBlockHashError` naming
    ``position`` unless it is an int >= 0 or non-empty bytes: the rule of :func:`validate_block_hashes`, one
    hash at a time (a route checks the hashes its walk reads)."""
    if isinstance(h, bytes):
        if not h:
            raise InvalidBlockHashError(f"block hash at position {position} is empty bytes")
        return h
    if isinstance(h, (int, np.integer)) and not isinstance(h, bool):
        if h < 0:
            raise InvalidBlockHashError(f"block hash at position {position} is negative: {h}")
        return int(h)
    raise InvalidBlockHashError(f"block hash at position {position} must be int or bytes, got {type(h).__name__}")
