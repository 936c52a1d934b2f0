"""A progress line on stderr: rewritten in place on a terminal, a line every few seconds otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: int, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.done = 0
        self.failed = 0
        self.start = time.perf_counter()
        self._last_print = 0.0

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = time.perf_counter()
        if self.enabled and (self.done == self.total or now - self._last_print >= (0.1 if self.tty else 5.0)):
            self._last_print = now
            self._print(now)

    def _print(self, now: float) -> None:
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        line = (
            f"[{self.label}] [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
            f"failed {self.failed}  {rate:.1f} req/s  {elapsed:.1f}s"
        )
        if self.tty:
            self.stream.write("\r" + line + ("\n" if self.done == self.total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self.done != self.total:
            self.stream.write("\n")
            self.stream.flush()
