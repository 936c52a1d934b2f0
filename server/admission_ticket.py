"""``Ticket``: the admission of one HTTP request's sequences, from ``Generation.admit`` until the
request ends (what it holds in flight, its key for an engine process that admits too, and whether
it was refused, leased or stopped on purpose).

Split from ``server/generation.py``, which issues and releases tickets, so that the door's own
code (admission, one sequence's stream) reads on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.generation import Generation


class Ticket:
    """Admission of one HTTP request's sequences: they count as in flight from ``admit`` on, so
    simultaneous arrivals see each other. A sequence releases its share when its stream ends;
    ``close()`` releases the shares of sequences that never started (client gone first).
    ``submitted`` (the engine's ``announce`` handle) is called once every sequence has started;
    ``EdgeMiddleware`` calls it when the request ends, for one that never got that far.
    ``key`` and ``size`` go with each sequence to an engine process that admits them too
    (``EngineClient.generate``'s ``admission``)."""

    def __init__(
        self,
        generation: Generation,
        num_sequences: int,
        submitted: Callable[[], None] | None = None,
        key: int = 0,
    ) -> None:
        self._generation = generation
        self.unstarted = num_sequences
        self._submitted = submitted
        self.key = key
        self.size = num_sequences
        self.refused = False  # the engine process refused it (counted once in the metrics)
        self.leased = False  # its beam search steps leased its places in the engine process
        self.stopped = False  # the server ended its stream on purpose (max_tool_calls): a "stop"
        self._closed = False

    def start_one(self) -> None:
        # Called right before the sequence's engine.generate submits it, in the same loop step.
        self.unstarted -= 1
        if self.unstarted == 0 and self._submitted is not None:
            self._submitted()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.unstarted > 0:
            self._generation.release(self.unstarted)
            self.unstarted = 0
        self._generation.ticket_closed(self)
