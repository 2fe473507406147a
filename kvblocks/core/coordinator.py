"""A manager's layer groups, coordinated: the group queries, the common hit, two-phase admission, growth,
commit and release over every group, each asked through one interface.

Every manager owns one :class:`GroupCoordinator`. Groups are numbered 0 (full attention:
:class:`~kvblocks.core.groups.full_group.FullAttentionGroup`, whose blocks are the hash chain's),
then the local groups in the order given, then the recurrent groups, then the cross-attention groups.
A model of full attention only has group 0 alone: the loops over the groups beside it are empty.

* The hit is the longest prefix every group serves (:func:`~kvblocks.core.groups.hits.longest_common_hit`):
  full attention its leading run, a local group the blocks its window needs at the hit, a recurrent
  group a checkpoint exactly there.
* An admission is two-phase: every group says what it lacks (:meth:`GroupManager.admission`), then --
  only when none lacks anything -- every group takes. A refusal changes no group.
* A commit caches the newly full blocks in every group, then each local group releases the blocks no
  later token can attend to; growth takes one block per new position in every local group, or nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvblocks.core.groups.cross_group import CrossAttentionGroup, _Cross
from kvblocks.core.groups.full_group import FullAttentionGroup
from kvblocks.core.groups.hits import longest_common_hit, longest_group_hit, needed_blocks
from kvblocks.core.groups.local_group import LocalGroup, LocalGroupManager
from kvblocks.core.groups.protocol import Ask, GroupCopies, GroupManager
from kvblocks.core.groups.recurrent_group import RecurrentGroup, StateCopy, _Recurrent
from kvblocks.core.groups.rules import NEVER
from kvblocks.core.pool import BlockPool
from kvblocks.core.sequence import _Sequence
from kvblocks.errors import ConfigError, IntegrityError, InvalidArgumentError, SequenceStateError
from kvblocks.events import BlockStored, EventSink
from kvblocks.hashing import BlockHash

__all__ = ["GroupCoordinator", "split_groups"]


class _Deferring(Protocol):
    def deferred(self, number: int) -> list[list[int]]: ...


def split_groups(
    groups: Sequence[object],
) -> tuple[list[LocalGroup], list[RecurrentGroup], list[CrossAttentionGroup]]:
    """The local, recurrent and cross-attention groups of ``groups``, which must come in that order (it is
    their group numbering: 1, 2, ... after full attention)."""
    locals_: list[LocalGroup] = []
    recurrents: list[RecurrentGroup] = []
    crosses: list[CrossAttentionGroup] = []
    for number, group in enumerate(groups, 1):
        if isinstance(group, LocalGroup):
            later: list[object] = [*recurrents, *crosses]  # a group of an earlier kind after them: out of order
            locals_.append(group)
        elif isinstance(group, RecurrentGroup):
            later = list(crosses)
            recurrents.append(group)
        elif isinstance(group, CrossAttentionGroup):
            later = []
            crosses.append(group)
        else:
            raise ConfigError(
                f"group {number} is a {type(group).__name__}; a layer group is a LocalGroup, RecurrentGroup or "
                "CrossAttentionGroup"
            )
        if later:
            raise ConfigError(
                "groups come in group order: local groups, then recurrent groups, then cross-attention groups"
            )
    return locals_, recurrents, crosses


class GroupCoordinator:
    """Every layer group of a manager -- group 0, full attention (``full``), then the ``groups`` beside it -- and
    the rules that span them; sequences are keyed by ``id(sequence)``.

    A model of full attention only has one group: the coordinator answers the group queries, and the
    manager's paths skip the loops over the groups beside it (``groups`` is empty).
    """

    def __init__(
        self, full: FullAttentionGroup, groups: Sequence[object], *, chain_block_size: int, events: EventSink | None
    ) -> None:
        locals_, recurrents, crosses = split_groups(groups)
        size = chain_block_size
        self.block_size = size  # the hash chain's, group 0's
        self.full = full
        self.locals = [LocalGroupManager(g, size, number, events) for number, g in enumerate(locals_, 1)]
        first = 1 + len(locals_)
        self.recurrents = [_Recurrent(g, first + i, size, events) for i, g in enumerate(recurrents)]
        first += len(recurrents)
        self.crosses = [_Cross(g, first + i, size) for i, g in enumerate(crosses)]
        self.groups: list[GroupManager] = [*self.locals, *self.recurrents, *self.crosses]  # group order, after 0
        self.encoder_tokens: dict[int, int] = {}  # id(sequence) -> encoder tokens, for sequences with any
        self.kinds: tuple[str, ...] = (
            "full",
            *(g.kind for g in locals_),
            *("recurrent" for _ in recurrents),
            *("cross_attention" for _ in crosses),
        )
        self.checkpoint_step = math.lcm(*(r.step for r in self.recurrents)) if self.recurrents else 0
        self.hit_step = math.lcm(size, *(g.block_size for g in self.locals), *(r.step for r in self.recurrents))

    # ------------------------------------------------------------------ group queries

    def number(self, group: object) -> int:
        """``group`` checked: an int in ``[0, number of groups)``."""
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < len(self.kinds):
            raise ConfigError(f"group must be an int in [0, {len(self.kinds)}), got {group!r}")
        return group

    def recurrent(self, group: object) -> _Recurrent:
        number = self.number(group)
        if self.kinds[number] != "recurrent":
            raise InvalidArgumentError(f"group {number} is {self.kinds[number]!r}, not recurrent")
        return self.recurrents[number - 1 - len(self.locals)]

    def table(self, group: object, s: _Sequence) -> list[int]:
        """Group ``group``'s table of ``s`` (a copy; empty when not admitted); a recurrent group has none."""
        number = self.number(group)
        if number == 0:
            return list(s.table or ())
        if number <= len(self.locals):
            return list(self.locals[number - 1].tables.get(id(s), ()))
        if self.kinds[number] == "cross_attention":
            return list(self.crosses[number - 1 - len(self.locals) - len(self.recurrents)].tables.get(id(s), ()))
        raise InvalidArgumentError(f"group {number} is recurrent: it has a state slot, not a block table")

    def tables(self, s: _Sequence) -> tuple[list[int], ...]:
        """Every group's entry: a table, or a recurrent group's state slot as a one-entry list."""
        out = []
        for number, kind in enumerate(self.kinds):
            if kind == "recurrent":
                slot = self.recurrent(number).slots.get(id(s))
                out.append([] if slot is None else [slot])
            else:
                out.append(self.table(number, s))
        return tuple(out)

    def device_block_of(self, group: int, key: BlockHash) -> int | None:
        """The block attention group ``group`` caches ``key`` in on device (None: none). Pure."""
        return self.full.tree.block_of(key) if group == 0 else self.locals[group - 1].index.block_of(key)

    def pool(self, group: object) -> BlockPool:
        """Group ``group``'s pool (a recurrent group's holds its checkpoints)."""
        number = self.number(group)
        return self.full.pool if number == 0 else self.groups[number - 1].pool

    # ------------------------------------------------------------------ the hit every group serves

    def common_hit(self, hashes: Sequence[BlockHash], limit: int, tiers: bool = False) -> int:
        """The largest hit (tokens) at or below ``limit`` that every group beside full attention serves: from
        device (or, ``tiers``, also from each local group's host and storage tiers)."""
        locals_ = self.locals
        step = self.hit_step
        if len(locals_) == 1 and not self.recurrents:  # one local group: its answer below the run is the fixed point
            local = locals_[0]
            if local.ratio == 1 and not limit % step:  # the common case first, checked in C:
                window = needed_blocks(local.rule, limit)  # the group holds the whole window below the limit
                if all(map(local.index._block_of.__contains__, hashes[window.start : window.stop])):
                    return limit
            served = local.held(hashes) if tiers else local.served(hashes)
            return longest_group_hit(local.rule, limit, step, served)
        rules = [local.rule for local in locals_]
        answers = [local.held(hashes) if tiers else local.served(hashes) for local in locals_]
        for recurrent in self.recurrents:
            rules.append(recurrent.rule)
            answers.append(_checkpointed(recurrent, hashes))
        return longest_common_hit(rules, limit, answers, step)

    # ------------------------------------------------------------------ admission and growth

    def answers(self, ask: Ask, remotes: Sequence[Sequence[int]] = ()) -> list[tuple[int, Any] | None]:
        """Every group's answer to an admission (``remotes``: a handoff's tables, one per group). Pure."""
        if remotes:
            return [group.admission(ask, remote) for group, remote in zip(self.groups, remotes, strict=True)]
        return [group.admission(ask, None) for group in self.groups]

    def take(self, key: int, ask: Ask, answers: list[tuple[int, Any] | None]) -> list[GroupCopies | None]:
        """The second phase: every group takes what its answer found room for; each group's copies."""
        copies = []
        for group, answer in zip(self.groups, answers, strict=True):
            if answer is None:  # pragma: no cover - the caller checked every answer
                raise IntegrityError(f"group {group.number} does not serve the hit it is asked to take")
            copies.append(group.take_admission(key, ask, answer[1]))
        return copies

    def grow(self, s: _Sequence, covered: int, lookahead: int, checked: bool = False) -> bool:
        """Give admitted ``s`` slots for ``covered`` tokens plus ``lookahead`` drafts, or change nothing (False);
        ``checked``: the caller found the room (:meth:`room_to_grow`), which nothing has taken since.

        Blocks beyond what that needs (a smaller lookahead than before) go back to the pool: they
        lie past every committed and every allocated token, so nothing in them is cached.
        """
        table = s.table
        if table is None:  # pragma: no cover - callers grow admitted sequences only
            raise SequenceStateError("only an admitted sequence grows")
        size = self.block_size
        need = (covered + lookahead + size - 1) // size - len(table)
        if need > 0:
            pool = self.full.pool
            if not checked and (
                need > len(pool._fresh) + len(pool._idle)
                or (self.locals and self.growth_short(id(s), len(table) + need) > 0)
            ):
                return False  # room_to_grow, inlined: this runs once per block a decoding sequence fills
            table += pool.take_fresh(need) if need <= len(pool._fresh) else self.full.take(need)
        elif need < 0:
            surplus = table[need:]
            del table[need:]
            self.full.pool._release_valid(reversed(surplus))
        s.num_covered = covered
        s.lookahead = lookahead
        if need and self.locals:
            for local in self.locals:
                local.resize(id(s), len(table))
        return True

    def room_to_grow(self, s: _Sequence, need: int) -> bool:
        """Whether admitted ``s`` may take ``need`` more blocks now, in every layer group. Pure."""
        pool = self.full.pool  # its num_free, inlined (package-private): once per block a sequence fills
        if need > len(pool._fresh) + len(pool._idle):
            return False
        if not self.locals:
            return True
        table = s.table
        return table is not None and self.growth_short(id(s), len(table) + need) <= 0

    def growth_short(self, key: int, total: int) -> int:
        """The most blocks a local group lacks to grow a sequence's tables to ``total`` chain blocks. Pure."""
        locals_ = self.locals
        if len(locals_) == 1:  # the common hybrid model: one window group (no generator per block filled)
            return locals_[0].growth_short(key, total)
        return max((local.growth_short(key, total) for local in locals_), default=0)

    # ------------------------------------------------------------------ commit and release

    def committed(self, key: int, hashes: Sequence[BlockHash], before: int, n: int, cache: bool) -> int:
        """Every group's part of a commit from ``before`` to ``n`` tokens; returns the token count at which a
        window may next move (a commit reaching it must reach :meth:`committed` again)."""
        move = NEVER
        for local in self.locals:  # each says when its window moves next (its next_move(n))
            local_move = local.committed(key, hashes, before, n, cache)
            if local_move < move:
                move = local_move
        for recurrent in self.recurrents:
            recurrent.committed(key, hashes, before, n, cache)
        return move

    def next_move(self, n: int) -> int:
        locals_ = self.locals
        if len(locals_) == 1:
            return locals_[0].next_move(n)
        return min((local.next_move(n) for local in locals_), default=NEVER)

    def release(self, s: _Sequence, deferred: Sequence[list[list[int]] | None] = ()) -> None:
        """Admitted ``s`` leaves every group; ``deferred[g]`` (when given and not None) collects group ``g``'s
        release order instead, for a copy in flight into its blocks (its tiers release it later)."""
        key = id(s)
        if not deferred:
            self.full.release(s)
            for group in self.groups:
                group.release(key)
            return
        self.full.release(s, deferred[0])
        for local, defer in zip(self.locals, deferred[1:], strict=False):
            local.release(key, defer)
        for group in self.groups[len(self.locals) :]:
            group.release(key)

    @property
    def busy(self) -> bool:
        """Whether a state plan has saves or restores not known to have run."""
        return any(r.busy for r in self.recurrents)

    def clear(self) -> None:
        """Drop every cached block and checkpoint (the caller checked nothing is in use)."""
        self.full.tree.clear()
        for local in self.locals:
            local.index.clear()
        for recurrent in self.recurrents:
            recurrent.index.clear()

    def snapshot_events(self) -> list[BlockStored]:
        """Every group's cached blocks as ``BlockStored`` events, group 0's chains first. Pure."""
        events = self.full.tree.snapshot_events()
        for local in self.locals:
            events += local.index.snapshot_events()
        for recurrent in self.recurrents:
            events += recurrent.index.snapshot_events()
        return events

    # ------------------------------------------------------------------ recurrent state plans

    def take_state_plan(self) -> list[StateCopy]:
        plan: list[StateCopy] = []
        for recurrent in self.recurrents:
            plan += recurrent.take_plan()
        return plan

    def state_plan_done(self) -> None:
        for recurrent in self.recurrents:
            recurrent.plan_ran()

    # ------------------------------------------------------------------ checks

    def check_integrity(
        self,
        live: dict[int, tuple[object, int, int]],
        registered: set[int],
        tiers: _Deferring | None,
    ) -> None:
        """The checks of every group beside full attention. ``live``: id(sequence) -> (sequence id, full-attention
        table length, the token its windows are placed at) of every admitted sequence; ``registered``: id of every
        sequence; ``tiers``: what holds blocks for a copy in flight (their releases are deferred)."""
        for local in self.locals:
            local.check_integrity(live, tiers.deferred(local.number) if tiers is not None else ())
        for recurrent in self.recurrents:
            recurrent.check_integrity(set(live))
        encoder = {key: self.encoder_tokens.get(key, 0) for key in live}
        for cross in self.crosses:
            cross.check_integrity(encoder)
        if not set(self.encoder_tokens) <= registered:
            raise IntegrityError("encoder token counts are kept for a sequence that left")


def _checkpointed(recurrent: _Recurrent, hashes: Sequence[BlockHash]) -> Callable[[int], bool]:
    """Whether ``recurrent`` has a findable checkpoint at token ``hit``."""
    return lambda hit: recurrent.checkpoint_at(hashes, hit) is not None
