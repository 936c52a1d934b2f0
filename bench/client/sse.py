"""Incremental Server-Sent Events parsing (the subset OpenAI-style streams use).

Fed one line at a time (without its newline); yields each event's data when the blank line that
ends it arrives. Multi-line ``data:`` fields join with "\\n"; comment lines (``:``) and other
fields (``event:``, ``id:``, ``retry:``) are ignored, as the OpenAI streams carry everything in
``data``.
"""

from __future__ import annotations


class SSEParser:
    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """Take one line; return an event's data when this line completes one."""
        line = line.rstrip("\r")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """End of input (or of an event): the pending event's data, if any. An event whose data
        is empty (``data:`` alone, a keep-alive some proxies send) is no event, as the SSE
        standard says."""
        data = "\n".join(self._data)
        self._data = []
        return data or None
