"""A Responses API stream: chat chunks in, Responses events out (``POST /v1/responses``, ``stream``).

``events`` turns the chat stream's chunks (``ChatChunks``) into ``response.created`` (then, for a
background response, OpenAI's ``response.queued``), ``response.in_progress``,
``response.output_item.added``, ``response.output_text.delta``, ..., ``response.completed``, each
with its ``sequence_number``. The output items (``reasoning``, ``message``, ``function_call``) are
written by ``_Output`` in the order the model wrote them: text after a function call is a message
item after it, as OpenAI's output lists items. Each item is done before the next one is added, as
OpenAI streams them: a function call as soon as its arguments are complete (``_Output.feed``), not
when the answer ends, so a client can run it at once. A whole (non-streamed) answer is read from the
same chunks by the same ``_Output`` (``collect``), so it has the output a stream of it ends with.
A stream that fails part way (an engine error, ``--request-timeout``) ends with an ``error`` event
and ``response.failed`` (OpenAI's ``response.incomplete`` is for a cut answer only); the items the
failure cut off are done ``incomplete``, as a cut answer's are.

For a router that may resume the stream elsewhere (``router/responses_stream.py``), two internal
request fields change the stream, never its content:

* ``return_token_ids``: each chat chunk's events travel inside one ``ferry_chunk`` event with the
  chunk's token ids, and the chunk that ends the answer travels together with the events that end
  the response (the closing ``...done`` events and ``response.completed``), so a router relays a
  token's text with its id, and the last token with the end, or not at all.
* ``resume``: the client already has the response (its ``created_at``), the output items so far
  (``output``, the last ones possibly still in progress) and the text of ``token_ids``. The stream
  then opens no second response: the open message or reasoning item goes on when the resumed text
  is of its kind (same id and output index), else it is closed (the ``...done`` events the dead
  replica never sent) and the next item takes the next index; an open function call goes on (a
  resumed call comes without an id), a done one stays done. The ``...done`` events,
  ``response.completed`` and the stored response describe the whole answer, ``usage.output_tokens``
  the resumed tokens included.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from server.chat_protocol import ChatCompletionChunk, ChatStreamChoice
from server.protocol import random_id
from server.responses_protocol import wants_summary
from server.responses_store import event_frame
from server.serving_common import stream_errors
from server.serving_messages import GROUP_EVENT

if TYPE_CHECKING:
    from server.responses_object import _Response
    from server.responses_protocol import ResponsesRequest

Event = tuple[str, dict[str, Any]]  # kind, fields (the sequence number is added when framed)
# Events and the token ids of the chunk they came from (None: not from a chunk).
Unit = tuple[list[int] | None, list[Event]]


def reasoning_item(text: str, status: str = "completed", summary: bool = False) -> dict[str, Any]:
    """A reasoning item: the thought as its ``content`` (vLLM's ``reasoning_text``), or with
    ``summary`` (the request asked for ``reasoning.summary``) as its one ``summary_text`` part."""
    item: dict[str, Any] = {"type": "reasoning", "id": f"rs_{random_id()}"}
    if summary:
        item["summary"] = [{"type": "summary_text", "text": text}]
    else:
        item["summary"] = []
        item["content"] = [{"type": "reasoning_text", "text": text}]
    item["status"] = status
    return item


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An ``output_text`` content part; ``logprobs`` as OpenAI gives them (empty unless the request
    included ``message.output_text.logprobs``)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(
    text: str, status: str = "completed", logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    content = [text_part(text, logprobs)] if status == "completed" else []
    return {
        "type": "message",
        "id": f"msg_{random_id()}",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{random_id()}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


# A chat delta's text fields, the output item each goes to, and its Responses event.
_TEXT_DELTAS = (
    ("reasoning_content", "reasoning", "response.reasoning_text.delta"),
    ("content", "message", "response.output_text.delta"),
)


def calls_come_whole(req: ResponsesRequest) -> bool:
    """Whether the chat stream sends each function call whole: its id, name and complete arguments
    in one delta, as the tool-call parser (``auto``) or the ``required`` array releases a call once it
    is complete (``server/tools.py``). A named function's arguments stream as they are generated:
    that call is complete only when something follows it or the answer ends."""
    return bool(req.tools) and not isinstance(req.tool_choice, dict)


class _Output:
    """The response's output as it is written: closed items in ``built.output``, one open message or
    reasoning item, and the open function calls. Each item's ``output_index`` is its place among the
    items added, which is the order of the final output (text after a call comes after it).

    A function call is done once its arguments are complete: at once when calls come whole
    (``calls_come_whole``), else when a later call or text starts (the model has moved on) or the
    answer ends; never before, so no argument text comes after its call's ``...done`` events."""

    def __init__(self, built: _Response, want_logprobs: bool) -> None:
        self.built = built
        self.want_logprobs = want_logprobs
        self.whole_calls = calls_come_whole(built.req)
        self.open_item: dict[str, Any] | None = None
        # The open item's text and the open calls' arguments (by chat tool call index) as the
        # pieces they came in, joined once when the item is done: appending to one string per delta
        # copies it each time, quadratic in a long streamed text or call.
        self.pieces: list[str] = []
        self.arguments: dict[int, list[str]] = {}
        self.logprobs: list[dict[str, Any]] = []  # the open message's, as sent with its deltas
        self.pending: list[dict[str, Any]] = []  # arrived with no text yet (a held-back partial character)
        # The open function calls: a chat tool call's index -> its item (+ output_index).
        self.calls: dict[int, dict[str, Any]] = {}
        self.added = 0  # items added so far: the next one's output_index
        self.open_index = 0  # the open item's
        self.index_of: dict[str, int] = {}  # a closed item's id -> its output_index
        req = built.req
        self.summary = wants_summary(req)  # the thought as the reasoning item's summary
        self.shows_reasoning = req.include_reasoning  # vLLM's include_reasoning: false, no item
        # usage.output_tokens_details.reasoning_tokens is counted from the answer's token ids, the
        # resumed ones first (the chat request always returns them): ``server/reasoning_tokens.py``.
        resume = req.resume
        self.token_ids: list[int] = list(resume.token_ids or []) if resume is not None else []

    def seed(self, items: list[dict[str, Any]]) -> None:
        """Take over the output a client already has (a resumed stream)."""
        self.added = len(items)
        calls = 0  # the chat stream numbers the calls from the first, done or not
        for position, item in enumerate(items):
            if item.get("type") == "function_call":
                if item.get("status") == "completed":
                    self._closed(item, position)
                else:
                    self.calls[calls] = {**item, "output_index": position}
                    self.arguments[calls] = [item.get("arguments", "")]
                calls += 1
            elif item.get("status") == "in_progress" and item.get("type") in ("message", "reasoning"):
                part = (item.get("content") or item.get("summary") or [{}])[0]
                self.open_item = {**item, "content": []} if item.get("type") == "message" else item
                self.pieces = [part.get("text", "")]
                self.logprobs = list(part.get("logprobs") or [])
                self.open_index = position
            else:
                self._closed(item, position)

    def _closed(self, item: dict[str, Any], index: int) -> None:
        self.built.output.append(item)
        self.index_of[item["id"]] = index

    def _add(self) -> int:
        self.added += 1
        return self.added - 1

    def ordered(self) -> None:
        """Put the closed items in ``output_index`` order (calls still open at the end close last)."""
        self.built.output.sort(key=lambda item: self.index_of[item["id"]])

    def close_calls(self, status: str = "completed") -> list[Event]:
        """The events that close the open function calls (their arguments are complete, unless the
        answer was cut: ``status`` ``incomplete``)."""
        out: list[Event] = []
        for position, call in self.calls.items():
            index = call.pop("output_index")
            call["arguments"] = "".join(self.arguments.pop(position, ()))
            done = {**call, "status": status}
            fields = {
                "item_id": call["id"],
                "output_index": index,
                "name": call["name"],  # OpenAI's event names the function
                "arguments": call["arguments"],
            }
            out.append(("response.function_call_arguments.done", fields))
            out.append(("response.output_item.done", {"output_index": index, "item": done}))
            self._closed(done, index)
        self.calls, self.arguments = {}, {}
        return out

    def close_open(self, status: str = "completed") -> list[Event]:
        item = self.open_item
        if item is None:
            return []
        index = self.open_index
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        text = "".join(self.pieces)
        if item["type"] == "message":
            self.pending = []  # tokens that never showed text (the first bytes of a character cut off)
            part = text_part(text, self.logprobs)
            out: list[Event] = [
                ("response.output_text.done", {**ids, "text": text, "logprobs": self.logprobs}),
                ("response.content_part.done", {**ids, "part": part}),
            ]
            done = {**item, "status": status, "content": [part]}
        elif self.summary:
            summary = {k: v for k, v in ids.items() if k != "content_index"} | {"summary_index": 0}
            part = {"type": "summary_text", "text": text}
            cut = {"status": "incomplete"} if status == "incomplete" else {}
            out = [
                ("response.reasoning_summary_text.done", {**summary, "text": text}),
                ("response.reasoning_summary_part.done", {**summary, "part": part, **cut}),
            ]
            done = {**reasoning_item(text, status, summary=True), "id": item["id"]}
        else:
            out = [("response.reasoning_text.done", {**ids, "text": text})]
            done = {**reasoning_item(text, status), "id": item["id"]}
        out.append(("response.output_item.done", {"output_index": index, "item": done}))
        self._closed(done, index)
        self.open_item, self.pieces, self.logprobs = None, [], []
        return out

    def start(self, kind: str) -> list[Event]:
        out = self.close_open()
        index = self.open_index = self._add()
        if kind == "message":
            item = message_item("", status="in_progress")
            out.append(("response.output_item.added", {"output_index": index, "item": item}))
            part = {"item_id": item["id"], "output_index": index, "content_index": 0, "part": text_part("")}
            out.append(("response.content_part.added", part))
        else:
            item = {**reasoning_item("", status="in_progress"), "content": []}
            if self.summary:  # OpenAI's: the summary part is added before its text
                item = {**reasoning_item("", status="in_progress", summary=True), "summary": []}
            out.append(("response.output_item.added", {"output_index": index, "item": item}))
            if self.summary:
                part = {"type": "summary_text", "text": ""}
                ids = {"item_id": item["id"], "output_index": index, "summary_index": 0}
                out.append(("response.reasoning_summary_part.added", {**ids, "part": part}))
        self.open_item = item
        return out

    def feed(self, choice: ChatStreamChoice) -> list[Event]:
        """The events of one chat choice delta."""
        out: list[Event] = []
        delta = choice.delta
        if self.want_logprobs:
            # The tokens of this delta's content (``server/text_logprobs.py``): no call markup, no
            # thought, and text held back before comes with its own tokens; a chunk that does not
            # name them (not a chat stream's) has only content.
            shown = choice.text_logprobs
            if shown is None and choice.logprobs is not None:
                shown = choice.logprobs.content
            self.pending += [t.model_dump() for t in shown or ()]
        if choice.token_ids is not None:
            self.token_ids += choice.token_ids
        for field, kind, name in _TEXT_DELTAS:
            piece = getattr(delta, field)
            if not piece or (kind == "reasoning" and not self.shows_reasoning):
                continue
            out += self.close_calls()  # text after a call: the model has moved on
            if self.open_item is None or self.open_item["type"] != kind:
                out += self.start(kind)
            self.pieces.append(piece)
            extra: dict[str, Any] = {}
            if kind == "message":  # a text delta carries its tokens' logprobs
                extra["logprobs"], self.pending = self.pending, []
                self.logprobs += extra["logprobs"]
            ids = {
                "item_id": self.open_item["id"],
                "output_index": self.open_index,
                "content_index": 0,
            }
            if kind == "reasoning" and self.summary:
                name = "response.reasoning_summary_text.delta"
                ids = {**ids, "summary_index": 0}
                del ids["content_index"]
            out.append((name, {**ids, "delta": piece, **extra}))
        for tc in delta.tool_calls or []:
            out += self.close_open()
            call = self.calls.get(tc.index)
            if call is None:
                out += self.close_calls()  # a later call: the earlier ones are complete
                call = call_item(tc.id or "", tc.function.name or "", "", status="in_progress")
                call["output_index"] = self._add()
                self.calls[tc.index] = call
                self.arguments[tc.index] = []
                item = {k: v for k, v in call.items() if k != "output_index"}
                out.append(
                    ("response.output_item.added", {"output_index": call["output_index"], "item": item})
                )
            if tc.function.arguments:
                self.arguments[tc.index].append(tc.function.arguments)
                fields = {"item_id": call["id"], "output_index": call["output_index"]}
                out.append(
                    ("response.function_call_arguments.delta", {**fields, "delta": tc.function.arguments})
                )
            if self.whole_calls:
                out += self.close_calls()
        return out

    def counted(self) -> int:
        """``usage.output_tokens_details.reasoning_tokens``: a function of the answer's token ids."""
        count = self.built.count_reasoning
        return count(self.token_ids) if count is not None else 0

    def finish(self, cut: bool = False) -> list[Event]:
        """The events that close every item (an empty answer still has its message). ``cut``: the
        answer ended before the model did (``max_output_tokens``, a cancel), so the items still open
        are ``incomplete``, as OpenAI marks the item a cut-off response ends in; items done before
        stay ``completed``."""
        status = "incomplete" if cut else "completed"
        out = self.close_open(status)
        if not self.built.output and not self.calls:
            out += self.start("message") + self.close_open(status)
        out += self.close_calls(status)
        self.ordered()
        return out


async def events(
    built: _Response,
    chunks: AsyncIterator[ChatCompletionChunk],
    save: Callable[[], Awaitable[None]],
    *,
    want_logprobs: bool,
    grouped: bool = False,
    resumed: list[dict[str, Any]] | None = None,
) -> AsyncIterator[bytes]:
    """The chat stream's chunks as Responses events (``grouped``: each chunk's inside one
    ``GROUP_EVENT``); ``resumed``: the output items the client already has. Closing this closes the
    chat stream at once (its cleanup aborts the request in the engine), not whenever it is
    garbage-collected."""
    seq = -1

    def next_seq() -> int:
        nonlocal seq
        seq += 1
        return seq

    try:
        async for ids, unit in _translate(built, chunks, save, want_logprobs, resumed):
            if grouped and ids is not None:
                grouped_events = [{"type": k, "sequence_number": next_seq(), **f} for k, f in unit]
                group = {"type": GROUP_EVENT, "token_ids": ids, "events": grouped_events}
                yield f"event: {GROUP_EVENT}\ndata: {json.dumps(group, ensure_ascii=False)}\n\n".encode()
                continue
            for kind, fields in unit:
                yield event_frame(kind, next_seq(), **fields)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


async def collect(
    built: _Response,
    chunks: AsyncIterator[ChatCompletionChunk],
    save: Callable[[], Awaitable[None]],
    *,
    want_logprobs: bool,
) -> None:
    """A whole answer: the chat stream's chunks written into ``built`` (output, usage, status) as
    ``events`` writes them, then saved. An error raises (nothing is saved); closing the chunks at the
    end, or when cancelled, aborts the request in the engine."""
    output = _Output(built, want_logprobs)
    finish_reason = None
    try:
        async for chunk in chunks:
            if chunk.usage is not None and not chunk.choices:
                built.set_usage(chunk.usage.model_dump(), output.counted())
            for choice in chunk.choices:
                output.feed(choice)
                finish_reason = choice.finish_reason or finish_reason
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    built.finish(finish_reason)
    output.finish(cut=built.status != "completed")
    await save()


async def _translate(
    built: _Response,
    chunks: AsyncIterator[ChatCompletionChunk],
    save: Callable[[], Awaitable[None]],
    want_logprobs: bool,
    resumed: list[dict[str, Any]] | None,
) -> AsyncIterator[Unit]:
    output = _Output(built, want_logprobs)
    if resumed is not None:
        output.seed(resumed)
    else:
        opening: list[Event] = [("response.created", {"response": built.body()})]
        if built.status == "queued":  # a background response: OpenAI says so before it runs
            opening.append(("response.queued", {"response": built.body()}))
        yield None, opening
        built.status = "in_progress"
        yield None, [("response.in_progress", {"response": built.body()})]
    finish_reason = None
    last: Unit = ([], [])  # the chunk that ends the answer: it goes out with the response's end
    async with stream_errors() as failed:
        async for chunk in chunks:
            if chunk.usage is not None and not chunk.choices:
                built.set_usage(chunk.usage.model_dump(), output.counted())
                continue
            ids: list[int] = []
            out: list[Event] = []
            for choice in chunk.choices:
                ids += choice.token_ids or []
                out += output.feed(choice)
                finish_reason = choice.finish_reason or finish_reason
            if any(choice.finish_reason is not None for choice in chunk.choices):
                last = (ids, out)
            elif out or ids:
                yield ids, out
    if failed.error is not None:
        err = failed.error
        # The items the failure cut off are incomplete, as a cut answer's are (``finish``), its
        # function calls too (their arguments may be partial JSON); items done before it stay
        # completed. The response failed: no empty message is added for it.
        end = last[1] + output.close_open("incomplete") + output.close_calls("incomplete")
        output.ordered()
        end.append(("error", {"code": err.code, "message": err.message, "param": err.param}))
        built.status, built.error = "failed", {"code": err.code or "server_error", "message": err.message}
        await save()  # a background response's record says how it ended
        end.append(("response.failed", {"response": built.body()}))
        yield None, end
        return
    built.finish(finish_reason)
    end = last[1] + output.finish(cut=built.status != "completed")
    await save()  # before the last event: a client that continues the chain at once finds it
    # "response.cancelled" (a cancelled background response) is ferry's: OpenAI names no event for it.
    end.append((f"response.{built.status}", {"response": built.body()}))
    yield last[0], end
