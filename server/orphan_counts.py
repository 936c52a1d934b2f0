"""The requests of an API server that died, counted by the engine process (``--api-server-count``).

An API server counts each request it served when it ends (``Generation.stream``:
``vllm:request_success_total`` and the token histograms, in the replica's shared multiprocess
metrics). One that is killed leaves its requests running on the engine, which aborts them when the
connection closes; no process that saw them is left to count them, so the engine process does, as
their API server would have counted a request whose client left: an abort, with the prompt tokens
and the tokens sent back so far (``server/engine_host.py`` keeps a ``Tally`` per request).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from server.metrics import ServerMetrics


@dataclass(slots=True)
class Tally:
    """What an API server would count of a request it has sent, if it ends without its last output."""

    prompt_tokens: int
    arrival: float = field(default_factory=time.perf_counter)
    generated: int = 0  # tokens relayed to its API server


def count_orphans(metrics: ServerMetrics | None, conn: Any) -> None:
    """Count the requests of ``conn`` (an ``engine_host._ApiServer``, gone) as aborts, each once.
    Those it asked to abort it counted itself; the steps of a beam search (leased) are counted by
    their search, not one by one, and the engine process does not know the search."""
    if metrics is None:
        return
    now = time.perf_counter()
    for rid in conn.requests:
        tally = conn.tallies.get(rid)
        if rid in conn.aborting or rid in conn.leased or tally is None:
            continue
        metrics.observe_finished("abort", now - tally.arrival, None, tally.prompt_tokens, tally.generated)
