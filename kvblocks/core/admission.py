"""The one admission: the hit a sequence takes over every group and tier, and its two phases.

Every admission -- a plain one, one through host and storage tiers, a hybrid model's, a decode node's
handoff -- is the same three steps::

    hit       the longest prefix every group serves: group 0's leading run of the tree (then its host
              run, then what storage is known to hold), cut to what every other group serves there
    prepare   every group says what it lacks (full attention: new blocks, minus idle blocks the hit keeps;
              a local group: its window's blocks on device, in its tiers, or a handoff's copies; ...)
    take      only when no group lacks anything does every group take: keep, copy in, take new blocks

So one group's eviction can never take another group's hit, and a refusal changes nothing. The manager
(:class:`~kvblocks.core.manager.KVCacheManager`) validates, counts, and decides what to do with copies
still in flight (its tiers track them until they land).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from kvblocks.accounting import CachedTokens
from kvblocks.config import CacheConfig
from kvblocks.core.coordinator import GroupCoordinator
from kvblocks.core.groups.protocol import Ask, GroupCopies
from kvblocks.core.sequence import BlockTable, _count_arg, _Sequence
from kvblocks.errors import IntegrityError, InvalidArgumentError, StaleLookupError
from kvblocks.hashing import BlockHash
from kvblocks.tiers.tiering import Tiering
from kvblocks.tiers.transfers import AdmittedTable

__all__ = ["Admission", "Hit"]

Hit = tuple[int, list[int], list[int], int]
"""An admission's hit: (chain blocks, group 0's device blocks, its host blocks after them, its storage loads)."""
_Beside = tuple[Ask, list[tuple[int, Any] | None]]
"""The other groups' part of an admission: what they were asked, and their answers."""
_NO_BLOCKS: list[int] = []  # the host blocks of an untiered hit (never changed)


