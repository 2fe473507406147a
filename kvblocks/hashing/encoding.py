"""Block hashes outside the process: their JSON form, and the 64-bit integer form engines' KV events carry."""

from __future__ import annotations

import struct
from collections.abc import Sequence

from kvblocks.errors import InvalidBlockHashError
from kvblocks.hashing.tokens import BlockHash
from kvblocks.strict_json import brief

__all__ = ["digest_u64", "hash_from_json", "hash_to_json", "hashes_from_json", "hashes_to_json", "vllm_int_hash"]

# --------------------------------------------------------------------------- JSON form of block hashes


def hash_to_json(h: object) -> int | str:
    """An int hash as itself, a bytes hash as hex."""
    if type(h) is int and h >= 0:
        return h
    if type(h) is bytes and h:
        return h.hex()
    raise InvalidBlockHashError(f"cannot encode block hash {h!r}: not an int >= 0 or non-empty bytes")


def hashes_to_json(hashes: Sequence[BlockHash]) -> str | list[int | str]:
    """``"W:HEX"`` for bytes hashes of one width W (all of a chain are); else a list of ints / hex strings.

    >>> hashes_to_json([b"\\x01\\x02", b"\\x03\\x04"]), hashes_to_json([7, 8])
    ('2:01020304', [7, 8])
    """
    if hashes and type(hashes[0]) is bytes:
        width = len(hashes[0])
        if width and all(type(h) is bytes and len(h) == width for h in hashes):
            return f"{width}:{b''.join(hashes).hex()}"  # type: ignore[arg-type]
    return [hash_to_json(h) for h in hashes]


_CUT_IN_C = 1 << 16
"""Packed runs of at most this many hashes are cut by :mod:`struct` (whose compiled format holds a code per hash)."""

_MAX_WIDTH_DIGITS = 6
"""A packed width has at most this many digits: ``int()`` of thousands of digits raises a bare ValueError."""


def _strict_fromhex(text: str) -> bytes | None:
    """The bytes ``text`` spells in hex, or None: unlike ``bytes.fromhex``, whitespace is refused too."""
    try:
        data = bytes.fromhex(text)
    except ValueError:
        return None
    return data if 2 * len(data) == len(text) else None


def hash_from_json(raw: object) -> BlockHash:
    """The inverse of :func:`hash_to_json`; anything else raises :class:`InvalidBlockHashError`."""
    if type(raw) is int and raw >= 0:
        return raw
    if type(raw) is str and raw:
        h = _strict_fromhex(raw)
        if h is not None:
            return h
    raise InvalidBlockHashError(f"malformed block hash {brief(raw)}")


def hashes_from_json(raw: object) -> tuple[BlockHash, ...]:
    """The inverse of :func:`hashes_to_json`; anything else (of any type, size or depth: the input
    may come from outside the process) raises :class:`InvalidBlockHashError`."""
    if type(raw) is list:
        return tuple(hash_from_json(h) for h in raw)
    if type(raw) is str:
        width, _, hexed = raw.partition(":")
        digits = width.isascii() and width.isdigit() and len(width) <= _MAX_WIDTH_DIGITS
        w = int(width) if digits else 0
        packed = _strict_fromhex(hexed) if w > 0 and hexed.isascii() and len(hexed) % (2 * w) == 0 else None
        if packed is not None:
            count = len(packed) // w
            if count <= _CUT_IN_C:  # a fifth of the time of slicing in a loop; not cached: the format is outside's
                return struct.Struct(f"{w}s" * count).unpack(packed)
            return tuple(packed[k : k + w] for k in range(0, len(packed), w))
    raise InvalidBlockHashError(f"malformed block hashes {brief(raw)}")


# --------------------------------------------------------------------------- vLLM's 64-bit event form


_U64 = (1 << 64) - 1


def vllm_int_hash(h: BlockHash) -> int:
    """The 64-bit integer form of a block hash that vLLM's KV events carry (its default,
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the digest's last 8 bytes, big-endian. An int stays
    itself (masked to 64 bits), so applying it twice changes nothing.

    >>> vllm_int_hash(bytes(range(16)))
    579005069656919567
    >>> vllm_int_hash(vllm_int_hash(bytes(range(16))))
    579005069656919567
    """
    return digest_u64(h, first=False)


def digest_u64(h: BlockHash, *, first: bool) -> int:
    """8 bytes of a digest as an unsigned big-endian int: its ``first`` 8, else its last 8 -- the 64-bit form
    engines put in their events (vLLM: the last, SGLang: the first). An int stays itself, masked to 64 bits."""
    if type(h) is bytes and h:
        return int.from_bytes(h[:8] if first else h[-8:], "big")
    if type(h) is int and h >= 0:
        return h & _U64
    raise InvalidBlockHashError(f"cannot convert block hash {brief(h)}: not an int >= 0 or non-empty bytes")
