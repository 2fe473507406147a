"""The previous path of :mod:`kvblocks.core.pool` (kept one release): importing it gives that module."""

import sys

from kvblocks.core import pool as _moved

sys.modules[__name__] = _moved
