"""The previous path of :mod:`kvblocks.core.eviction` (kept one release): importing it gives that module."""

import sys

from kvblocks.core import eviction as _moved

sys.modules[__name__] = _moved
