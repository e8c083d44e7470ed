"""A one-line progress bar on stderr for long replays (no dependency; plain lines when not a terminal)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Counts finished units (sessions) out of `total`; redraws in place on a TTY, else prints every 10%."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30) -> None:
        self.total = max(1, total)
        self.done = 0
        self.label = ""
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self._t0 = time.monotonic()
        self._last_decile = -1
        self._is_tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def set_label(self, label: str) -> None:
        self.label = label
        self._draw()

    def advance(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        self._draw()

    def _draw(self) -> None:
        frac = self.done / self.total
        elapsed_s = time.monotonic() - self._t0
        eta = f"eta {elapsed_s / frac - elapsed_s:4.0f}s" if 0 < frac < 1 else f"{elapsed_s:4.0f}s"
        filled = int(frac * self.width)
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} sessions {eta}  {self.label}"
        if self._is_tty:
            self.stream.write("\r" + line[:160].ljust(100))
            self.stream.flush()
        elif int(frac * 10) != self._last_decile:
            self._last_decile = int(frac * 10)
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._is_tty:
            self.stream.write("\n")
            self.stream.flush()
