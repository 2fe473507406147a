"""Group kinds: what each kind of layer group needs for a hit and which blocks a running sequence holds.

============================  ==============================================  =========================
kind                          a token at ``n`` attends to                     a hit at ``h`` needs
============================  ==============================================  =========================
``full``                      every token before it                           blocks ``[0, h)``
``sliding_window`` (W)        tokens ``[n - W + 1, n]``                       the blocks of ``[h-W+1, h)``
``chunked_local`` (C)         its own chunk, ``[C * (n // C), n]``            the blocks of ``[C*(h//C), h)``
``recurrent``                 a state, not tokens                             a checkpoint at exactly ``h``
``cross_attention``           the encoder's outputs                           nothing (never cached)
``circular_buffer`` (S)       a ring of S token slots, one block for life     nothing (never cached)
``retained_prefix_window``    the prompt and ``[n - W + 1, n]``               blocks ``[0, h)``
``capped_sliding_window``     as ``sliding_window`` (admits one pass)         as ``sliding_window``
============================  ==============================================  =========================

Each kind is one module; :mod:`~kvblocks.core.groups.registry` names them.
"""

from kvblocks.core.groups.registry import GROUP_KIND_RULES, kind_rules, register_kind, unregister_kind
from kvblocks.core.groups.rules import NEVER, Cached, KindRules, WindowedRules

__all__ = [
    "GROUP_KIND_RULES",
    "NEVER",
    "Cached",
    "KindRules",
    "WindowedRules",
    "kind_rules",
    "register_kind",
    "unregister_kind",
]
