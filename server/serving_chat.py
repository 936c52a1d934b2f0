"""POST /v1/chat/completions: messages through the model's chat template, n choices, streamed or not.

Streaming follows OpenAI's chunk order: a role chunk per choice first, then content deltas, the
finish reason on the choice's last chunk, a usage chunk with empty ``choices`` when
``stream_options.include_usage`` is set, then ``data: [DONE]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from server.chat_cap import cut_at_cap
from server.chat_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
    TokenLogprob,
)
from server.chat_shape import ChoiceShaper, shape_whole
from server.errors import bad_request
from server.generation import SequenceRequest, Ticket, block_extra
from server.handoff_params import client_budget, kv_transfer_spec, longest_resumed, resumed_choices
from server.images import load_images, with_image_runs
from server.logprobs import chat_logprobs, prompt_logprobs_out
from server.params import (
    beam_search_params,
    check_min_tokens,
    check_stream_prompt_logprobs,
    child_seed,
    resolve_max_tokens,
    sampling_params,
)
from server.prompts import chat_prompt
from server.reasoning_parsers import prompt_opens_thinking
from server.roles import producer_budget, transfer_for_role
from server.serving_common import (
    UsageTracker,
    answer_whole,
    compile_constraints,
    constraint_field,
    delivered_text,
    is_producer,
    kv_transfer_result,
    plan_off_loop,
    prompt_chars,
    refused_before_start,
    stream_errors,
)
from server.state import ServerState
from server.streaming import DONE_FRAME, FinalFrames, SSEResponse, sse_frame
from server.tools import ToolPlan, plan_tools, tool_finish_reason
from server.vllm_flags import apply_request_defaults, log_request

logger = logging.getLogger("ferry.server")


@dataclasses.dataclass
class _Choice:
    texts: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_entries: list | None = None  # the engine's prompt logprobs (``prompt_logprobs``)


def _plan(
    state: ServerState, req: ChatCompletionRequest, tools: ToolPlan | None, lora: Any, images: list[Any]
) -> list[SequenceRequest]:
    limits = state.limits
    prompt_ids = chat_prompt(
        req, state.tokenizer, state.config.trust_request_chat_template, state.config.chat, limits
    )
    prompt_ids = with_image_runs(state, prompt_ids, len(images))
    resumed = resumed_choices(req, 1, limits)
    resume = longest_resumed(resumed)
    extra = block_extra(lora, req.cache_salt)
    # An image's pixels are part of its blocks' hashes, known once the engine has processed it: a
    # consumer's listed hashes are then checked there (LLMEngine.add_request), not here.
    kv = transfer_for_role(
        state.config.role,
        kv_transfer_spec(req, 1),
        prompt_ids,
        state.block_size,
        resume,
        extra,
        check_hashes=not images,
    )
    top_n = req.top_logprobs or 0
    budget = client_budget(req)  # a producer's: the client's (it computes one token whatever it says)
    max_tokens = resolve_max_tokens(
        budget, len(prompt_ids), limits, default=None, num_resumed=len(resume or [])
    )
    if budget is not req:
        check_min_tokens(budget, max_tokens)
    max_tokens = producer_budget(kv, max_tokens)
    check_stream_prompt_logprobs(req)
    base = sampling_params(
        req,
        max_tokens=max_tokens,
        logprobs=top_n if req.logprobs else None,
        limits=limits,
        prompt_logprobs=None if req.stream else req.prompt_logprobs,
        tokenizer=state.tokenizer,
    )
    if tools is not None and tools.constraint is not None:
        if base.structured_outputs is not None:
            raise bad_request(
                f"tool_choice {tools.mode!r} constrains the output itself: it cannot be combined with "
                f"{constraint_field(req)}",
                param="tool_choice",
            )
        base = dataclasses.replace(base, structured_outputs=tools.constraint)
    if base.structured_outputs is not None and state.reasoning is not None:
        base = _after_thinking(state, base, prompt_ids)
    if (tools is not None and tools.mode == "auto" and tools.parser.needs_special_tokens) or (
        state.reasoning is not None and state.reasoning.needs_special_tokens
    ):
        base = dataclasses.replace(base, skip_special_tokens=False)  # the markers are special tokens
    if req.use_beam_search and state.config.role == "prefill":
        raise bad_request("a prefill worker does not run beam search", param="use_beam_search")
    beam = beam_search_params(req, base, limits, top_n if req.logprobs else None)
    return [
        SequenceRequest(
            j,
            0,
            prompt_ids,
            dataclasses.replace(base, seed=child_seed(req.seed, j)) if j else base,
            (resumed or {}).get(j) or None,
            kv,
            lora=lora,
            priority=req.priority,
            cache_salt=req.cache_salt,
            beam=beam,
            images=images or None,
        )
        for j in (range(req.n) if resumed is None else resumed)
    ]


def _after_thinking(state: ServerState, params: SamplingParams, prompt_ids: list[int]) -> SamplingParams:
    """With a reasoning parser, a constraint starts once the model has finished thinking (its
    ``</think>`` token), unless the prompt already closed the thinking (Qwen3 with thinking off).
    Where ``</think>`` is not one token the constraint starts at once (``_splitter``)."""
    end = state.reasoning_end_id
    if end is None or end in prompt_ids[-8:]:
        return params
    spec = dataclasses.replace(params.structured_outputs, after_token_id=end)
    return dataclasses.replace(params, structured_outputs=spec)


def _resumed_split(state: ServerState, seq: SequenceRequest, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a resumed whole answer's ``text``, after its resumed tokens' text:
    None for a part that has no text (the caller joins them to the resumed tokens' own)."""
    shaper = ChoiceShaper(None, _splitter(state, seq))
    shaper.skip(delivered_text(state, seq, seq.resume_token_ids or []))
    shaped, last = shaper.feed(text), shaper.finish()
    return (shaped.reasoning + last.reasoning) or None, (shaped.content + last.content) or None


