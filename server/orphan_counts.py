"""The requests of an API server that died, counted by the engine process (``--api-server-count``).

An API server counts each request it served when it ends (``Generation.stream``:
``vllm:request_success_total`` and the token histograms, in the replica's shared multiprocess
metrics). One that is killed leaves its requests running on the engine, which aborts them when the
connection closes; no process that saw them is left to count them, so the engine process does, as
their API server would have counted a request whose client left: an abort, with the prompt tokens
and the tokens sent back so far (``server/engine_host.py`` keeps a ``Tally`` per request).

A beam search is counted as its API server counts it (``server/beam_search.py``): one abort per
answer (``choices``, as for ``n`` answers), with the prompt's tokens and the steps it had, not one per
step request. Its steps tell the engine process which search they are of (``admission.BeamStep``),
and its API server says when it counted the search itself (``beam_end``), so a search between two
steps, with no request in the engine, is counted too, and one counted already is not again.

Not counted by anyone: a request whose final output was sent to its API server but not yet read
when that process died. The engine process cannot tell it from one that was read and counted (the
socket does not say what the reader took), and telling it would cost a message per request; the
request is then missing from every counter alike, since one ``observe_finished`` call carries all of
them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from server.admission import BeamStep
from server.metrics import ServerMetrics


@dataclass(slots=True)
class Tally:
    """What an API server would count of a request it has sent, if it ends without its last output."""

    prompt_tokens: int
    arrival: float = field(default_factory=time.perf_counter)
    generated: int = 0  # tokens relayed to its API server


@dataclass(slots=True)
class BeamTally:
    """What an API server would count of one prompt's beam search if it ended now: ``choices``
    aborts of ``prompt_tokens`` and the steps whose answers it was sent."""

    choices: int
    prompt_tokens: int
    arrival: float = field(default_factory=time.perf_counter)
    steps: int = 0  # the steps it had finished when it sent its latest one
    unanswered: int = 0  # requests of its latest step not yet relayed their token

    @property
    def generated(self) -> int:
        # Its latest step's tokens all sent: its API server would have that step too (as a request's
        # relayed tokens count).
        return self.steps + (1 if self.unanswered == 0 else 0)


class BeamTallies:
    """One API server's beam searches that it has not counted itself, by (lease key, prompt index)."""

    def __init__(self) -> None:
        self._searches: dict[tuple[int, int], BeamTally] = {}
        self._steps: dict[str, tuple[tuple[int, int], int]] = {}  # step request -> (search, step)

    def __len__(self) -> int:
        return len(self._searches)

    def step(self, rid: str, key: int, beam: BeamStep) -> None:
        """Request ``rid`` is one beam's step ``beam.steps`` of the search ``beam`` describes."""
        search = (key, beam.prompt_index)
        tally = self._searches.get(search)
        if tally is None:
            tally = self._searches[search] = BeamTally(beam.choices, beam.prompt_tokens, steps=beam.steps)
        if beam.steps > tally.steps:
            tally.steps, tally.unanswered = beam.steps, 0
        if beam.steps == tally.steps:
            tally.unanswered += 1
        self._steps[rid] = (search, beam.steps)

    def ended(self, rid: str, out: Any) -> None:
        """Request ``rid`` ended (``out``: its final output, None if it failed)."""
        entry = self._steps.pop(rid, None)
        if entry is None or out is None or not out.outputs or out.outputs[0].finish_reason == "abort":
            return
        tally = self._searches.get(entry[0])
        if tally is not None and tally.steps == entry[1]:
            tally.unanswered -= 1

    def end(self, key: int, prompt_index: int) -> None:
        """Its API server counted this search."""
        self._searches.pop((key, prompt_index), None)

    def release(self, key: int) -> None:
        """Its API server ended request ``key``: every search of it was counted there."""
        for search in [s for s in self._searches if s[0] == key]:
            del self._searches[search]

    def count(self, metrics: ServerMetrics, now: float) -> None:
        for tally in self._searches.values():
            for _ in range(tally.choices):
                metrics.observe_finished(
                    "abort", now - tally.arrival, None, tally.prompt_tokens, tally.generated
                )


def count_orphans(metrics: ServerMetrics | None, conn: Any) -> None:
    """Count the requests of ``conn`` (an ``engine_host._ApiServer``, gone) as aborts, each once.
    Those it asked to abort it counted itself; the steps of a beam search (leased) are counted as
    their search, once per answer."""
    if metrics is None:
        return
    now = time.perf_counter()
    for rid in conn.requests:
        tally = conn.tallies.get(rid)
        if rid in conn.aborting or rid in conn.leased or tally is None:
            continue
        metrics.observe_finished("abort", now - tally.arrival, None, tally.prompt_tokens, tally.generated)
    conn.beams.count(metrics, now)
