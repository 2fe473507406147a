"""Full attention: every token attends to every earlier token; a hit needs its whole leading run."""

from __future__ import annotations

from kvblocks.core.groups.rules import KindRules

__all__ = ["FullAttention"]


class FullAttention(KindRules):
    """Full attention (the base rules: nothing is released, a hit is a leading run of cached blocks)."""

    name = "full"