def _splitter(state: ServerState, seq: SequenceRequest):
    """The choice's reasoning splitter. Under a constraint from the first token the answer holds
    thinking only if it opens with ``<think>`` (the constraint wrote it): otherwise a parser that
    assumes the prompt opened the thinking would take the constrained answer for unfinished thoughts."""
    spec = seq.params.structured_outputs
    requires_start = True if spec is not None and spec.after_token_id is None else None
    if requires_start is None and state.reasoning is not None and state.reasoning.prompt_decides:
        tail = state.tokenizer.decode(seq.prompt_token_ids[-8:], skip_special_tokens=False)
        requires_start = not prompt_opens_thinking(tail)
    return state.new_reasoning_splitter(requires_start=requires_start)


def _shaper(state: ServerState, seq: SequenceRequest, tools: ToolPlan | None) -> ChoiceShaper:
    return ChoiceShaper(tools, _splitter(state, seq))


def _delta(
    state: ServerState, choice: _Choice, req: ChatCompletionRequest, out: RequestOutput
) -> tuple[str, list[TokenLogprob] | None]:
    o = out.outputs[0]
    choice.texts.append(o.text)
    choice.token_ids += o.token_ids
    logprobs = None
    if req.logprobs:
        logprobs = chat_logprobs(
            state.tokenizer, o.token_ids, o.logprobs, req.top_logprobs or 0, req.return_tokens_as_token_ids
        )
        choice.logprobs += logprobs
    if out.finished:
        choice.finish_reason = o.finish_reason
        choice.stop_reason = o.stop_reason
        choice.prompt_entries = out.prompt_logprobs
    return o.text, logprobs


def answer_role(state: ServerState, req: ChatCompletionRequest) -> str:
    """The role of the answer's message, as vLLM names it: ``--response-role`` (default "assistant")
    when the prompt asks for a new turn, else the role of the message it continues."""
    if req.add_generation_prompt:
        return state.config.response_role
    return req.messages[-1].role


