"""``use_beam_search`` on the serving side: one prompt's beam search as engine requests.

Each step sends every live beam to the engine as its own one-token request, all at once so the
engine batches them, and hands their logprobs to ``engine.beam_search.BeamSearch``. The prefix
cache keeps the shared part of the beams, so a step recomputes little. The choices of a prompt
come out together when its search ends, each as one finished ``RequestOutput``, so the
completions and chat endpoints build (or stream) their answers as for any finished choice.

Admission is the request's: its ``beam_width`` choices count as in flight from start to end (the
engine never runs more than that many beams of it at once). An engine process behind several API
servers admits it too, at its first step, and holds its places until it ends (the steps lease
them: ``server/admission.py``); refused there, it is a 429 as any request is. A client that goes
away, a timeout or a shutdown aborts the step's engine requests at once, as ``Generation.stream``
does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from engine.beam_search import BeamSearch, completion_output
from engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from engine.sampling_params import SamplingParams
from server.admission import AdmissionRefused, BeamStep
from server.errors import APIError, bad_request, overloaded, timeout_error, unavailable
from server.tracing import request_trace, warn_tracing_off

if TYPE_CHECKING:
    from server.admission_ticket import Ticket
    from server.generation import Generation
    from server.sequence_request import SequenceRequest


class _Aborted(Exception):
    """A step's engine request was aborted (a shutdown, a cancelled background response)."""


async def run_beam_search(
    generation: Generation,
    request_id: str,
    group: Sequence[SequenceRequest],
    arrival: float,
    ticket: Ticket,
) -> AsyncIterator[tuple[SequenceRequest, RequestOutput]]:
    """The finished choices of one prompt's beam search (``group``: its choices, in order)."""
    first = group[0]
    assert first.beam is not None  # the caller groups beam search choices only
    engine = generation.engine
    search = BeamSearch(first.prompt_token_ids, first.beam, engine.model_info.eos_token_ids, engine.tokenizer)
    for _ in group:
        ticket.start_one(first.prompt_index)
    metrics = generation.metrics
    timeout = generation.config.request_timeout
    opening: RequestOutput | None = None  # the first step's output: prompt logprobs, cached tokens
    last_at = arrival
    observed = 0  # choices counted in the metrics as finished
    steps = 0  # tokens each live beam has
    refused = False  # the engine refused its first step (a 400): it never ran, so it is not counted
    trace = request_trace()  # its choices' llm_request spans (--otlp-traces-endpoint), as metrics count them
    if trace is not None and generation.tracing is None:
        warn_tracing_off()
    first_at = 0.0
    error: str | None = None  # why it failed, for its spans
    try:
        try:
            async with asyncio.timeout(timeout):
                while not search.done:
                    beam = BeamStep(first.prompt_index, len(group), len(first.prompt_token_ids), steps)
                    outs = await _step(generation, request_id, first, search, ticket, beam)
                    now = time.perf_counter()
                    if opening is None:
                        opening = outs[0]
                        first_at = now
                        metrics.observe_first_token(now - arrival)
                    else:
                        metrics.observe_tokens(now - last_at, 1)
                    last_at = now
                    steps += 1
                    search.advance([_position(out) for out in outs])
            result = search.finish().sequences
        except _Aborted:
            result = []
        except TimeoutError as e:
            error = "request timed out"
            raise timeout_error(timeout or 0.0) from e
        except ValueError as e:
            refused = steps == 0
            raise bad_request(str(e)) from e
        except AdmissionRefused as e:  # at its first step: nothing of it ran
            refused = True
            if not ticket.refused:  # counted once for the request (its other prompts too)
                ticket.refused = True
                metrics.rejected.inc()
            raise overloaded(str(e)) from e
        except APIError:
            raise
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            if not engine.is_healthy():
                raise unavailable(f"The engine cannot serve requests: {e}") from e
            raise
        with_logprobs = first.beam.logprobs is not None
        e2e = time.perf_counter() - arrival
        for j, seq in enumerate(group):
            if j < len(result):
                output = completion_output(result[j], search.prompt_len, 0, with_logprobs)
            else:  # aborted, or fewer beams than asked (a vocabulary smaller than the beam)
                output = CompletionOutput(
                    0, "", [], logprobs=[] if with_logprobs else None, finish_reason="abort"
                )
            reason = output.finish_reason or "abort"
            phases = metrics.observe_finished(
                reason, e2e, None, len(first.prompt_token_ids), len(output.token_ids)
            )
            if generation.tracing is not None:
                ttft = first_at - arrival if first_at else None
                generation.trace_span(
                    request_id, seq, trace, e2e, ttft, phases, len(output.token_ids), reason, None
                )
            ticket.end_one(first.prompt_index, len(output.token_ids))
            observed += 1
            yield (
                seq,
                RequestOutput(
                    request_id=f"{request_id}-{seq.choice_index}",
                    prompt=None,
                    prompt_token_ids=list(first.prompt_token_ids),
                    outputs=[output],
                    finished=True,
                    prompt_logprobs=opening.prompt_logprobs if opening is not None else None,
                    num_cached_tokens=opening.num_cached_tokens if opening is not None else 0,
                ),
            )
    finally:
        e2e = time.perf_counter() - arrival
        for seq in [] if refused else group[observed:]:  # ended without their answer
            phases = metrics.observe_finished("abort", e2e, None, len(first.prompt_token_ids), steps)
            if generation.tracing is not None:
                ttft = first_at - arrival if first_at else None
                generation.trace_span(request_id, seq, trace, e2e, ttft, phases, steps, "abort", error)
            ticket.end_one(first.prompt_index, steps)
        generation.beam_counted(ticket, first.prompt_index)  # the engine process forgets it
        generation.release(len(group))


async def _step(
    generation: Generation,
    request_id: str,
    first: SequenceRequest,
    search: BeamSearch,
    ticket: Ticket,
    beam: BeamStep,
) -> list[RequestOutput]:
    """One step: every live beam as a one-token engine request, run together."""
    params = search.step_params()
    admission = generation.step_admission(ticket, beam)
    tasks = [
        asyncio.ensure_future(
            _one(
                generation,
                request_id,
                f"{request_id}-p{first.prompt_index}-s{search.steps}-b{i}",
                beam.tokens,
                params,
                first,
                admission,
            )
        )
        for i, beam in enumerate(search.live)
    ]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _one(
    generation: Generation,
    request_id: str,
    rid: str,
    tokens: list[int],
    params: SamplingParams,
    seq: SequenceRequest,
    admission: dict[str, Any],
) -> RequestOutput:
    """One beam's step: its final output (the one token, its logprobs)."""
    rid = generation.claim_id(rid, request_id)
    try:
        gen = generation.engine.generate(
            rid,
            tokens,
            params,
            lora_request=seq.lora.request if seq.lora is not None else None,
            priority=seq.priority,
            cache_salt=seq.cache_salt,
            images=seq.images,  # every step's prompt holds them (processed once: the engine keeps them)
            **admission,
        )
        async with contextlib.aclosing(gen):
            async for out in gen:
                if out.finished:  # one token: its output is the last
                    if not (out.outputs and out.outputs[0].logprobs):
                        raise _Aborted
                    return out
    finally:
        generation.unclaim_id(rid)
    raise _Aborted  # the stream ended without a finished output


def _position(out: RequestOutput) -> PositionLogprobs:
    logprobs: Any = out.outputs[0].logprobs
    return logprobs[0]
