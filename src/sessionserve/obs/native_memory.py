"""Keep the process's native memory flat under a long, varied load.

Two things grow a serving process's RSS with no leak in Python objects: the
oneDNN primitive cache, which keeps a compiled kernel (and its scratch
memory) per distinct matrix shape, and a batch size or chunk length makes a
new shape; and glibc's allocator, which keeps freed activation buffers of
every size in its heap. Measured on the tiny model, 60 s of random batch
sizes and prompt lengths: RSS 293 -> 1207 MiB and still climbing with the
defaults; 293 -> 616 MiB with the cache capped at 128 shapes and free heap
returned to the OS every 2 s (a trim takes ~0.2 ms).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import time

PRIMITIVE_CACHE_CAPACITY = "128"


def cap_primitive_cache() -> None:
    """Default oneDNN's primitive cache to a bounded size (read when oneDNN first runs; a user's value wins)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", PRIMITIVE_CACHE_CAPACITY)


class HeapTrimmer:
    """Returns free heap pages to the OS (glibc `malloc_trim`) at most every `period_s` seconds."""

    def __init__(self, period_s: float = 2.0) -> None:
        self.period_s = period_s
        self._next_s = time.monotonic() + period_s
        self._trim = None
        if sys.platform.startswith("linux"):
            try:
                self._trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
            except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to do
                self._trim = None

    def maybe_trim(self) -> None:
        if self._trim is None:
            return
        now = time.monotonic()
        if now >= self._next_s:
            self._next_s = now + self.period_s
            self._trim(0)