def echoed_text(req: ChatCompletionRequest, role: str) -> str:
    """What ``echo`` puts in front of the answer (vLLM's rule): the last message's text when that
    message has the answer's role, its text parts joined by newlines; else nothing."""
    if not req.echo or not req.messages or req.messages[-1].role != role:
        return ""
    content = req.messages[-1].content
    if isinstance(content, list):
        return "\n".join(part.text for part in content if part.text is not None)
    return content or ""


async def create_chat_completion(
    state: ServerState,
    req: ChatCompletionRequest,
    request_id: str,
    receive,
    submitted: Callable[[], None] | None = None,
    as_chunks: bool = False,
    max_tool_calls: int | None = None,
) -> object:
    """The answer: a JSONResponse, or for ``stream`` an SSEResponse; with ``as_chunks`` a stream is
    returned as ``ChatChunks`` (the chunk models unframed, for the Responses API to translate).
    ``max_tool_calls``: the Responses API's cap on the answer's calls (``server/tools.py``; one
    choice): the generation stops once the answer has them."""
    arrival = time.perf_counter()
    if not as_chunks:  # the Responses API's own chat requests keep their settings
        apply_request_defaults(req, state.config.http)
    lora = state.check_model(req.model)
    tools = plan_tools(req, state.tool_parser, max_tool_calls)
    images = await load_images(state, req.messages)
    seqs = await plan_off_loop(prompt_chars(req.messages), _plan, state, req, tools, lora, images)
    await compile_constraints(state, seqs, "tools" if tools and tools.constraint else constraint_field(req))
    ticket = state.generation.admit(len(seqs), submitted)
    state.metrics.observe_params(req.n, seqs[0].params.max_tokens)
    if state.config.http.log_requests:
        prompt = state.tokenizer.decode(seqs[0].prompt_token_ids, skip_special_tokens=False)
        log_request(logger, state.config.http, request_id, state.answer_model(lora), prompt, seqs[0].params)
    response_id = f"chatcmpl-{request_id}"
    choices = [_Choice() for _ in range(req.n)]  # a resumed stream runs only some (by index)
    usage = UsageTracker(1, req.n)
    producer = is_producer(seqs)
    if req.stream:
        chunks = _chunks(
            state, req, seqs, choices, usage, response_id, request_id, arrival, producer, ticket, tools
        )
        if as_chunks:
            return ChatChunks(chunks, ticket.close)
        return SSEResponse(_sse(chunks, len(seqs)), on_close=ticket.close, hold_start=True)

    def on_output(seq: SequenceRequest, out: RequestOutput) -> None:
        _delta(state, choices[seq.choice_index], req, out)
        usage.add(seq, out)

    role = answer_role(state, req)

    echoed = echoed_text(req, role)

    def message(c: _Choice) -> tuple[AssistantMessage, str | None]:
        text = "".join(c.texts)
        if tools is None and state.reasoning is None:
            return AssistantMessage(role=role, content=echoed + text), c.finish_reason
        if seqs[0].resume_token_ids and tools is None:
            # A resumed answer (a PD hand-off's decode worker): the reasoning split goes on from where
            # the resumed tokens left it, as a resumed stream's does; the caller has their text.
            reasoning, content = _resumed_split(state, seqs[0], text)
            return AssistantMessage(role=role, content=content, reasoning_content=reasoning), c.finish_reason
        reasoning, content, calls = shape_whole(text, tools, _splitter(state, seqs[0]))
        reason = tool_finish_reason(tools, bool(calls), c.finish_reason)
        if echoed:
            content = echoed + (content or "")
        return AssistantMessage(
            role=role, content=content, tool_calls=calls or None, reasoning_content=reasoning
        ), reason

    def build() -> ChatCompletionResponse:
        messages = [message(c) for c in choices]
        return ChatCompletionResponse(
            id=response_id,
            model=state.answer_model(lora),
            choices=[
                ChatChoice(
                    index=i,
                    message=messages[i][0],
                    logprobs=ChatLogprobs(content=c.logprobs) if req.logprobs else None,
                    finish_reason=messages[i][1],
                    stop_reason=c.stop_reason,
                    token_ids=list(c.token_ids) if req.return_token_ids else None,
                )
                for i, c in enumerate(choices)
            ],
            usage=usage.info(),
            prompt_logprobs=prompt_logprobs_out(
                state.tokenizer,
                seqs[0].prompt_token_ids,
                choices[0].prompt_entries or [],
                req.prompt_logprobs,
            )
            if req.prompt_logprobs is not None
            else None,
        )

    def deliver(result: ChatCompletionResponse) -> None:
        text = delivered_text(state, seqs[0], choices[0].token_ids)
        message = result.choices[0].message
        if tools is None and state.reasoning is None:
            message.content = text
            return
        # As a stream would have shown it so far: the consumer's shaper takes this text in (a
        # resumed stream's ``skip``) and sends what it held back with what follows.
        shaped = ChoiceShaper(tools, _splitter(state, seqs[0])).feed(text)
        message.content = shaped.content
        message.reasoning_content = shaped.reasoning or None

    return await answer_whole(state, seqs, request_id, arrival, ticket, receive, on_output, build, deliver)


