"""Mid-stream failover for the Responses API: one response across replicas, as the client saw it begin.

The router asks the replica for each chunk's token ids (``return_token_ids``): the replica then
sends each chat chunk's events inside one ``ferry_chunk`` event with the chunk's token ids, and the
chunk that ends the answer inside the same group as the events that end the response
(``server/responses_stream.py``). So the router relays a token's text with its id, and the last
token with ``response.completed``, or nothing of either; the tracker unpacks the groups.

The tracker follows what the client has of the response, as the client assembles it: the
``response.created`` body and each output item with its text, logprobs or arguments so far. When
the replica dies part-way, the request goes to another replica with ``resume`` = the tokens sent,
those items and the response's ``created_at``. The resumed replica goes on from there: it opens no
second response (its id is the same: the replicas name a response after the request id, which the
router sends them all), continues the open item under its id and output index or closes it, and
ends with ``...done`` events and a ``response.completed`` that describe the whole answer (usage
included), which it also stores. The tracker renumbers ``sequence_number`` so that it increases
by one across the splice.

A stream that cannot be resumed ends as a replica ends one it cannot finish: the items the client
has open closed ``incomplete`` (their ``...done`` events), an ``error`` event and ``response.failed``
(the output the client has), never with corrupt output.

A replica that cannot finish (its engine process died) closes the open items, then sends an
``error`` event with code ``service_unavailable`` and ``response.failed``, all outside groups (a
grouping replica sends nothing else outside one once its first group is out). The tracker holds
such events until it sees what they lead to: that failure is resumed like a replica's death (the
held events dropped: the client's items stay open for the resumed replica to continue), or the held
events are relayed when it cannot be resumed; any other error ends the stream as the replica sent it.

The tracker is pure (events in, events out); ``router/generation.py`` runs it.
"""

from __future__ import annotations

import json
from typing import Any

from router.messages_stream import GROUP_EVENT, unpack_group
from router.sse import replica_failure, typed_event

# The events after which a Responses stream has nothing more to say.
_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})
# The ends of a response its replica stored (a foreground stream that failed is not stored).
_STORED = frozenset({"response.completed", "response.incomplete"})
_DELTAS = frozenset(
    {
        "response.output_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.function_call_arguments.delta",
    }
)


