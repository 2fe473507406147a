"""Chained hashing of a sequence's full blocks: :class:`BlockHasher`, the incremental :class:`HashedTokens`,
:class:`PrecomputedHashes` for callers that have hashes but no tokens, and :func:`block_hashes`.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from functools import lru_cache

import numpy as np

from kvblocks.errors import InvalidArgumentError, InvalidBlockHashError, SequenceStateError
from kvblocks.hashing.extras import BlockExtras, _Framer
from kvblocks.hashing.schemes import DEFAULT_SCHEME, Namespace, get_scheme
from kvblocks.hashing.tokens import (
    _BIG_ENDIAN,
    BlockHash,
    _check_index,
    bad_token,
    pack_tokens,
    validate_block_hashes,
)

__all__ = ["BlockHasher", "HashedTokens", "PrecomputedHashes", "block_hashes"]

_SMALL_RUN = 8  # below this many blocks, slicing beats numpy's per-call overhead


class BlockHasher:
    """Chained block hashing bound to one scheme, namespace and block size.

    >>> hasher = BlockHasher(4, scheme="xxh3-64-1337")
    >>> len(hasher.hash_tokens(range(10)))  # 2 full blocks; the last 2 tokens are a partial block
    2
    """

    __slots__ = ("_block_dtype", "block_size", "lookahead", "namespace", "root", "scheme")

    def __init__(self, block_size: int, scheme: str = DEFAULT_SCHEME, namespace: str | Namespace = "default"):
        self.block_size = _check_index(block_size, "block_size", minimum=1)
        self.scheme = get_scheme(scheme)
        self.namespace = Namespace.of(namespace)
        self.root = self.scheme.root(self.namespace, self.block_size)
        self._block_dtype = np.dtype(f"V{4 * self.block_size}")
        self.lookahead = self.scheme.lookahead
        """Tokens past a block its hash covers (the scheme's): block ``i`` is hashed once token
        ``(i + 1) * block_size + lookahead - 1`` exists."""

    def hashable_blocks(self, num_tokens: int) -> int:
        """How many blocks of ``num_tokens`` tokens have a hash.

        >>> BlockHasher(4).hashable_blocks(8), BlockHasher(4, scheme="dynamo-xxh3-64-eagle").hashable_blocks(8)
        (2, 1)
        """
        return max(0, num_tokens - self.lookahead) // self.block_size

    def hash_packed(
        self,
        tokens: array[int],
        start_block: int,
        stop_block: int,
        parent: BlockHash | None,
        framer: _Framer | None = None,
    ) -> list[BlockHash]:
        """Hashes of blocks ``start_block..stop_block-1`` of ``tokens``, chained onto ``parent``."""
        count = stop_block - start_block
        if count <= 0:
            return []
        width = self.block_size
        reach = self.lookahead
        if _BIG_ENDIAN:  # pragma: no cover - exercised only on big-endian hosts
            tokens = array("I", tokens[start_block * width : stop_block * width + reach])
            tokens.byteswap()
            start_block, stop_block = 0, count
        if reach:  # each block with the tokens past it that its hash covers
            blocks = [tokens[i * width : (i + 1) * width + reach].tobytes() for i in range(start_block, stop_block)]
        elif count < _SMALL_RUN:
            blocks = [tokens[i * width : (i + 1) * width].tobytes() for i in range(start_block, stop_block)]
        else:
            blocks = np.frombuffer(
                tokens, dtype=self._block_dtype, count=count, offset=start_block * 4 * width
            ).tolist()
        return self.scheme.chain(blocks, parent, framer, start_block)

    def hash_tokens(self, token_ids: Iterable[int], extras: BlockExtras | None = None) -> list[BlockHash]:
        """Chained hashes of every full block of ``token_ids``."""
        tokens = pack_tokens(token_ids)
        framer = self.scheme.make_framer(extras, self.block_size) if extras is not None else None
        return self.hash_packed(tokens, 0, self.hashable_blocks(len(tokens)), self.root, framer)


class HashedTokens:
    """A sequence's private copy of its token ids and the hashes of its full blocks.

    Extending is incremental: only blocks completed by the new tokens are hashed,
    and hashing a prompt in one call or piecewise gives identical hashes. The
    caller's token list is copied, so later changes to it have no effect here.
    """

    __slots__ = ("_framer", "_hasher", "_phase", "_size", "_tokens", "hashes", "num_tokens")

    def __init__(self, hasher: BlockHasher, token_ids: Iterable[int] = (), extras: BlockExtras | None = None):
        self._hasher = hasher
        self._size = hasher.block_size  # the hasher's, kept here for append_token's test
        self._phase = hasher.lookahead
        self._framer = hasher.scheme.make_framer(extras, hasher.block_size) if extras is not None else None
        self._tokens = pack_tokens(token_ids)  # a fresh array: the caller's list is never referenced
        self.hashes: list[BlockHash] = []
        """Chained hashes of the full blocks so far (read-only for callers)."""
        self.num_tokens = 0
        self._hash_new_blocks()

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    def extend(self, token_ids: Iterable[int]) -> int:
        """Append tokens; return how many new full blocks were hashed. Bad tokens change nothing."""
        if type(token_ids) is tuple or type(token_ids) is list:  # a decode step's sampled tokens: packed in place
            tokens = self._tokens
            before = len(tokens)
            try:
                tokens.extend(token_ids)
            except (OverflowError, TypeError):
                del tokens[before:]  # array.extend keeps what it packed before the bad token
                raise bad_token(token_ids) from None
            return self._hash_new_blocks()
        return self.extend_packed(pack_tokens(token_ids))

    def extend_packed(self, packed: array[int] | Sequence[int]) -> int:
        """:meth:`extend` without the checks: ``packed`` is an ``array("I")``, or ints the caller checked fit one."""
        self._tokens.extend(packed)
        return self._hash_new_blocks()

    def append_token(self, token: int) -> int:
        """:meth:`extend_packed` of one token the caller checked fits ``array("I")`` (a decode step's)."""
        tokens = self._tokens
        tokens.append(token)
        n = self.num_tokens = len(tokens)
        if (n - self._phase) % self._size:
            return 0  # no block newly hashable: nothing to hash
        return self._hash_new_blocks()

    def truncate(self, num_tokens: int) -> None:
        """Forget the tokens from ``num_tokens`` on (an append the caller took back), and their blocks' hashes.

        Both are replaced by shorter copies, never cut in place: apart from that, they only grow, so an
        event recorded earlier may still read its part of them (``PrefixTree.insert(..., stable=True)``)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise InvalidArgumentError(f"cannot truncate {self.num_tokens} tokens to {num_tokens}")
        self._tokens = self._tokens[:num_tokens]
        self.hashes = self.hashes[: self._hasher.hashable_blocks(num_tokens)]
        self.num_tokens = num_tokens

    def _hash_new_blocks(self) -> int:
        tokens = self._tokens
        self.num_tokens = len(tokens)
        hashes = self.hashes
        done = len(hashes)
        n, phase = self.num_tokens, self._phase
        full = (n - phase) // self._size if n > phase else 0  # hashable_blocks, inline: once per extend
        if full == done:
            return 0
        parent = hashes[-1] if done else self._hasher.root
        if full == done + 1 and self._framer is None and not _BIG_ENDIAN:
            one = self._hasher.scheme.one_block
            if one is not None:  # a decode's block: one call, no list of one block
                start = done * self._size
                hashes.append(one(parent, tokens[start : start + self._size + phase].tobytes()))
                return 1
        hashes.extend(self._hasher.hash_packed(tokens, done, full, parent, self._framer))
        return full - done


class PrecomputedHashes:
    """The stand-in for :class:`HashedTokens` when the caller has hashes but no tokens.

    Routers and trace replays know block hashes (and the prompt length), not token ids.
    ``hashes`` must hold exactly one hash per full block: ``num_tokens // block_size``.
    """

    __slots__ = ("hashes", "num_tokens")

    def __init__(self, hashes: Iterable[BlockHash], num_tokens: int, block_size: int):
        self.hashes = validate_block_hashes(hashes)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
            raise InvalidBlockHashError(f"num_tokens must be an integer >= 0, got {num_tokens!r}")
        self.num_tokens = int(num_tokens)
        if len(self.hashes) != self.num_tokens // block_size:
            raise InvalidBlockHashError(
                f"{len(self.hashes)} block hashes given for {self.num_tokens} tokens; block size "
                f"{block_size} needs exactly {self.num_tokens // block_size} (one per full block)"
            )

    @property
    def token_ids(self) -> None:
        return None

    def extend(self, token_ids: Iterable[int]) -> int:
        raise SequenceStateError("sequence was registered by block hashes; token ids cannot be appended")

    def extend_packed(self, packed: array[int] | Sequence[int]) -> int:
        return self.extend(packed)


def block_hashes(
    token_ids: Iterable[int],
    block_size: int,
    *,
    scheme: str = DEFAULT_SCHEME,
    namespace: str | Namespace = "default",
    extras: BlockExtras | None = None,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids``, in order.

    >>> len(block_hashes(list(range(40)), 16))  # 2 full blocks, 8 tokens left over
    2
    >>> block_hashes([1, 2, 3], 16)  # no full block, no hash
    []
    """
    if type(block_size) is not int:  # before the cache, where 2.0 and True would pass for 2 and 1
        block_size = _check_index(block_size, "block_size", minimum=1)
    try:
        hasher = _hasher(block_size, scheme, namespace)
    except TypeError:  # an unhashable argument reached the cache
        hasher = BlockHasher(block_size, scheme, namespace)
    return hasher.hash_tokens(token_ids, extras)


@lru_cache(maxsize=64)
def _hasher(block_size: int, scheme: str, namespace: str | Namespace) -> BlockHasher:
    return BlockHasher(block_size, scheme, namespace)
