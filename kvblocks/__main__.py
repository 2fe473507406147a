"""``python -m kvblocks``: the ``kvblocks`` command."""

from kvblocks.cli import main

raise SystemExit(main())
