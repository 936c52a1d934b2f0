"""The serving layer's one door into the engine: admission, timeouts, aborts, fan-out, metrics.

Each engine request (one sequence: one prompt, one choice) goes through ``Generation.stream``,
which guarantees that a request that does not finish normally (client gone, timeout, error,
shutdown) is aborted in the engine at once, so its KV blocks are freed. Requests are admitted
only while the server is not draining and their sequences keep the queue of those that are not
yet running within ``max_queued_requests`` (``server/admission.py``); with several API server
processes the engine process has the last word, and its refusal is the same 429.

What it is handed is planned by the endpoints as ``SequenceRequest``s (``server/sequence_request.py``)
and admitted as a ``Ticket`` (``server/admission_ticket.py``); a request's several sequences are
merged by ``MergedOutputs`` (``server/merged_outputs.py``), which ``Generation`` is built on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.grammar_errors import error_code
from engine.outputs import RequestOutput
from server.admission import (
    Admission,
    AdmissionRefused,
    BeamStep,
    overload_message,
    queued_after,
    running_slots,
)
from server.admission_ticket import Ticket
from server.config import ServerConfig
from server.errors import APIError, bad_request, overloaded, timeout_error, unavailable
from server.merged_outputs import MergedOutputs
from server.metrics import ServerMetrics
from server.sequence_request import SequenceRequest
from server.tracing import FinishedRequest, Tracing, request_span, request_trace, warn_tracing_off
from server.vllm_flags import log_output

logger = logging.getLogger("ferry.server")


@dataclass
class _Deadline:
    timed_out: bool = False
    handle: asyncio.TimerHandle | None = field(default=None, repr=False)


class Generation(MergedOutputs):
    """Admission control and engine calls shared by the completions and chat endpoints."""

    def __init__(
        self, engine: Any, config: ServerConfig, metrics: ServerMetrics, tracing: Tracing | None = None
    ) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.tracing = tracing  # --otlp-traces-endpoint: a span per sequence that ran (trace_span)
        self.draining = False
        self.in_flight = 0  # engine sequences admitted and not finished
        self._max_running = int(getattr(getattr(engine, "config", None), "max_num_seqs", 0) or 0)
        # A sequence-classification model (engine/classifier.py) serves pooling requests only.
        self._classifier = getattr(getattr(engine, "model_info", None), "classifier", None)
        self._live_ids: dict[str, str] = {}  # engine request id -> the HTTP request's id
        # An engine process behind several API servers checks admission again, over all of them
        # (``EngineClient``): each sequence tells it which request it belongs to.
        self._engine_admits = bool(getattr(engine, "checks_admission", False))
        self._ticket_keys = itertools.count(1)
        self._idle = asyncio.Event()
        self._idle.set()

    # -- admission --------------------------------------------------------------------------------

    def queued(self) -> int:
        """Sequences admitted that cannot run now: those beyond the engine's batch slots (including
        ones the engine has not seen yet), or the engine's own waiting queue when KV memory, not
        slots, holds them back."""
        stats = self.engine.stats()
        return queued_after(self._all_in_flight(), running_slots(self._max_running, stats), stats.num_waiting)

    def _all_in_flight(self) -> int:
        # With several API server processes, the engine also runs the others' sequences.
        return self.in_flight + int(getattr(self.engine, "sequences_elsewhere", 0))

    def admit(
        self, num_sequences: int, submitted: Callable[[], None] | None = None, pooling: bool = False
    ) -> Ticket:
        """Admit a request of ``num_sequences`` or raise 503 (draining/unhealthy) / 429 (the queue is
        full, or these sequences would take it past the limit; ``server/admission.py``), or 400 for
        generation on a classifier model (before any stream starts).

        Call after validation; the caller must ``close()`` the ticket when the request ends.
        ``submitted``: the request's ``AsyncEngine.announce`` handle, if it was announced.
        """
        if not pooling and self._classifier is not None:
            raise bad_request(
                "This model is a sequence classifier: it does not generate text. "
                f"Use {self._classifier.routes}."
            )
        if self.draining:
            raise unavailable("Server is shutting down; retry on another replica.")
        if not self.engine.is_healthy():
            raise unavailable("Engine is not healthy.")
        limit = self.config.max_queued_requests
        stats = self.engine.stats()
        slots = running_slots(self._max_running, stats)
        refusal = overload_message(
            self._all_in_flight(), slots, stats.num_waiting, num_sequences, limit, pooling, self._max_running
        )
        if refusal is not None:
            self.metrics.rejected.inc()
            raise overloaded(refusal)
        self._add_in_flight(num_sequences)
        return Ticket(self, num_sequences, submitted, next(self._ticket_keys))

    def release(self, num_sequences: int) -> None:
        """Give back admitted sequences that will never run (their request ended first)."""
        self._add_in_flight(-num_sequences)

    def ticket_closed(self, ticket: Ticket) -> None:
        """An engine process that admits too holds a request's unsent sequences (a beam search's
        leased places) until it ends."""
        if self._engine_admits and (ticket.size > 1 or ticket.leased):
            self.engine.end_admission(ticket.key)

    def step_admission(self, ticket: Ticket, beam: BeamStep) -> dict[str, Any]:
        """``engine.generate``'s admission for a step of the beam search ``beam`` of ``ticket``'s
        request: to an engine process that admits too, the request leases its places
        (``server/admission.py``), and the search is counted there if this process dies."""
        if not self._engine_admits:
            return {}
        ticket.leased = True
        return {"admission": Admission(ticket.key, ticket.size, lease=True, beam=beam)}

    def beam_counted(self, ticket: Ticket, prompt_index: int) -> None:
        """This process counted the beam search of ``ticket``'s prompt ``prompt_index`` (its
        answers, or its abort): the engine process, which would count it if this process died,
        forgets it."""
        if self._engine_admits and ticket.leased:
            self.engine.end_beam(ticket.key, prompt_index)

    def _add_in_flight(self, delta: int) -> None:
        self.in_flight += delta
        if self.in_flight == 0:
            self._idle.set()
        else:
            self._idle.clear()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no sequence is in flight; False if ``timeout`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def abort_all(self) -> None:
        for request_id in list(self._live_ids):
            with contextlib.suppress(Exception):
                await self.engine.abort(request_id)

    async def abort_request(self, request_id: str) -> None:
        """Abort the engine requests of one HTTP request (its streams end with "abort"; blocks
        are freed before this returns). For work that outlives its HTTP request (background
        responses): others abort by closing their streams."""
        for rid in [rid for rid, owner in self._live_ids.items() if owner == request_id]:
            with contextlib.suppress(Exception):
                await self.engine.abort(rid)

    # -- one sequence -----------------------------------------------------------------------------

    def claim_id(self, rid: str, request_id: str) -> str:
        """An engine request id of HTTP request ``request_id``: ``rid``, made unique if a client
        reused its X-Request-Id while the first is running. ``unclaim_id`` it when it ends."""
        if rid in self._live_ids:
            rid = f"{rid}-{time.monotonic_ns():x}"
        self._live_ids[rid] = request_id
        return rid

    def unclaim_id(self, rid: str) -> None:
        self._live_ids.pop(rid, None)

    async def stream(
        self, request_id: str, seq: SequenceRequest, arrival: float, ticket: Ticket
    ) -> AsyncIterator[RequestOutput]:
        """The engine's delta outputs for one admitted sequence (releases its admission share at the end)."""
        rid = self.claim_id(f"{request_id}-{seq.choice_index}", request_id)
        ticket.start_one(seq.prompt_index)
        deadline = _Deadline()
        if self.config.request_timeout is not None:
            loop = asyncio.get_running_loop()
            deadline.handle = loop.call_later(self.config.request_timeout, self._expire, rid, deadline)
        finished = False
        refused = False  # the engine refused it (a 400): it never ran, so it is not counted
        metrics = self.metrics
        first_at = last_at = 0.0
        num_generated = 0
        trace = request_trace()
        if trace is not None and self.tracing is None:
            warn_tracing_off()
        error: str | None = None  # why it failed, for its trace span
        admission = {"admission": (ticket.key, ticket.size)} if self._engine_admits else {}
        try:
            gen = self.engine.generate(
                rid,
                seq.prompt_token_ids if seq.prompt_embeds is None else seq.prompt_embeds,
                seq.params,
                resume_token_ids=seq.resume_token_ids,
                kv_transfer=seq.kv_transfer,
                pooling=seq.pooling,
                lora_request=seq.lora.request if seq.lora is not None else None,
                priority=seq.priority,
                cache_salt=seq.cache_salt,
                images=seq.images,
                **admission,
            )
            if self.config.http.log_outputs and not seq.pooling:
                gen = self._logging_outputs(rid, gen)
            try:
                async for out in gen:
                    now = time.perf_counter()
                    new_tokens = len(out.outputs[0].token_ids) if out.outputs else 0
                    if new_tokens:
                        if first_at == 0.0:
                            first_at = now
                            metrics.observe_first_token(now - arrival, new_tokens)
                        else:
                            metrics.observe_tokens(now - last_at, new_tokens)
                        last_at = now
                        num_generated += new_tokens
                    if out.finished:
                        finished = True
                        reason = (out.outputs[0].finish_reason if out.outputs else None) or "abort"
                        e2e = time.perf_counter() - arrival
                        phases = metrics.observe_finished(
                            reason, e2e, out.metrics, len(seq.prompt_token_ids), num_generated
                        )
                        if self.tracing is not None:
                            if deadline.timed_out and reason == "abort":
                                error = "request timed out"
                            ttft = first_at - arrival if first_at else None
                            self.trace_span(
                                request_id, seq, trace, e2e, ttft, phases, num_generated, reason, error
                            )
                        ticket.end_one(seq.prompt_index, num_generated)
                        if deadline.timed_out and reason == "abort":
                            raise timeout_error(self.config.request_timeout or 0.0)
                        if out.outputs and out.outputs[0].error is not None:
                            # The engine ended it for its constraint (what it costs, or a dead end
                            # no output gets past): the client's doing.
                            code = error_code(out.outputs[0].error)
                            if code == "structured_outputs_dead_end":
                                metrics.structured_outputs_dead_end.inc()
                            else:
                                metrics.structured_outputs_too_costly.inc()
                            raise bad_request(out.outputs[0].error, code=code)
                    yield out
            finally:
                with contextlib.suppress(Exception):
                    await gen.aclose()
        except ValueError as e:
            # The engine's contract: ValueError is a client error (prompt too long, bad token id…).
            refused = True
            raise bad_request(str(e)) from e
        except AdmissionRefused as e:  # before any output: the request's sequences are all refused
            finished = True  # the engine process holds nothing of it: no abort, no finish to count
            if not ticket.refused:
                ticket.refused = True
                metrics.rejected.inc()
            raise overloaded(str(e)) from e
        except APIError:
            raise
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            if not self.engine.is_healthy():  # the engine loop died or is stopping: not a server bug
                raise unavailable(f"The engine cannot serve requests: {e}") from e
            raise
        finally:
            if deadline.handle is not None:
                deadline.handle.cancel()
            if not finished:
                if not refused:  # ended before its last output (client gone, error): an abort
                    e2e = time.perf_counter() - arrival
                    reason = "stop" if ticket.stopped else "abort"
                    phases = metrics.observe_finished(
                        reason, e2e, None, len(seq.prompt_token_ids), num_generated
                    )
                    if self.tracing is not None:
                        ttft = first_at - arrival if first_at else None
                        self.trace_span(
                            request_id, seq, trace, e2e, ttft, phases, num_generated, reason, error
                        )
                    ticket.end_one(seq.prompt_index, num_generated)
                with contextlib.suppress(Exception):
                    await self.engine.abort(rid)
            self.unclaim_id(rid)
            self._add_in_flight(-1)

    def trace_span(
        self,
        request_id: str,
        seq: SequenceRequest,
        trace: dict[str, str] | None,
        e2e: float,
        ttft: float | None,
        phases: Any,
        num_generated: int,
        reason: str,
        error: str | None,
    ) -> None:
        """Emit the sequence's ``llm_request`` span (never raises into the request's path)."""
        assert self.tracing is not None
        finished = FinishedRequest(
            request_id=request_id,
            model=seq.lora.name if seq.lora is not None else self.config.served_model_name,
            e2e=e2e,
            ttft=ttft,
            phases=phases,
            prompt_tokens=len(seq.prompt_token_ids),
            completion_tokens=num_generated,
            finish_reason=reason,
            params=None if seq.pooling else seq.params,
            n=seq.n,
            error=error,
        )
        try:
            request_span(self.tracing, trace, finished)
        except Exception:  # a span is never worth a request
            logger.exception("tracing: could not record the span of request %s", request_id)

    async def _logging_outputs(
        self, rid: str, gen: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[RequestOutput]:
        """``gen``, logging the sequence's whole output when it ends (``--enable-log-outputs``)."""
        text: list[str] = []
        ids: list[int] = []
        try:
            async for out in gen:
                if out.outputs:
                    text.append(out.outputs[0].text)
                    ids += out.outputs[0].token_ids
                if out.finished:
                    reason = (out.outputs[0].finish_reason if out.outputs else None) or "abort"
                    log_output(logger, self.config.http, rid, "".join(text), ids, reason)
                yield out
        finally:
            await gen.aclose()  # type: ignore[attr-defined]

    def _expire(self, rid: str, deadline: _Deadline) -> None:
        deadline.timed_out = True
        asyncio.ensure_future(self.engine.abort(rid))
