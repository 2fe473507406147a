"""``python -m kvblocks.cli``: the ``kvblocks`` command (as ``python -m kvblocks``)."""

from kvblocks.cli import main

raise SystemExit(main())
