"""Burst gathering (``AsyncEngine`` inherits ``BurstGathering``): an idle engine loop holds its
first step, at most ``arrival_wait_s``, until the rest of a burst of arrivals is in.

Requests that arrive together reach the engine one at a time, as the submitter's event loop parses
each; a step started on the first would be a lone prefill that the others queue behind. So before
an idle loop's first step the submitter's event loop runs rounds: a probe through it (or through
the API server processes' loops, ``probe_submitters``), then a wait for every ``announce``d
request, until a round finds nothing new. The rounds run on that event loop; the loop thread only
waits for the last (``_gather_burst``).

This decides only when an idle loop's first step starts: it never takes, reorders or drops a
command, and never waits past ``arrival_wait_s``; a busy engine does not gather at all
(``AsyncEngine._run`` calls it only when no request is unfinished).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Callable
from typing import Any


class BurstGathering:
    """``AsyncEngine``'s burst gathering and ``announce``. Uses its ``_wake`` (the condition the loop
    thread waits on), ``_stopping``, ``arrival_wait_s``, its count of submitted requests
    (``_num_adds``) and the gathering state its ``__init__`` sets (``_announced`` .. ``_gather_loop``)."""

    _wake: threading.Condition

    # How ``_gather_burst`` probes the submitters, called on their event loop with a function to
    # call once they have taken in what they had received. Default (None): two passes of that loop,
    # which parses the requests itself. An engine serving API server processes
    # (server/engine_fanout.py) probes their event loops instead.
    probe_submitters: Callable[[Callable[[], None]], None] | None = None

    def announce(self) -> Callable[[], None]:
        """Say a request is on its way in (received, not yet submitted); call the returned function,
        idempotent, once its sequences are submitted or it was dropped. An idle loop gathering a
        burst (``_gather_burst``) waits for announced requests, so an API server announces each
        request as early as it can: its parsing and validation may span several event-loop passes.
        """
        with self._wake:
            self._announced += 1
            self._num_announces += 1
        pending = True

        def submitted() -> None:
            nonlocal pending
            if pending:
                pending = False
                with self._wake:
                    self._announced -= 1
                    if self._announced or not self._gathering:
                        return
                    loop, gather = self._gather_loop, self._gather_id
                # The last announced request is in: that may end the gather's round.
                if loop is not None:
                    _on_loop(loop, self._end_round, loop, gather)

        return submitted

    @property
    def announced(self) -> int:
        """Requests announced and not yet submitted."""
        return self._announced

    def _gather_burst(self, loop: asyncio.AbstractEventLoop) -> None:
        """Before an idle loop's first step, let the rest of a burst of arrivals in. Called with
        ``_wake`` held, commands pending.

        Requests that arrive together reach the engine one by one, as the submitter's event loop
        parses each; a step started on the first would be a lone prefill that the others queue
        behind, and it would slow their intake, sharing the cores. So the submitter's loop runs
        rounds (``_begin_round``): a probe through that loop (a few passes: the passes that turn
        bytes already received into running handlers; or through API server processes' loops,
        ``probe_submitters``), then a wait for every ``announce``d request, and another round
        while requests arrived during one (not those announced before its probe left, which it
        waited for). The rounds run on that loop, which decides each next one at once; this
        thread waits for the last. A lone request costs one probe (tens of microseconds); a
        burst, its intake; nothing costs more than ``arrival_wait_s``. A busy engine never waits:
        it batches whatever arrived by its next step.
        """
        deadline = time.monotonic() + self.arrival_wait_s
        self._gathering, self._gathered = True, False
        try:
            try:
                loop.call_soon_threadsafe(self._begin_round, loop, self._gather_id)
            except RuntimeError:  # that loop is closed
                return
            while not self._gathered and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._wake.wait(left)
        finally:
            self._gathering = False
            self._gather_id += 1  # a round still under way on the loop ends there

    def _begin_round(self, loop: asyncio.AbstractEventLoop, gather: int) -> None:
        """On the submitter's loop: probe what is on its way in (``_gather_burst``)."""
        with self._wake:
            if gather != self._gather_id:
                return
            self._round_gather = gather
            self._probes_sent += 1
            number = self._probes_sent
            # What the round knows of as its probe leaves: arrivals after it call for another.
            self._probe_base = (self._num_announces, self._num_adds, self._announced)
        back = functools.partial(self._probe_back, loop, gather, number)
        if self.probe_submitters is not None:
            self.probe_submitters(back)
        else:
            _pass_through(loop, 2, back)

    def _probe_back(self, loop: asyncio.AbstractEventLoop, gather: int, number: int) -> None:
        with self._wake:
            self._probes_back = max(self._probes_back, number)
        self._end_round(loop, gather)

    def _end_round(self, loop: asyncio.AbstractEventLoop, gather: int) -> None:
        """On the submitter's loop, when a round's probe is back or the last announced request was
        submitted: once both, the burst is in unless requests arrived during the round (announced
        since its probe left, or submitted unannounced: more adds than the requests announced
        before or since account for); then another round, at once."""
        with self._wake:
            if (
                gather != self._gather_id
                or self._round_gather != gather  # its first round has not begun
                or self._probes_back < self._probes_sent
                or self._announced > 0
            ):
                return
            announces, adds, pending = self._probe_base
            if self._num_announces == announces and self._num_adds - adds <= pending:
                self._gathered = True
                self._wake.notify()
                return
        self._begin_round(loop, gather)


def _pass_through(loop: asyncio.AbstractEventLoop, passes: int, then: Callable[[], None]) -> None:
    """Call ``then`` on ``loop`` after ``passes`` more passes of it."""
    if passes:
        loop.call_soon(_pass_through, loop, passes - 1, then)
    else:
        then()


def _on_loop(loop: asyncio.AbstractEventLoop, function: Callable[..., None], *args: Any) -> None:
    """Call ``function(*args)`` on ``loop``: now if this is its thread, else soon."""
    try:
        here = asyncio.get_running_loop() is loop
    except RuntimeError:
        here = False
    if here:
        function(*args)
    else:
        with contextlib.suppress(RuntimeError):  # that loop is closed
            loop.call_soon_threadsafe(function, *args)
