"""A streamed chat answer: the engine's outputs as ``ChatCompletionChunk`` models, then as SSE frames.

The chunks follow OpenAI's order: a role chunk per choice first (with the first output), then
content deltas, the finish reason on the choice's last chunk, a usage chunk with empty ``choices``
when ``stream_options.include_usage`` is set; the frames end with ``data: [DONE]``. The Responses
and Messages APIs take the chunk models unframed (``ChatChunks``) and translate them.

Split from ``server/serving_chat.py`` (which plans the request and answers whole ones); a choice's
state and shaping are ``server/chat_choice.py``'s, shared with the whole answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable

from server.admission_ticket import Ticket
from server.chat_cap import cut_at_cap
from server.chat_choice import ChoiceState, add_output, answer_role, echoed_text, new_shaper
from server.chat_protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
)
from server.sequence_request import SequenceRequest
from server.serving_common import (
    UsageTracker,
    delivered_text,
    kv_transfer_result,
    refused_before_start,
    shown_prompt_ids,
    stream_errors,
)
from server.state import ServerState
from server.streaming import DONE_FRAME, FinalFrames, sse_frame
from server.text_logprobs import TextLogprobs
from server.token_deltas import ended_by_token, one_token_each
from server.tools import ToolPlan, tool_finish_reason


@dataclasses.dataclass
class ChatChunks:
    """A chat stream as chunk models; raises what ``stream_errors`` turns into an error event.
    ``on_close`` must be called when it ends (it releases the request's admission)."""

    chunks: AsyncIterator[ChatCompletionChunk]
    on_close: Callable[[], None]
    # The prompt opened the thought (a ``<think>`` reasoning parser's answer starts inside it): what
    # the Responses API's reasoning_tokens count starts from (``server/reasoning_tokens.py``).
    thinking_open: bool = False


async def sse_frames(chunks: AsyncIterator[ChatCompletionChunk], num_choices: int) -> AsyncIterator[bytes]:
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
                if c.continued:  # its output's next chunk follows at once: one write for both
                    tail = frame
                    continue
                if unfinished > 0:
                    tail = b""
                    yield frame
                else:
                    tail = frame
        refused_before_start(failed, produced)
        yield FinalFrames(tail + (failed.frame or b"") + DONE_FRAME)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


async def stream_chunks(
    state: ServerState,
    req: ChatCompletionRequest,
    seqs: list[SequenceRequest],
    choices: list[ChoiceState],
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
    ledgers: dict[int, TextLogprobs] = {}  # which tokens' logprobs go with the content
    if tools is not None or state.reasoning is not None:
        shapers = {seq.choice_index: new_shaper(state, seq, tools) for seq in seqs}
        for seq in seqs:
            shaper = shapers[seq.choice_index]
            skipped = ""
            if seq.resume_token_ids:  # a resumed stream: the client has this text already
                skipped = delivered_text(state, seq, seq.resume_token_ids)
                shaper.skip(skipped)
            if req.logprobs:
                ledgers[seq.choice_index] = TextLogprobs(skipped, shaper.held)

    continuous_usage = req.continuous_usage  # a property: read once, not per token
    shows_reasoning = req.include_reasoning  # vLLM's: false leaves the thinking out of the deltas

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
        # vLLM's: the prompt (ids, template text) rides on each choice's role chunk, asked for only
        prompt_ids, prompt_text = (
            shown_prompt_ids(req.return_token_ids, seqs[0].prompt_token_ids),
            seqs[0].prompt_text,
        )
        for c in opening:
            c.prompt_token_ids, c.prompt_text = prompt_ids, prompt_text
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
    merged = state.generation.merged(request_id, seqs, arrival, ticket)
    if shapers is not None and req.logprobs:
        # Each token's logprob goes with its own text (reasoning, content or a call), however many
        # tokens a delta holds: the chunks are a token's each, as read as fast as they came.
        merged = one_token_each(state.tokenizer, seqs, merged)
    # Closed when the loop ends, also by a break (a capped answer): that aborts the engine request now.
    async with contextlib.aclosing(merged) as outs:
        async for seq, out in outs:
            if opening:
                opening = False
                usage.see_prompt(seq.prompt_index, out)  # continuous usage: the role chunks count it
                for c in roles():
                    yield c
            choice = choices[seq.choice_index]
            text, logprobs = add_output(state, choice, req, out)
            usage.add(seq, out)
            delta = DeltaMessage(content=text or None)
            shown = None  # each step's content's tokens' logprobs
            if logprobs is not None and shapers is None:  # every token's text is content ...
                ender = ended_by_token(out) and not seq.params.include_stop_str_in_output
                shown = [logprobs[:-1] if ender else logprobs]  # ... but the ending one's (EOS)
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
                        lambda seq=seq: new_shaper(state, seq, tools),
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
                    shaped = shaped.then(shaper.finish())
                if ended or capped:
                    reason = "stop" if capped else finish_reason
                    finish_reason = tool_finish_reason(tools, shaper.made_calls, reason)
                    ended = True
                # Text that follows a call in this delta goes in a chunk after the call's, so a
                # client (the Responses stream's items) sees the order the model wrote them in.
                # Reasoning that follows content (harmony's channels) likewise.
                steps = shaped.steps()
                if ledgers:
                    ledger = ledgers[seq.choice_index]
                    shown = ledger.step(text, logprobs or [], steps, shaper.held, ended)
                *earlier, (reasoning, text, calls) = steps
                for step, (thought, content, done) in enumerate(earlier):
                    thought = (thought if shows_reasoning else None) or None
                    if not (thought or content or done):
                        continue  # only reasoning, left out (include_reasoning false)
                    piece = DeltaMessage(
                        content=content or None,
                        reasoning=thought,
                        reasoning_content=thought,
                        tool_calls=done or None,
                    )
                    early = chunk(
                        ChatStreamChoice(
                            index=seq.choice_index,
                            delta=piece,
                            text_logprobs=shown[step] if shown else None,
                        )
                    )
                    early.continued = True
                    yield early
                reasoning = (reasoning if shows_reasoning else None) or None
                delta = DeltaMessage(
                    content=text or None,
                    reasoning=reasoning,
                    reasoning_content=reasoning,
                    tool_calls=calls or None,
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
                    text_logprobs=shown[-1] if shown else None,
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