class ResponsesTracker:
    """The Responses API's counterpart of ``router.sse.StreamTracker`` (same attributes for the relay)."""

    # The answer's last token travels in the group that ends the response: a stream is never
    # finished without being done, so the relay never needs an end event of its own.
    END_EVENT = b""
    finished = False

    def __init__(self) -> None:
        self.router_logprobs = False  # never used here: the relay sets it per replica
        self.token_ids: list[int] = []  # output tokens already sent to the client
        self.ids_complete = True  # False once text came without ids: no exact resume
        self.saw_token_ids_field = False
        self.done = False  # the response's last event was sent
        # This replica's failure (its events from the items' closing to ``response.failed``), held
        # back: the relay resumes the stream elsewhere, or sends them (``failure_end``) when it cannot.
        self.replica_error: list[dict[str, Any]] | None = None
        self._held: list[dict[str, Any]] = []  # a grouping replica's events outside a group, until
        self.failovers = 0
        self.content_choices = 0  # deltas relayed so far (the first one: TTFT)
        self.response: dict[str, Any] | None = None  # as ``response.created`` gave it the client
        self.items: dict[int, dict[str, Any]] = {}  # the client's output items by output_index
        self.sent = 0  # events sent: the next one's sequence_number
        # The response as its completed / incomplete event gave it the client: what the replica
        # that finished it stored (router/response_affinity.py learns its items' ids from it).
        self.final: dict[str, Any] | None = None

    def begin_failover(self) -> None:
        self.failovers += 1
        self._held = []

    def resume_body(self, body: dict) -> dict:
        """The request for the next replica: the same, resumed after what the client has (from the
        start when it has not even the response's opening)."""
        if self.response is None:
            return dict(body)
        resume = {
            "token_ids": list(self.token_ids),
            "output": self.output(),
            "created_at": self.response.get("created_at"),
        }
        return {**body, "resume": resume}

    def output(self) -> list[dict[str, Any]]:
        return [self.items[i] for i in sorted(self.items)]

    def process(self, event: bytes) -> bytes | None:
        """The event(s) to send the client (without the trailing blank line), or None to drop it."""
        obj = typed_event(event)
        if obj is None:
            return event
        kind = obj["type"]
        if self.replica_error is not None:  # what follows the replica's failure: held with it
            self.replica_error.append(obj)
            return None
        if kind == "error" and replica_failure(obj):
            self.replica_error, self._held = [*self._held, obj], []
            return None
        if kind != GROUP_EVENT and kind != "error" and self.saw_token_ids_field and not self.done:
            self._held.append(obj)  # outside a group: the start of a failure's end, or of an error's
            return None
        held, self._held = self._held, []
        out = [self._one(e) for e in held]
        if kind != GROUP_EVENT:
            if kind in _DELTAS and obj.get("delta"):
                self.ids_complete = False  # a replica that does not group: its text has no ids
            out.append(self._one(obj))
        else:
            ids, events = unpack_group(obj, self.token_ids)
            self.saw_token_ids_field |= ids is not None
            out += [self._one(e) for e in events]
        return b"\n\n".join(out) if out else None

    def failure_end(self) -> bytes | None:
        """The replica's own end of a response it could not finish, when that cannot be resumed
        (None: it sent none)."""
        if self.replica_error is None:
            return None
        return b"".join(self._one(e) + b"\n\n" for e in self.replica_error)

    def error_event(self, message: str) -> bytes:
        """What ends a stream that cannot go on: the ``...done`` events of the items the client has
        open, which end ``incomplete`` (as a replica that fails part-way ends them,
        ``server/responses_stream.py``), an ``error`` event, then ``response.failed`` with the output
        the client has."""
        # Sent (followed) before ``response.failed`` is built: its output has the items closed.
        sent = [self._one(e) for e in self._closings()]
        sent.append(self._one({"type": "error", "code": "upstream_error", "message": message, "param": None}))
        if self.response is not None:
            failed = {
                **self.response,
                "status": "failed",
                "error": {"code": "server_error", "message": message},
                "output": self.output(),
            }
            sent.append(self._one({"type": "response.failed", "response": failed}))
        return b"".join(one + b"\n\n" for one in sent)

    def _closings(self) -> list[dict[str, Any]]:
        """The events that close each item still in progress as ``incomplete``, in output order:
        the replica's own (its text's, content part's or arguments' ``...done``, then the item's),
        from what the client has of it."""
        events: list[dict[str, Any]] = []
        for index in sorted(self.items):
            item = self.items[index]
            if item.get("status") != "in_progress":
                continue
            ids = {"item_id": item.get("id"), "output_index": index}
            kind = item.get("type")
            done = {**item, "status": "incomplete"}
            if kind == "function_call":
                arguments = item.get("arguments", "")
                events.append(
                    {
                        "type": "response.function_call_arguments.done",
                        **ids,
                        "name": item.get("name"),
                        "arguments": arguments,
                    }
                )
            elif kind == "message":
                content = item.get("content") or [_empty_text_part()]
                part = {**content[-1], "text": content[-1].get("text", "")}
                logprobs = part.get("logprobs", [])
                events.append(
                    {
                        "type": "response.output_text.done",
                        **ids,
                        "content_index": 0,
                        "text": part["text"],
                        "logprobs": logprobs,
                    }
                )
                events.append({"type": "response.content_part.done", **ids, "content_index": 0, "part": part})
                done["content"] = [part]
            elif kind == "reasoning" and "content" not in item:  # the thought as its summary
                parts = item.get("summary") or [{}]
                text = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
                part = {"type": "summary_text", "text": text}
                events.append(
                    {"type": "response.reasoning_summary_text.done", **ids, "summary_index": 0, "text": text}
                )
                events.append(
                    {
                        "type": "response.reasoning_summary_part.done",
                        **ids,
                        "summary_index": 0,
                        "part": part,
                        "status": "incomplete",
                    }
                )
                done["summary"] = [part]
            elif kind == "reasoning":
                text = "".join(p.get("text", "") for p in item.get("content") or () if isinstance(p, dict))
                events.append(
                    {"type": "response.reasoning_text.done", **ids, "content_index": 0, "text": text}
                )
                done["content"] = [{"type": "reasoning_text", "text": text}]
            events.append({"type": "response.output_item.done", "output_index": index, "item": done})
        return events

    def _one(self, obj: dict[str, Any]) -> bytes:
        """One event as the client gets it: followed, and numbered in the client's sequence."""
        kind = obj["type"]
        self._follow(kind, obj)
        obj["sequence_number"] = self.sent
        self.sent += 1
        return b"event: " + kind.encode() + b"\ndata: " + json.dumps(obj, ensure_ascii=False).encode()

    def _follow(self, kind: str, obj: dict[str, Any]) -> None:
        """Keep the client's view of the response up to date (what a resumed replica is given)."""
        if kind in _ENDS:
            self.done = True
            if kind in _STORED and isinstance(obj.get("response"), dict):
                self.final = obj["response"]
            return
        if kind == "response.created" and isinstance(obj.get("response"), dict):
            self.response = obj["response"]
            return
        index = obj.get("output_index")
        if kind == "response.output_item.added" and isinstance(obj.get("item"), dict):
            self.items[index] = obj["item"]
            return
        item = self.items.get(index) if isinstance(index, int) else None
        if item is None:
            return
        if kind == "response.output_item.done" and isinstance(obj.get("item"), dict):
            self.items[index] = obj["item"]
        elif kind == "response.content_part.added" and isinstance(obj.get("part"), dict):
            item.setdefault("content", []).append(obj["part"])
        elif kind == "response.reasoning_summary_part.added" and isinstance(obj.get("part"), dict):
            item.setdefault("summary", []).append(dict(obj["part"]))
        elif kind in _DELTAS and isinstance(obj.get("delta"), str):
            self.content_choices += 1
            if kind == "response.function_call_arguments.delta":
                item["arguments"] = item.get("arguments", "") + obj["delta"]
                return
            if kind == "response.reasoning_summary_text.delta":
                summary = item.setdefault("summary", [])
                if not summary:
                    summary.append({"type": "summary_text", "text": ""})
                summary[-1]["text"] = summary[-1].get("text", "") + obj["delta"]
                return
            content = item.setdefault("content", [])
            if not content:  # reasoning text comes without a content part of its own
                content.append({"type": "reasoning_text", "text": ""})
            part = content[-1]
            part["text"] = part.get("text", "") + obj["delta"]
            if isinstance(obj.get("logprobs"), list):
                part["logprobs"] = part.get("logprobs", []) + obj["logprobs"]


def _empty_text_part() -> dict[str, Any]:
    """A message's content part before its first text (``server.responses_stream.text_part``)."""
    return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
