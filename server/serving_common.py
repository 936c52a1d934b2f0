"""Pieces shared by the completions and chat endpoints: usage accounting, collecting a whole
(non-streamed) answer, the producer's ``kv_transfer`` answer, and turning a failure after a stream
started into an SSE error event."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import RequestOutput
from kvcache.keys import block_hashes, to_hex
from server.admission_ticket import Ticket
from server.errors import APIError, bad_request
from server.protocol import KVTransferResult, PromptTokensDetails, UsageInfo
from server.sequence_request import SequenceRequest
from server.state import ServerState
from server.streaming import run_or_disconnect, sse_error_frame
from server.structured_params import GUIDED_FIELDS

logger = logging.getLogger("ferry.server")


# A request whose prompt text is longer than this is planned (its chat template rendered, its text
# tokenized) on a worker thread: `tokenizers` lets go of the GIL for a long text
# (``engine.tokenizer.encoding``), so the event loop goes on relaying every other stream meanwhile
# (a 1 MB prompt takes about a second to encode here). bench/long_prompt_stall.py measures it.
OFFLOAD_CHARS = 16 * 1024


def prompt_chars(value: Any) -> int:
    """The characters of text in a prompt or messages (strings, lists, dicts, pydantic models),
    as a cheap size: whether planning the request belongs off the event loop."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], int):  # token ids: no text (and no walk over them)
            return 0
        return sum(prompt_chars(v) for v in value)
    if isinstance(value, dict):
        return sum(prompt_chars(v) for v in value.values())
    fields = getattr(value, "__dict__", None)
    return prompt_chars(fields) if isinstance(fields, dict) else 0


async def plan_off_loop(chars: int, plan: Callable[..., Any], *args: Any) -> Any:
    """``plan(*args)``; on a worker thread when the prompt has over ``OFFLOAD_CHARS`` characters."""
    if chars > OFFLOAD_CHARS:
        return await asyncio.to_thread(plan, *args)
    return plan(*args)


async def compile_constraints(state: ServerState, seqs: list[SequenceRequest], param: str) -> None:
    """Compile the request's structured-outputs constraint before anything starts, so a schema,
    regex or grammar that does not compile is a 400 (naming ``param``), not an error event in a
    started stream."""
    spec = seqs[0].params.structured_outputs if seqs else None
    if spec is None:
        return
    try:
        await state.engine.compile_structured(spec)
    except ValueError as e:
        raise bad_request(str(e), param=param) from e


def constraint_field(req: Any) -> str:
    """The request field that carried its output constraint (for an error's ``param``)."""
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        return "response_format"
    for name, _ in GUIDED_FIELDS:
        if getattr(req, name, None) is not None:
            return name
    return "structured_outputs"


class UsageTracker:
    """Token counts of a request: each prompt counted once (not once per choice), like vLLM/OpenAI."""

    def __init__(self, num_prompts: int, n: int) -> None:
        self.n = n
        self.prompt_tokens = [0] * num_prompts
        self.cached_tokens = [0] * num_prompts
        self.completion_tokens = 0

    def add(self, seq: SequenceRequest, out: RequestOutput) -> None:
        # The prompt's first choice speaks for the prompt (any choice of a resumed stream that
        # runs without it).
        if seq.choice_index % self.n == 0 or not self.prompt_tokens[seq.prompt_index]:
            self.see_prompt(seq.prompt_index, out)
        if out.outputs:
            self.completion_tokens += len(out.outputs[0].token_ids)

    def see_prompt(self, prompt_index: int, out: RequestOutput) -> None:
        """Count a prompt from any of its choices' outputs (before its tokens are added)."""
        self.prompt_tokens[prompt_index] = len(out.prompt_token_ids)
        self.cached_tokens[prompt_index] = out.num_cached_tokens

    def info(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens)
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=self.completion_tokens,
            total_tokens=prompt + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_tokens)),
        )