@dataclasses.dataclass
class ChatChunks:
    """A chat stream as chunk models; raises what ``stream_errors`` turns into an error event.
    ``on_close`` must be called when it ends (it releases the request's admission)."""

    chunks: AsyncIterator[ChatCompletionChunk]
    on_close: Callable[[], None]


async def _sse(chunks: AsyncIterator[ChatCompletionChunk], num_choices: int) -> AsyncIterator[bytes]:
    """The chunks as SSE frames. The chunk that finishes the last of ``num_choices`` choices
    waits (briefly: the chunks end right after it) to leave with the usage chunk, [DONE] and the
    end of the body in one write."""
    unfinished = num_choices
    tail = b""
    produced = False
    try:
        async with stream_errors() as failed:
            async for c in chunks:
                produced = True
                unfinished -= sum(1 for choice in c.choices if choice.finish_reason is not None)
                frame = tail + sse_frame(c.model_dump_json())
                if unfinished > 0:
                    tail = b""
                    yield frame
                else:
                    tail = frame
        refused_before_start(failed, produced)
        yield FinalFrames(tail + (failed.frame or b"") + DONE_FRAME)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


async def _chunks(
    state: ServerState,
    req: ChatCompletionRequest,
    seqs: list[SequenceRequest],
    choices: list[_Choice],
    usage: UsageTracker,
    response_id: str,
    request_id: str,
    arrival: float,
    producer: bool,
    ticket: Ticket,
    tools: ToolPlan | None,
) -> AsyncIterator[ChatCompletionChunk]:
    created = int(time.time())
    model = state.answer_model(seqs[0].lora)
    shapers = None
    if tools is not None or state.reasoning is not None:
        shapers = {seq.choice_index: _shaper(state, seq, tools) for seq in seqs}
        for seq in seqs:
            if seq.resume_token_ids:  # a resumed stream: the client has this text already
                shapers[seq.choice_index].skip(delivered_text(state, seq, seq.resume_token_ids))

    continuous_usage = req.continuous_usage  # a property: read once, not per token

    def chunk(choice: ChatStreamChoice) -> ChatCompletionChunk:
        c = ChatCompletionChunk(id=response_id, created=created, model=model, choices=[choice])
        if continuous_usage:
            c.usage = usage.info()
        return c

    def roles() -> list[ChatCompletionChunk]:
        role = answer_role(state, req)
        opening = [
            chunk(ChatStreamChoice(index=seq.choice_index, delta=DeltaMessage(role=role, content="")))
            for seq in seqs
        ]
        echoed = echoed_text(req, role) if req.resume is None else ""  # a resumed client has it
        if echoed:
            opening += [
                chunk(ChatStreamChoice(index=seq.choice_index, delta=DeltaMessage(content=echoed)))
                for seq in seqs
            ]
        return opening

    # The role chunks go out with the first output, as vLLM sends them: the request reaches the
    # engine before its stream writes anything (SSEResponse's hold_start).
    opening = True
    # Closed when the loop ends, also by a break (a capped answer): that aborts the engine request now.
    async with contextlib.aclosing(state.generation.merged(request_id, seqs, arrival, ticket)) as outs:
        async for seq, out in outs:
            if opening:
                opening = False
                usage.see_prompt(seq.prompt_index, out)  # continuous usage: the role chunks count it
                for c in roles():
                    yield c
            choice = choices[seq.choice_index]
            text, logprobs = _delta(state, choice, req, out)
            usage.add(seq, out)
            delta = DeltaMessage(content=text or None)
            finish_reason = choice.finish_reason
            ended = out.finished
            capped = False
            token_ids = out.outputs[0].token_ids
            if shapers is not None:
                shaper = shapers[seq.choice_index]
                shaped = shaper.feed(text)
                # The answer has every tool call it may have (max_tool_calls): it ends with the token
                # that completed the last one (``server/chat_cap.py``), so no token is generated (nor
                # counted) for calls that would be dropped; what follows that token is not shown.
                capped = shaper.capped
                if capped and len(token_ids) > 1:
                    kept, shaped, shaper = cut_at_cap(
                        state.tokenizer,
                        seq,
                        lambda seq=seq: _shaper(state, seq, tools),
                        [*(seq.resume_token_ids or ()), *choice.token_ids[: -len(token_ids)]],
                        token_ids,
                    )
                    shapers[seq.choice_index] = shaper
                    dropped, token_ids = len(token_ids) - kept, token_ids[:kept]
                    if dropped:
                        del choice.token_ids[-dropped:]
                        usage.completion_tokens -= dropped
                        if logprobs is not None:
                            logprobs = logprobs[:kept]
                            del choice.logprobs[-dropped:]
                elif out.finished:
                    last = shaper.finish()
                    shaped.reasoning += last.reasoning
                    shaped.content += last.content
                    shaped.tool_calls += last.tool_calls
                if ended or capped:
                    reason = "stop" if capped else finish_reason
                    finish_reason = tool_finish_reason(tools, shaper.made_calls, reason)
                    ended = True
                text = shaped.content
                delta = DeltaMessage(
                    content=shaped.content or None,
                    reasoning_content=shaped.reasoning or None,
                    tool_calls=shaped.tool_calls or None,
                )
            if (
                not (text or delta.reasoning_content or delta.tool_calls)
                and not ended
                and not logprobs
                and not ((continuous_usage or req.return_token_ids) and token_ids)
            ):
                # Nothing a client could see (a held-back partial character): skip, unless it
                # follows token progress through continuous usage stats.
                continue
            if logprobs and not ended and not (text or delta.reasoning_content or delta.tool_calls):
                delta.content = ""  # a token with nothing to show yet (OpenAI's and vLLM's delta)
            c = chunk(
                ChatStreamChoice(
                    index=seq.choice_index,
                    delta=delta,
                    logprobs=ChatLogprobs(content=logprobs) if logprobs is not None else None,
                    finish_reason=finish_reason if ended else None,
                    stop_reason=choice.stop_reason if out.finished and not capped else None,
                    token_ids=list(token_ids) if req.return_token_ids else None,
                )
            )
            if producer and out.finished:
                c.kv_transfer = kv_transfer_result(state, out, seq)
            yield c
            if capped:
                choice.finish_reason, choice.stop_reason = finish_reason, None
                ticket.stopped = True  # the engine request's end is a stop, not a client's abort
                break
    if req.include_usage:
        final = ChatCompletionChunk(
            id=response_id, created=created, model=model, choices=[], usage=usage.info()
        )
        yield final
