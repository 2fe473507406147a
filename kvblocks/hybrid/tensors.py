"""The previous path of :mod:`kvblocks.backends.group_caches` (kept one release): importing it gives that module."""

import sys

from kvblocks.backends import group_caches as _moved

sys.modules[__name__] = _moved
