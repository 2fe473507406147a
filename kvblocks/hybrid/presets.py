"""The previous path of :mod:`kvblocks.layouts.presets` (kept one release): importing it gives that module."""

import sys

from kvblocks.layouts import presets as _moved

sys.modules[__name__] = _moved
