"""What one kind of layer group needs, in tokens and block positions: the base every kind extends.

A hit at token ``h`` means the engine computes from token ``h`` on; a running sequence whose next
token is ``n`` attends to tokens from :meth:`KindRules.first_needed_token` ``(n)`` on. Those two
formulas are all a windowed kind has to say: the blocks a hit needs, the blocks a sequence may
release, when a window moves past a block boundary and how many blocks one sequence holds all
follow from them, here, once::

    sliding window W = 6, block size 4, next token n = 14 (attends to tokens 9..14)
    first_needed_token(14) = 9   ->  block 2 is the first held; blocks 0 and 1 may be released
    next_move(14) = 3 * 4 + 6 - 1 = 17: from 17 tokens on, block 2 leaves the window too

A kind is an instance of a subclass, registered by name in :mod:`kvblocks.core.groups.registry`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import ClassVar, Literal

from kvblocks.errors import ConfigError

__all__ = ["GROUP_KINDS", "NEVER", "Cached", "GroupKind", "KindRules", "WindowedRules", "ceil_div"]

GroupKind = Literal["full", "sliding_window", "chunked_local", "recurrent", "cross_attention"]
"""The built-in kinds' names (a kind added with :func:`~kvblocks.core.groups.register_kind` is a ``str`` too)."""
GROUP_KINDS: tuple[GroupKind, ...] = ("full", "sliding_window", "chunked_local", "recurrent", "cross_attention")

NEVER = sys.maxsize
"""A token count no sequence reaches: "the window never moves"."""

Cached = Callable[[int], bool]
"""For a kind with blocks: is block ``position`` (of the group's block size) cached? For a recurrent
kind: is there a state checkpoint at token ``position``?"""


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` in integers."""
    return -(-a // b)


class KindRules:
    """A group kind's rules. The defaults are full attention's: every token attends to every earlier one.

    Class attributes say what the kind is made of:

    * ``has_blocks``: its layers hold per-token K/V in blocks (False: one state per sequence);
    * ``spanned``: it needs a span (a window or a chunk, in tokens);
    * ``prefix_cached``: its blocks are findable by the hash chain (False: cross-attention);
    * ``releases``: a running sequence gives blocks back as its window moves (a *local* kind);
    * ``event_kind``: the wire kind its events carry, for a kind that is not built in.
    """

    name: ClassVar[str] = ""
    has_blocks: ClassVar[bool] = True
    spanned: ClassVar[bool] = False
    prefix_cached: ClassVar[bool] = True
    releases: ClassVar[bool] = False
    event_kind: ClassVar[str | None] = None
    """The kind KV events name (:data:`kvblocks.events.EVENT_GROUP_KINDS`, a fixed wire vocabulary): None
    for a built-in kind (its own name); a new kind names the built-in one a consumer should treat it as."""

    @property
    def event_name(self) -> str:
        """The ``group_kind`` this kind's KV events carry."""
        return self.event_kind or self.name

    def __repr__(self) -> str:
        return f"<group kind {self.name!r}>"

    def check_span(self, span: object) -> None:
        """Raise :class:`ConfigError` unless ``span`` suits the kind (a positive int, or None when it takes none)."""
        if self.spanned:
            if isinstance(span, bool) or not isinstance(span, int) or span <= 0:
                raise ConfigError(f"a {self.name} group needs a positive int span (window or chunk), got {span!r}")
        elif span is not None:
            raise ConfigError(f"a {self.name} group takes no span, got {span!r}")

    # ------------------------------------------------------------------ the running sequence

    def first_needed_token(self, next_token: int, span: int) -> int:
        """The first token any token from ``next_token`` on attends to."""
        return 0

    def first_needed(self, next_token: int, block_size: int, span: int) -> int:
        """The first block position any token from ``next_token`` on attends to: blocks before it may go."""
        return self.first_needed_token(next_token, span) // block_size

    def next_move(self, next_token: int, block_size: int, span: int) -> int:
        """The smallest token count from which :meth:`first_needed` may exceed its value at ``next_token``."""
        return NEVER

    def held_blocks(self, context: int, block_size: int, span: int | None) -> int:
        """Blocks one running sequence of ``context`` tokens holds (for memory planning)."""
        return ceil_div(context, block_size)

    # ------------------------------------------------------------------ prefix hits

    def needed_blocks(self, hit: int, block_size: int, span: int) -> range:
        """The blocks a hit at token ``hit`` needs cached (empty when none)."""
        if hit <= 0:
            return range(0)
        first = self.first_needed_token(hit, span)
        return range(first // block_size, ceil_div(hit, block_size)) if first < hit else range(0)

    def longest_hit(self, top: int, step: int, block_size: int, span: int, cached: Cached) -> int:
        """The largest multiple of ``step`` at or below ``top`` (a positive multiple of it) the group serves.

        Full attention serves a leading run, found in one pass.
        """
        run = 0
        end = top // block_size
        while run < end and cached(run):
            run += 1
        return (run * block_size // step) * step


class WindowedRules(KindRules):
    """A local kind: tokens attend to a span before them, so blocks behind it are released."""

    spanned = True
    releases = True

    def longest_hit(self, top: int, step: int, block_size: int, span: int, cached: Cached) -> int:
        """Look down from ``top``: a hit is served when every block it needs is cached."""
        h = top
        while h > 0:
            for missing in reversed(self.needed_blocks(h, block_size, span)):  # up to span / B calls per hit
                if not cached(missing):
                    break
            else:
                return h
            h = self.below_missing(h, missing, block_size, step)
        return 0

    def below_missing(self, hit: int, missing: int, block_size: int, step: int) -> int:
        """The next hit to try once ``hit`` needs block ``missing``, which is not cached."""
        return hit - step
