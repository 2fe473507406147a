"""The progress line ``replay`` and ``sweep`` draw on a terminal's stderr."""

from __future__ import annotations

import sys
import time
from typing import Any

_CHECKING = "checking integrity"


class _Progress:
    """Progress on stderr, only when stderr is a terminal: a tqdm bar if tqdm is installed (shown after
    1.5 s), else a plain line redrawn a few times a second. Closing it clears it."""

    def __init__(self, total: int, label: str, then: str = "") -> None:
        self._stream = sys.stderr
        self._total, self._label, self._done, self._then = total, label, 0, then
        self._bar: Any = None
        self._shown, self._last = False, -1.0
        self.enabled = bool(getattr(self._stream, "isatty", lambda: False)())
        if self.enabled:
            try:
                from tqdm import tqdm  # type: ignore[import-untyped]
            except ImportError:
                return
            self._bar = tqdm(total=total, unit="req", desc=label, delay=1.5, file=self._stream, leave=False)

    def update(self, n: int = 1) -> None:
        self._done += n
        last = self._done == self._total
        then = f"; {self._then}" if last and self._then else ""
        if self._bar is not None:
            self._bar.update(n)
            if then:
                self._bar.set_postfix_str(self._then)
        elif self.enabled and (time.monotonic() - self._last >= 0.25 or last):
            self._last = time.monotonic()
            self._stream.write(f"\r{self._label}: {self._done:,}/{self._total:,} requests{then}")
            self._stream.flush()
            self._shown = True

    def clear(self) -> None:
        """Take the line off the terminal (before a result row is printed beside it)."""
        if self._bar is not None:
            self._bar.clear()
        elif self._shown:
            self._stream.write("\r\x1b[K")
            self._stream.flush()
            self._shown, self._last = False, -1.0

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            self.clear()
