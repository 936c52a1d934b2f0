"""POST /v1/chat/completions: messages through the model's chat template, n choices, streamed or not.

The request's sequences are planned off the event loop (``server/chat_plan.py``); a whole answer
is built here, a stream's chunks by ``server/chat_stream.py`` (OpenAI's chunk order, framed as SSE
here or handed unframed to the Responses API as ``ChatChunks``). Both read each choice's outputs
through ``server/chat_choice.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from engine.outputs import RequestOutput
from server.chat_choice import ChoiceState, add_output, answer_role, echoed_text, resumed_split, splitter
from server.chat_plan import plan_chat
from server.chat_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
)
from server.chat_shape import ChoiceShaper, shape_whole
from server.chat_stream import ChatChunks, sse_frames, stream_chunks
from server.images import load_images
from server.logprobs import prompt_logprobs_out
from server.sequence_request import SequenceRequest
from server.serving_common import (
    UsageTracker,
    answer_whole,
    compile_constraints,
    constraint_field,
    delivered_text,
    is_producer,
    plan_off_loop,
    prompt_chars,
    shown_prompt_ids,
)
from server.state import ServerState
from server.streaming import SSEResponse
from server.tools import plan_tools, tool_finish_reason
from server.vllm_flags import apply_request_defaults, log_request

logger = logging.getLogger("ferry.server")


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
    await state.resolve_model(req.model)  # a LoRA adapter of --lora-resolver-dir, loaded on first use
    lora = state.check_model(req.model)
    tools = plan_tools(req, state.tool_parser, max_tool_calls)
    images = await load_images(state, req.messages)
    seqs = await plan_off_loop(prompt_chars(req.messages), plan_chat, state, req, tools, lora, images)
    await compile_constraints(state, seqs, "tools" if tools and tools.constraint else constraint_field(req))
    ticket = state.generation.admit(len(seqs), submitted)
    state.metrics.observe_params(req.n, seqs[0].params.max_tokens)
    if state.config.http.log_requests:
        prompt = state.tokenizer.decode(seqs[0].prompt_token_ids, skip_special_tokens=False)
        log_request(logger, state.config.http, request_id, state.answer_model(lora), prompt, seqs[0].params)
    response_id = f"chatcmpl-{request_id}"
    choices = [ChoiceState() for _ in range(req.n)]  # a resumed stream runs only some (by index)
    usage = UsageTracker(1, req.n)
    producer = is_producer(seqs)
    if req.stream:
        chunks = stream_chunks(
            state, req, seqs, choices, usage, response_id, request_id, arrival, producer, ticket, tools
        )
        if as_chunks:
            opens = splitter(state, seqs[0])
            thinking_open = opens is not None and opens.marker_tokens and not opens.requires_start
            return ChatChunks(chunks, ticket.close, thinking_open)
        return SSEResponse(sse_frames(chunks, len(seqs)), on_close=ticket.close, hold_start=True)

    def on_output(seq: SequenceRequest, out: RequestOutput) -> None:
        add_output(state, choices[seq.choice_index], req, out)
        usage.add(seq, out)

    role = answer_role(state, req)

    echoed = echoed_text(req, role)

    shown = req.include_reasoning  # vLLM's include_reasoning: false leaves the thinking out

    def message(c: ChoiceState) -> tuple[AssistantMessage, str | None]:
        text = "".join(c.texts)
        if tools is None and state.reasoning is None:
            return AssistantMessage(role=role, content=echoed + text), c.finish_reason
        if seqs[0].resume_token_ids and tools is None:
            # A resumed answer (a PD hand-off's decode worker): the reasoning split goes on from where
            # the resumed tokens left it, as a resumed stream's does; the caller has their text.
            reasoning, content = resumed_split(state, seqs[0], text)
            reasoning = reasoning if shown else None
            return AssistantMessage(
                role=role, content=content, reasoning=reasoning, reasoning_content=reasoning
            ), c.finish_reason
        reasoning, content, calls = shape_whole(text, tools, splitter(state, seqs[0]))
        reasoning = reasoning if shown else None
        reason = tool_finish_reason(tools, bool(calls), c.finish_reason)
        if echoed:
            content = echoed + (content or "")
        return AssistantMessage(
            role=role,
            content=content,
            tool_calls=calls or None,
            reasoning=reasoning,
            reasoning_content=reasoning,
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
            prompt_token_ids=shown_prompt_ids(req.return_token_ids, seqs[0].prompt_token_ids),
            prompt_text=seqs[0].prompt_text,
        )

    def deliver(result: ChatCompletionResponse) -> None:
        text = delivered_text(state, seqs[0], choices[0].token_ids)
        message = result.choices[0].message
        if tools is None and state.reasoning is None:
            message.content = text
            return
        # As a stream would have shown it so far: the consumer's shaper takes this text in (a
        # resumed stream's ``skip``) and sends what it held back with what follows.
        shaped = ChoiceShaper(tools, splitter(state, seqs[0])).feed(text)
        message.content = shaped.content
        message.reasoning = message.reasoning_content = (shaped.reasoning if shown else None) or None

    return await answer_whole(state, seqs, request_id, arrival, ticket, receive, on_output, build, deliver)
