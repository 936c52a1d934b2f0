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
    (``EngineClient.generate``'s ``admission``). It also sees each prompt's choices end, so it
    observes their longest output once per prompt (``end_one``)."""

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
        # prompt_index -> [its sequences started and not ended, the most tokens one generated]
        self._prompts: dict[int, list[int]] = {}

    def start_one(self, prompt_index: int) -> None:
        # Called right before the sequence's engine.generate submits it, in the same loop step.
        self.unstarted -= 1
        self._prompts.setdefault(prompt_index, [0, 0])[0] += 1
        if self.unstarted == 0 and self._submitted is not None:
            self._submitted()

    def end_one(self, prompt_index: int, num_generated: int) -> None:
        """A started sequence of prompt ``prompt_index`` ended, counted in the metrics with
        ``num_generated`` tokens. Once every sequence has started, a prompt whose sequences have all
        ended has its longest output observed (``vllm:request_max_num_generation_tokens``)."""
        prompt = self._prompts[prompt_index]
        prompt[0] -= 1
        prompt[1] = max(prompt[1], num_generated)
        if self.unstarted == 0:
            self._observe_ended_prompts()

    def _observe_ended_prompts(self) -> None:
        for index, (running, most) in list(self._prompts.items()):
            if running == 0:
                del self._prompts[index]
                self._generation.metrics.observe_prompt_finished(most)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.unstarted > 0:
            self._generation.release(self.unstarted)
            self.unstarted = 0
            self._observe_ended_prompts()  # those whose sequences that started have all ended
        self._generation.ticket_closed(self)