async def answer_whole(
    state: ServerState,
    seqs: list[SequenceRequest],
    request_id: str,
    arrival: float,
    ticket: Ticket,
    receive: Any,
    on_output: Callable[[SequenceRequest, RequestOutput], None],
    build: Callable[[], Any],
    deliver: Callable[[Any], None],
) -> JSONResponse:
    """A non-streamed answer: feed every output to ``on_output``, then ``build()`` the response
    model. A producer's answer also carries ``kv_transfer``, and when it stopped on length
    ``deliver(result)`` sets the text a stream would have shown (``delivered_text``). A client that
    disconnects cancels the generation; the ticket is closed whatever happens."""

    async def collect() -> Any:
        last: RequestOutput | None = None
        async for seq, out in state.generation.merged(request_id, seqs, arrival, ticket):
            on_output(seq, out)
            last = out
        result = build()
        if is_producer(seqs) and last is not None:
            result.kv_transfer = kv_transfer_result(state, last, seqs[0])
            if result.choices[0].finish_reason == "length":  # the consumer continues the text
                deliver(result)
        return result

    try:
        result = await run_or_disconnect(receive, collect())
    finally:
        ticket.close()
    return JSONResponse(result.model_dump())


def kv_transfer_result(state: ServerState, out: RequestOutput, seq: SequenceRequest) -> KVTransferResult:
    """A prefill (producer) answer: the prompt's full-block hashes for the decode worker to load.

    The engine's KV connector reports what it wrote when a tier is configured; otherwise the
    hashes are computed here with the same function (``kvcache.keys``), except for a prompt with
    images, whose hashes cover the pixels only the engine has seen: none are listed then (there is
    no tier to load them from anyway).
    """
    reported = out.kv_transfer
    if reported and "block_hashes" in reported:
        extra = {k: v for k, v in reported.items() if k not in ("block_hashes", "num_cached_tokens")}
        return KVTransferResult(
            block_hashes=list(reported["block_hashes"]),
            num_cached_tokens=int(reported.get("num_cached_tokens", out.num_cached_tokens)),
            **extra,
        )
    hashes = (
        [] if seq.images else to_hex(block_hashes(out.prompt_token_ids, state.block_size, seq.block_extra))
    )
    return KVTransferResult(block_hashes=hashes, num_cached_tokens=out.num_cached_tokens)


def delivered_text(state: ServerState, seq: SequenceRequest, token_ids: list[int]) -> str:
    """A producer's text as a stream would have shown it so far: without a trailing incomplete
    character or a possible stop-string start, which the consumer's detokenizer (fed the same
    tokens through ``resume``) holds back and emits with the text that follows. The producer's
    own final flush would send them twice."""
    return IncrementalDetokenizer(state.tokenizer, seq.params, seq.prompt_token_ids).append(token_ids)


def is_producer(seqs: list[SequenceRequest]) -> bool:
    """The request is a prefill (producer) request: its answer carries ``kv_transfer``."""
    spec = seqs[0].kv_transfer if seqs else None
    return bool(spec) and spec.get("role") == "producer"


@dataclass
class StreamFailure:
    frame: bytes | None = None
    error: APIError | None = None  # what the frame says, for callers that speak another format


def refused_before_start(failure: StreamFailure, produced: bool) -> None:
    """Raise an admission refusal (429) that ended a held-start stream before it produced anything,
    for ``SSEResponse`` to answer with its status (the engine process of several API servers
    refuses a request as its stream's first message): a client gets the same 429 as when its own
    API server refused it, not a 200 with an error event."""
    if failure.error is not None and failure.error.status == 429 and not produced:
        raise failure.error


@contextlib.asynccontextmanager
async def stream_errors() -> AsyncIterator[StreamFailure]:
    """Inside an SSE generator: an exception becomes one ``data: {"error": …}`` frame for the caller
    to send before ``[DONE]`` (the status line is long gone). Cancellation passes through."""
    failure = StreamFailure()
    try:
        yield failure
    except APIError as e:
        failure.error, failure.frame = e, sse_error_frame(e)
    except Exception:
        logger.exception("error while streaming a response")
        failure.error = APIError(500, "Internal server error while streaming.", code="internal_error")
        failure.frame = sse_error_frame(failure.error)


def shown_prompt_ids(asked: bool, token_ids: list[int], embeds: Any = None) -> list[int] | None:
    """vLLM's ``prompt_token_ids`` of an answer that asked (``return_token_ids``): the prompt the
    engine ran (``token_ids``; ``embeds``: its embeddings, if it was given so), as planned. A resumed
    request's resumed tokens are not part of it, so a failover's or a hand-off's replica shows the
    client's prompt; an image's placeholder is its run of image tokens. None (so absent) when not
    asked or for a prompt given as embeddings: its placeholder ids are no token ids a client could use."""
    if not asked or embeds is not None:
        return None
    return list(token_ids)