class Admission:
    """The admissions of one manager: over its ``groups`` (group 0 and those beside it) and ``tiers``."""

    __slots__ = (
        "_beside",
        "_block_size",
        "_caching",
        "_crosses",
        "_drop_last",
        "_full",
        "_groups",
        "_pool",
        "_reserve",
        "_tiers",
        "_tree",
    )

    def __init__(self, config: CacheConfig, groups: GroupCoordinator, tiers: Tiering | None) -> None:
        self._block_size = config.block_size
        self._caching = config.enable_prefix_caching
        self._reserve = config.reserved_blocks
        self._drop_last = config.drop_last_matched_block
        self._groups = groups
        self._beside = groups if groups.groups else None  # None: no group beside full attention
        self._full = groups.full
        self._pool = groups.full.pool
        self._tree = groups.full.tree
        self._crosses = bool(groups.crosses)
        self._tiers = tiers

    def expected(self, num_cached_tokens: object) -> int | None:
        """The hit the caller saw, in blocks (None: take the hit there is now)."""
        if num_cached_tokens is None:
            return None
        tokens = _count_arg(num_cached_tokens, "num_cached_tokens")
        if tokens % self._block_size:
            raise InvalidArgumentError(
                f"num_cached_tokens must be a multiple of the block size {self._block_size}, got {tokens}"
            )
        step = self._groups.hit_step
        if tokens % step:
            raise InvalidArgumentError(
                f"num_cached_tokens must be a multiple of {step} (every group's block boundary and checkpoint "
                f"spacing), got {tokens}"
            )
        return tokens // self._block_size

    def cached(self, s: _Sequence) -> CachedTokens:
        """The hit ``s`` would take now: group 0's device / host / storage split of the hit every group serves."""
        size = self._block_size
        prompt = s.content.num_tokens
        tiers = self._tiers
        if tiers is None:
            return CachedTokens.counted(self.match_length(s) * size, prompt)
        hit, _, host, loads = self._tier_hit(tiers, s, None, None, blocks=False)
        device = hit - len(host) - loads
        return CachedTokens(device * size, len(host) * size, loads * size, num_prompt_tokens=prompt)

    def hit(self, seq_id: Hashable, s: _Sequence, expected: int | None) -> Hit:
        """The hit an admission of ``s`` takes now (``expected``: exactly that many blocks, the caller's lookup):
        (blocks, group 0's device blocks, its host blocks after them, its storage loads after those). Pure."""
        if self._tiers is not None:
            return self._tier_hit(self._tiers, s, seq_id, expected)
        matched = self.match(s)
        if expected is not None:
            self._check_expected(seq_id, expected, len(matched))
            del matched[expected:]
        return len(matched), matched, _NO_BLOCKS, 0

    def _tier_hit(
        self, tiers: Tiering, s: _Sequence, seq_id: Hashable, expected: int | None, blocks: bool = True
    ) -> Hit:
        """:meth:`hit` through tiers: the hit every group serves from device or its tiers. Pure; no I/O."""
        if not self._caching or s.skip_read:
            return 0, [], _NO_BLOCKS, 0
        content = s.content
        hashes = content.hashes
        limit = self.cacheable_blocks(content.num_tokens)
        if blocks:
            matched = self._tree.matched_blocks(hashes, limit)
            device = len(matched)
        else:  # a lookup counts them only (their blocks stand for themselves)
            device = self._tree.match_length(hashes, limit)
            matched = _NO_BLOCKS
        stack = tiers.stacks[0]
        host = stack.host_run(hashes, device, limit)
        hit = device + len(host)
        hit += stack.stored_run(hashes, hit, limit)
        if self._beside is not None:
            hit = self._hit_within(hashes, hit, True)
        elif hit and self._drop_last:
            hit -= 1
        if expected is not None:
            self._check_expected(seq_id, expected, hit)
            hit = expected
        if device > hit:
            if blocks:
                del matched[hit:]
            device = hit
        host = host[: hit - device]
        return hit, matched, host, hit - device - len(host)

    def prepare(
        self,
        s: _Sequence,
        hit: Hit,
        n: int,
        k: int,
        admitting: bool = False,
        *,
        reserve: int = 0,
        window_token: int | None = None,
        remotes: Sequence[Sequence[int]] = (),
    ) -> tuple[int, _Beside | None]:
        """The first phase of an admission taking ``hit``: (blocks the neediest group lacks, every other
        group's answer). Pure. ``admitting``: skip the other groups when full attention lacks room;
        ``reserve``: blocks every group leaves free besides; ``window_token``, ``remotes``: a handoff's."""
        hits, matched, _, _ = hit
        size = self._block_size
        total = (hits * size + n + k + size - 1) // size
        pool = self._pool
        short = total - len(matched) + reserve - (pool.num_free - pool.count_idle(matched) - self._reserve)
        groups = self._beside
        if groups is None or (admitting and short > 0):
            return short, None
        tokens = hits * size
        encoder = groups.encoder_tokens.get(id(s), 0) if self._crosses else 0
        window = tokens if window_token is None else window_token
        ask = Ask(s.content.hashes, hits, total, tokens, window, encoder, reserve, s.content.num_tokens, tokens + n)
        answers = groups.answers(ask, remotes)
        for answer in answers:
            if answer is not None and answer[0] > short:
                short = answer[0]
        return short, (ask, answers)

    def take(self, s: _Sequence, hit: Hit, n: int, k: int, beside: _Beside | None) -> Sequence[GroupCopies | None]:
        """The second phase: every group takes what :meth:`prepare` found room for (the caller checked); the
        table covers the hit, ``n`` new tokens and ``k`` drafts. Returns the other groups' copies."""
        hits, matched, host, _ = hit
        size = self._block_size
        copies = self._groups.take(id(s), *beside) if beside is not None else ()
        device = len(matched)
        covered = hits * size + n
        need = (covered + k + size - 1) // size - device
        if device:
            self._pool._acquire_valid(matched)  # nodes the tree just matched: valid by construction
        if host:
            self._tiering().stacks[0].acquire_host(host)  # before an eviction can write back into the host tier
        if need:
            matched += self._full.take(need)
        s.table = matched
        s.view = BlockTable(matched, hits * size)
        s.num_covered = covered
        s.lookahead = k
        s.num_committed = device * size
        if beside is not None:
            s.watch = self._groups.next_move(hits * size)
        return copies

    def pend(self, seq_id: Hashable, s: _Sequence, hit: Hit, copies: Sequence[GroupCopies | None]) -> AdmittedTable:
        """Hand an admission's copies to the tiers: pending until every one is reported."""
        hits, _, host, loads = hit
        table = s.blocks()
        device = s.num_committed // self._block_size
        start = device + len(host)
        swaps = [(h, table[p], p) for p, h in enumerate(host, device)]
        group0 = GroupCopies(swaps, [(table[p], p) for p in range(start, start + loads)]) if host or loads else None
        self._tiering().pend(seq_id, s, hits, device, [group0, *copies])
        hashes = s.content.hashes
        view = AdmittedTable(
            table,
            tuple((h, d) for h, d, _ in swaps),
            tuple((table[p], hashes[p]) for p in range(start, start + loads)),
            hits * self._block_size,
        )
        s.view = view
        return view

    def _check_expected(self, seq_id: Hashable, expected: int, available: int) -> None:
        if expected > available:
            raise StaleLookupError(
                f"sequence {seq_id!r}: the lookup saw {expected * self._block_size} cached tokens, the cache holds "
                f"{available * self._block_size} now; look up again"
            )

    def cacheable_blocks(self, num_tokens: int) -> int:
        """Full blocks a prefix hit may cover: never the one holding the last token, whose logits are needed."""
        return (num_tokens - 1) // self._block_size

    def match_length(self, s: _Sequence) -> int:
        """How many leading blocks of ``s`` every group serves now (the device hit). Pure."""
        if not self._caching or s.skip_read:
            return 0
        content = s.content
        found = self._tree.match_length(content.hashes, self.cacheable_blocks(content.num_tokens))
        if self._beside is not None:
            return self._hit_within(content.hashes, found)
        return found - 1 if found and self._drop_last else found

    def match(self, s: _Sequence) -> list[int]:
        """Group 0's blocks of the device hit of ``s`` (:meth:`match_length` of them). Pure."""
        if not self._caching or s.skip_read:
            return []
        content = s.content
        matched = self._tree.matched_blocks(content.hashes, self.cacheable_blocks(content.num_tokens))
        if self._beside is not None:
            del matched[self._hit_within(content.hashes, len(matched)) :]  # one walk of the tree, not two
        elif matched and self._drop_last:
            matched.pop()
        return matched

    def _hit_within(self, hashes: Sequence[BlockHash], run: int, tiers: bool = False) -> int:
        """The hit (blocks) every group serves within full attention's leading ``run`` of cached blocks (from
        device, or ``tiers``: also from each group's tiers). Pure.

        With ``drop_last_matched_block`` the hit is the largest one every group serves below the
        common hit (the last block's tokens are computed again, as EAGLE needs their hidden states).
        """
        if not run:
            return 0
        size = self._block_size
        groups = self._groups
        hit = groups.common_hit(hashes, run * size, tiers)
        if hit and self._drop_last:
            hit = groups.common_hit(hashes, hit - size, tiers)
        return hit // size

    def _tiering(self) -> Tiering:
        """The tiers (the caller knows there are some: the hit has blocks beyond the device)."""
        if self._tiers is None:
            raise IntegrityError("an admission with copies beyond the device on a manager without tiers")
        return self._tiers
