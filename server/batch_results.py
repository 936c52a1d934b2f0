"""A running batch's output lines, spooled to disk as they come (``server/batch_jobs.py`` and
``ferry run-batch``, ``server/run_batch.py``).

Requests finish in any order, and a slow early one must not make the later answers wait in
memory: each output line is appended to an anonymous temporary file (in the batch directory, or
the system's temporary directory) the moment it comes, and only its offset is kept (8 bytes and a
flag per input line: within the 50,000 lines a Batch API batch may have, and 9 MB for a million
lines of a run-batch file). The output and error files are then read back from the spool in input
order, a line at a time. Nothing here ever holds more than one output line.
"""

from __future__ import annotations

import json
import tempfile
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class ResultSpool:
    def __init__(self, total: int, directory: Path | str | None = None) -> None:
        self._file = tempfile.TemporaryFile(dir=directory)  # gone with its handle, even on a crash
        self._at = array("q", [-1]) * total  # each input line's output line offset; -1: none yet
        self._failed = bytearray(total)  # 1 where that output line goes to the error file
        self._end = 0
        self.completed = 0
        self.failed = 0

    def add(self, index: int, line: dict[str, Any]) -> None:
        """The output line of input line ``index`` (at most once per index)."""
        data = json.dumps(line).encode() + b"\n"  # json.dumps escapes every newline: one line
        self._file.write(data)
        self._at[index] = self._end
        self._end += len(data)
        failed = line["error"] is not None
        self._failed[index] = failed
        if failed:
            self.failed += 1
        else:
            self.completed += 1

    def __contains__(self, index: int) -> bool:
        return self._at[index] >= 0

    def __len__(self) -> int:
        return self.completed + self.failed

    def lines(self, failed: bool | None = None) -> Iterator[bytes]:
        """The output lines (``failed``: those of the error file, else the output file's; None:
        every one, as run-batch's one output file holds them), in input order, each read from the
        spool when it is asked for."""
        self._file.flush()
        for index, at in enumerate(self._at):
            if at >= 0 and (failed is None or self._failed[index] == failed):
                self._file.seek(at)
                yield self._file.readline()
        self._file.seek(self._end)

    def close(self) -> None:
        self._file.close()
