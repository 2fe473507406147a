"""The one place kvblocks imports PyTorch for its tensor modules.

PyTorch is an optional extra (``kvblocks[torch]``): replaying traces, routing and the tiers'
bookkeeping need none of it. A torch-backed module imports ``torch`` from here, so a missing
PyTorch is reported once, the same way, naming the extra -- not as a bare ``ModuleNotFoundError``
deep inside a backend.
"""

from __future__ import annotations

from kvblocks.errors import MissingExtraError

try:
    import torch as torch
except ImportError as error:  # not installed, or blocked
    raise MissingExtraError(
        "kvblocks' tensor backends need PyTorch",
        "torch",
        "for PyTorch's CPU build, install torch from its CPU index first; see the README",
    ) from error

__all__ = ["torch"]
