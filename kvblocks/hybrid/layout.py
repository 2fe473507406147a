"""The previous path of :mod:`kvblocks.layouts.plan` (kept one release): importing it gives that module."""

import sys

from kvblocks.layouts import plan as _moved

sys.modules[__name__] = _moved
