"""Both directions across ``AsyncEngine``'s thread boundary: the commands callers queue for the loop
thread (add a request, abort one, reset the prefix cache), and the per-request streams its outputs
go back through, on each caller's event loop with one wake-up per loop and step. ``AsyncEngine``
inherits ``OutputDelivery``; the loop that applies the commands stays in
``engine/async_engine.py``. Nothing here touches the ``LLMEngine``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass

from engine.async_sleep import Lifecycle
from engine.outputs import RequestOutput
from engine.sequence import Request

logger = logging.getLogger(__name__)


Sink = Callable[[RequestOutput | BaseException], None]


@dataclass(eq=False)
class _Stream:
    """Where a request's outputs go: its caller's ``sink``, on the caller's event loop, while it is
    the request's current stream in ``streams`` (the engine's). No closure over itself: a request
    leaves no reference cycle behind, so its objects go when it ends, not at the next collection
    of the cyclic GC (which pauses every thread of the process)."""

    loop: asyncio.AbstractEventLoop
    sink: Sink
    request_id: str
    streams: dict[str, _Stream]

    def deliver(self, out: RequestOutput | BaseException) -> None:
        streams = self.streams
        if streams.get(self.request_id) is not self:
            return  # cancelled: nobody wants the rest
        if isinstance(out, BaseException) or out.finished:
            del streams[self.request_id]
        self.sink(out)


@dataclass
class _Add:
    request: Request
    stream: _Stream  # added only while it is still the request's stream (not cancelled meanwhile)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:  # the submitter's: an idle loop thread probes it
        return self.stream.loop


@dataclass
class _Abort:
    request_id: str
    done: concurrent.futures.Future


@dataclass
class _ResetPrefixCache:
    done: concurrent.futures.Future  # -> number of blocks dropped, or False while requests run
    reset_running: bool = False  # preempt running requests first (they recompute), as vLLM's option
    result: int | bool = False


_Command = _Add | _Abort | _ResetPrefixCache | Lifecycle


class OutputDelivery:
    """``AsyncEngine``'s hand-over of outputs to the request streams in its ``_streams``."""

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs over with one wake-up per event loop (not one per request): each
        ``call_soon_threadsafe`` writes to the loop's wake-up pipe and contends for the GIL."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Sink, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.deliver, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_hand_over, items)

    def _fail_all(self, error: BaseException) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Sink, BaseException]]] = {}
        for stream in list(self._streams.values()):
            by_loop.setdefault(stream.loop, []).append((stream.deliver, error))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_hand_over, items)
            except RuntimeError:
                pass  # that event loop is closed: nobody is waiting


def _hand_over(items: list[tuple[Sink, RequestOutput | BaseException]]) -> None:
    for sink, out in items:
        try:
            sink(out)
        except Exception:  # one consumer's bug must not starve the others of this step
            logger.exception("an output sink failed")
