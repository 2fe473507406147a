"""What one kind of layer group needs, in tokens and block positions: the base every kind extends.

A hit at token ``h`` means the engine computes from token ``h`` on; a running sequence whose next
token is ``n`` attends to tokens from :meth:`KindRules.first_needed_token` ``(n)`` on. Those two
formulas are all a windowed kind has to say: the blocks a hit needs, the blocks a sequence may
release, when a window moves past a block boundary and how many blocks one sequence holds all
follow from them, here, once::

    sliding window W = 6, block size 4, next token n = 14 (attends to tokens 9..14)
    first_needed_token(14) = 9   ->  block 2 is the first held; blocks 0 and 1 may be released
    next_move(14) = 3 * 4 + 6 - 1 = 17: from 17 tokens on, block 2 leaves the window too

What a running sequence holds is said in block positions, as :data:`Positions` (sorted, disjoint ranges),
so a kind whose released positions are not one leading run says so too: :meth:`KindRules.released` (the
positions no later token attends to), :meth:`KindRules.admission_released` (those an admission never
takes), :meth:`KindRules.cached_stop` (how far a commit may cache) and :meth:`KindRules.table_length` (a
table of one entry per position, or fewer). Their defaults follow from the two formulas above::

    retained-prefix window W = 6, block size 4, a 10-token prompt, next token 26 (attends 0..9 and 21..26)
    released(26) = (range(3, 5),): blocks 3 and 4 (tokens 12..19) lie between the prompt and the window

A kind is an instance of a subclass, registered by name in :mod:`kvblocks.core.groups.registry`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import ClassVar, Literal

from kvblocks.errors import ConfigError

__all__ = [
    "GROUP_KINDS",
    "NEVER",
    "Cached",
    "GroupKind",
    "KindRules",
    "Positions",
    "WindowedRules",
    "ceil_div",
    "covers",
    "minus",
    "union",
]

GroupKind = Literal["full", "sliding_window", "chunked_local", "recurrent", "cross_attention"]
"""The layout kinds' names (:mod:`kvblocks.layouts.plan`); every other kind, built in or added with
:func:`~kvblocks.core.groups.register_kind`, is named by a ``str``."""
GROUP_KINDS: tuple[GroupKind, ...] = ("full", "sliding_window", "chunked_local", "recurrent", "cross_attention")

NEVER = sys.maxsize
"""A token count no sequence reaches: "the window never moves"."""

Cached = Callable[[int], bool]
"""For a kind with blocks: is block ``position`` (of the group's block size) cached? For a recurrent
kind: is there a state checkpoint at token ``position``?"""


Positions = tuple[range, ...]
"""Block positions as sorted, disjoint, non-empty ranges of step 1: ``()`` is none, ``(range(0, 3),)`` 0, 1 and 2."""


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` in integers."""
    return -(-a // b)


def union(*parts: Positions | range) -> Positions:
    """The positions in any of ``parts`` (each :data:`Positions` or one range), merged."""
    spans = sorted(
        (r.start, r.stop) for part in parts for r in ((part,) if isinstance(part, range) else part) if r.stop > r.start
    )
    out: list[range] = []
    for start, stop in spans:
        if out and start <= out[-1].stop:
            if stop > out[-1].stop:
                out[-1] = range(out[-1].start, stop)
        else:
            out.append(range(start, stop))
    return tuple(out)


def minus(within: Positions | range, gone: Positions) -> Positions:
    """The positions of ``within`` not in ``gone``."""
    out: list[range] = []
    for r in (within,) if isinstance(within, range) else within:
        start = r.start
        for g in gone:
            if g.stop <= start or g.start >= r.stop:
                continue
            if g.start > start:
                out.append(range(start, g.start))
            start = max(start, g.stop)
        if start < r.stop:
            out.append(range(start, r.stop))
    return tuple(out)


def covers(outer: Positions, inner: Positions) -> bool:
    """Whether every position of ``inner`` is in ``outer``."""
    return all(any(o.start <= r.start and r.stop <= o.stop for o in outer) for r in inner)


class KindRules:
    """A group kind's rules. The defaults are full attention's: every token attends to every earlier one.

    Class attributes say what the kind is made of:

    * ``has_blocks``: its layers hold per-token K/V in blocks (False: one state per sequence);
    * ``spanned``: it needs a span (a window or a chunk, in tokens);
    * ``prefix_cached``: its blocks are findable by the hash chain (False: cross-attention);
    * ``releases``: a running sequence gives blocks back as its window moves;
    * ``local``: its groups are local groups (:class:`~kvblocks.core.groups.local_group.LocalGroup`): a pool,
      a flat index and a table per sequence beside full attention;
    * ``leading``: what a running sequence releases is one leading run, the positions before
      :meth:`first_needed` (the default :meth:`released`), and a commit caches every full block (the default
      :meth:`cached_stop`): a manager then takes a window's fast path;
    * ``one_pass``: an admission leaves more positions than :meth:`released` at the hit (the default
      :meth:`admission_released` leaves exactly those);
    * ``event_kind``: the wire kind its events carry, for a kind that is not built in.

    Formulas that depend on the sequence take ``prompt``: the tokens it knew when admitted (None: unknown).
    """

    name: ClassVar[str] = ""
    has_blocks: ClassVar[bool] = True
    spanned: ClassVar[bool] = False
    prefix_cached: ClassVar[bool] = True
    releases: ClassVar[bool] = False
    local: ClassVar[bool] = False
    leading: ClassVar[bool] = True
    one_pass: ClassVar[bool] = False
    table_entries: ClassVar[int | None] = None
    """A sequence's table entries whatever its length (a ring: 1); None: one entry per block position."""
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

    def released(self, next_token: int, block_size: int, span: int, prompt: int | None) -> Positions:
        """The block positions no token from ``next_token`` on attends to: a running sequence releases them.

        Only grows with ``next_token``. Default: every position before :meth:`first_needed`.
        """
        first = self.first_needed(next_token, block_size, span)
        return (range(0, first),) if first > 0 else ()

    def admission_released(
        self, hit: int, pass_end: int | None, block_size: int, span: int, prompt: int | None
    ) -> Positions:
        """The positions an admission at ``hit`` never takes. ``pass_end`` (None: unknown) is where the
        admission's one pass stops: the engine computes tokens ``[hit, pass_end)`` at once and commits there
        before it computes anything else. Default: :meth:`released` at the hit (the pass needs the rest)."""
        return self.released(hit, block_size, span, prompt)

    def cached_stop(self, committed: int, block_size: int, prompt: int | None) -> int:
        """Positions below this one may be cached once ``committed`` tokens are written. Default: every full block."""
        return committed // block_size

    def table_length(self, positions: int) -> int:
        """A sequence's table length when its tokens span ``positions`` block positions: one entry per position,
        or :attr:`table_entries` whatever the length."""
        return positions if self.table_entries is None else self.table_entries

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
    local = True

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
