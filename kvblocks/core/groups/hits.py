"""Prefix hits of a hybrid model: the longest prefix every group of layers can serve. Pure.

A hit at token ``h`` means the engine starts computing at token ``h``; each kind of group needs
different cached blocks for that (``h`` on a block boundary of every group)::

    full attention        every block before h                            tokens [0, h)
    sliding window W      the blocks holding the last W - 1 tokens        tokens [h - W + 1, h)
    chunked local C       the blocks of h's own chunk before h            tokens [C * floor(h / C), h)
    recurrent             a state checkpoint taken exactly at h
    cross-attention       nothing: encoder K/V are computed per request, never prefix-cached

    block size 4, W = 6, a hit at h = 12 (token 12 is computed next and attends to tokens 7..12):
    block            |  0  |  1  |  2  |
    full needs          x     x     x
    window needs              x     x        tokens 7..11

The model's hit is the largest ``h`` that every group serves. Each group in turn gives the largest
hit it can serve at or below the current limit, and the limit drops to the smallest answer, until no
group lowers it. The fixed point is the largest common hit: a hit every group serves is never above
any group's answer, so the limit never drops below it. For full attention "what it can serve" is a
leading run (serving ``h`` means serving everything below); for the other kinds it is not, which is
why the search iterates instead of taking one minimum.

Hits are multiples of every group's block size (their least common multiple), so that no group's
hit ends inside a block. Recurrent checkpoints are taken at such boundaries.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvblocks.core.groups.registry import kind_rules
from kvblocks.core.groups.rules import Cached, GroupKind, KindRules
from kvblocks.errors import ConfigError

__all__ = ["GroupHitRule", "hit_step", "longest_common_hit", "longest_group_hit", "needed_blocks"]


@dataclass(frozen=True)
class GroupHitRule:
    """What one group needs for a hit: its kind, block size (None for recurrent) and span (W or C).

    The kind's formulas are its :class:`~kvblocks.core.groups.KindRules` (:attr:`kind_rules`), looked up
    in the registry once, here.
    """

    kind: GroupKind | str
    block_size: int | None = None
    span: int | None = None
    kind_rules: KindRules = field(init=False, repr=False, compare=False)
    """The kind's rules (:mod:`kvblocks.core.groups`)."""

    def __post_init__(self) -> None:
        rules = kind_rules(self.kind)
        size = self.block_size
        if not rules.has_blocks:
            if size is not None:
                raise ConfigError(f"a {self.kind} group has no block size: its states are checkpointed at hit points")
        elif isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ConfigError(f"a {self.kind} group needs a positive int block_size, got {size!r}")
        rules.check_span(self.span)
        object.__setattr__(self, "kind_rules", rules)


def needed_blocks(rule: GroupHitRule, hit: int) -> range:
    """The blocks of ``rule``'s group that a hit at token ``hit`` needs cached (empty when none)."""
    return rule.kind_rules.needed_blocks(hit, rule.block_size or 0, rule.span or 0)


def hit_step(rules: Sequence[GroupHitRule]) -> int:
    """Hits are multiples of this: the least common multiple of the groups' block sizes (1 if none)."""
    sizes = [r.block_size for r in rules if r.block_size is not None]
    return math.lcm(*sizes) if sizes else 1


def longest_group_hit(rule: GroupHitRule, limit: int, step: int, cached: Cached) -> int:
    """The largest multiple of ``step`` at or below ``limit`` that this group serves (0 always is).

    Each kind searches its own way (:meth:`~kvblocks.core.groups.KindRules.longest_hit`): full attention
    serves a leading run, found in one pass; a windowed kind looks down from ``limit`` (a sliding window
    skips straight below the first missing block it finds); a recurrent group needs a checkpoint.
    """
    top = (limit // step) * step
    if top <= 0:
        return max(top, 0)
    return rule.kind_rules.longest_hit(top, step, rule.block_size or 0, rule.span or 0, cached)


def longest_common_hit(
    rules: Sequence[GroupHitRule], limit: int, cached: Sequence[Cached], step: int | None = None
) -> int:
    """The largest hit at or below ``limit`` tokens that every group serves (see the module docstring).

    ``cached[i]`` answers for group ``i``: block positions for attention groups, checkpoint token
    positions for recurrent ones. ``step`` (default :func:`hit_step` of the rules) is what hits are
    multiples of; give it when a group not in ``rules`` (the hash chain's block size, a recurrent
    group's checkpoint spacing) makes it coarser -- a recurrent rule alone would search token by token.
    """
    if len(rules) != len(cached):
        raise ConfigError(f"{len(rules)} group rules but {len(cached)} cached-block answers")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ConfigError(f"limit must be an int >= 0 tokens, got {limit!r}")
    if step is None:
        step = hit_step(rules)
    elif isinstance(step, bool) or not isinstance(step, int) or step <= 0 or step % hit_step(rules):
        raise ConfigError(f"step must be a positive multiple of every group's block size, got {step!r}")
    hit = (limit // step) * step
    while True:
        lowest = hit
        for rule, answer in zip(rules, cached, strict=True):
            lowest = min(lowest, longest_group_hit(rule, lowest, step, answer))
            if lowest == 0:
                return 0
        if lowest == hit:
            return hit
        hit = lowest
