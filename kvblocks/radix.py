"""The previous path of :mod:`kvblocks.core.prefix_tree` (kept one release): importing it gives that module."""

import sys

from kvblocks.core import prefix_tree as _moved

sys.modules[__name__] = _moved
