"""Mid-stream failover for the Messages API: Anthropic's events kept whole across replicas.

The router asks the replica for each chunk's token ids (``return_token_ids``): the replica then
sends each chat chunk's content events inside one ``ferry_chunk`` event with the chunk's token
ids, so the router relays a chunk's text together with its ids or not at all (a replica that dies
between two events of a chunk cannot leave text sent whose ids the router lacks). The router
unpacks the group into Anthropic's events. When the replica dies part-way, the request goes to
another replica with ``resume.token_ids`` = the tokens already sent, and its events are spliced in:

* its ``message_start`` is dropped when the client has one (a replica that died while the request
  waited may have sent only ``ping`` keep-alives: the resumed replica's then opens the message);
* its first content block continues the client's open block when it is of the same kind (a
  resumed tool call comes without an id: the call goes on); its ``content_block_start`` is then
  dropped and its index mapped to the open block's. Otherwise the open block is closed (a
  ``content_block_stop`` the dead replica never sent) and the new block takes the next index;
* every later block index is mapped onto the client's numbering;
* the final ``message_delta`` reports the whole answer's ``output_tokens``, and the input counts
  of the ``message_start`` the client got (not the resumed replica's own cache hits).

A replica that cannot finish (its engine process died) ends its stream with an ``error`` event of
type ``overloaded_error`` (its 503): the tracker holds it back and the stream is resumed as if the
replica had died; other errors (the client's, a 500) end the stream as they are.

``anthropic_errors`` puts the router's own error answers on these routes (401, 413, 429, 502…) in
Anthropic's shape and statuses, as the replicas answer theirs: its capacity answers (429: its queue
is full; 503: no replica can take the request) are Anthropic's 529 ``overloaded_error``
(``server.anthropic_protocol.anthropic_status``), Retry-After kept. A replica's own 529 is retried
on another replica as its 429 is (``router/retry.py``), and relayed as it is when none can take it.

The tracker is pure (events in, events out); ``router/generation.py`` runs it.
"""

from __future__ import annotations

import json
from typing import Any

from router.http import Send
from router.sse import typed_event
from server.anthropic_protocol import ERROR_TYPES, anthropic_status, error_details, error_type

# server/serving_messages.py's GROUP_EVENT (the router does not import the serving code).
GROUP_EVENT = "ferry_chunk"
# The error type of a replica's 503 in Anthropic's shape: it could not finish (router/sse.py).
_REPLICA_FAILURE_TYPE = ERROR_TYPES[503]
# The input counts a replica's message_delta repeats (cumulative, as Anthropic's).
_INPUT_USAGE = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")


def unpack_group(obj: dict[str, Any], token_ids: list[int]) -> tuple[list | None, list[dict[str, Any]]]:
    """A ``GROUP_EVENT``'s token ids (None when it has none: not a replica that honours
    ``return_token_ids``), added to ``token_ids``, and its events."""
    ids = obj.get("token_ids")
    if isinstance(ids, list):
        token_ids.extend(i for i in ids if isinstance(i, int))
    else:
        ids = None
    events = obj.get("events")
    events = (
        [e for e in events if isinstance(e, dict) and isinstance(e.get("type"), str)]
        if isinstance(events, list)
        else []
    )
    return ids, events


def _event(kind: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + json.dumps(obj, ensure_ascii=False).encode()


class MessagesTracker:
    """The Messages API's counterpart of ``router.sse.StreamTracker`` (same attributes for the relay)."""

    END_EVENT = b'event: message_stop\ndata: {"type": "message_stop"}\n\n'

    def __init__(self, *, client_wants_token_ids: bool = False, resumed: list[int] | None = None) -> None:
        self.keep_ids = client_wants_token_ids
        self.resumed = list(resumed or [])  # the client's own resume.token_ids (as StreamTracker's)
        self.router_logprobs = False  # never used here: the relay sets it per replica
        self.token_ids: list[int] = []  # output tokens already sent to the client
        self.ids_complete = True  # False once content came without ids: no exact resume
        self.saw_token_ids_field = False
        self.finished = False  # the stop reason was sent (message_delta)
        self.done = False  # message_stop (or the replica's own error event) was sent
        self.replica_error: bytes | None = None  # the replica's "could not finish", held back
        self.failovers = 0
        self.content_choices = 0  # content deltas relayed so far (the first one: TTFT)
        self.message_started = False  # message_start was relayed
        self.start_usage: dict[str, Any] = {}  # the relayed message_start's usage
        self.open_block: tuple[int, str] | None = None  # the client's open block: index, kind
        self.next_index = 0  # the client's next block index
        self._index_map: dict[int, int] = {}  # this replica's block index -> the client's
        self._continuing = False  # after a failover, before the resumed replica's first block

    def begin_failover(self) -> None:
        self.failovers += 1
        self._index_map = {}
        self._continuing = True

    def resume_body(self, body: dict) -> dict:
        out = dict(body)
        if self.token_ids:
            out["resume"] = {"token_ids": [*self.resumed, *self.token_ids]}
        return out

    def failure_end(self) -> bytes | None:
        """The replica's own error event, when its failure cannot be resumed (None: it sent none)."""
        return None if self.replica_error is None else self.replica_error + b"\n\n"

    def process(self, event: bytes) -> bytes | None:
        """The event(s) to send the client (without the trailing blank line), or None to drop it."""
        obj = typed_event(event)
        if obj is None:
            return event
        if obj["type"] == "error" and not self.finished:
            error = obj.get("error")
            if isinstance(error, dict) and error.get("type") == _REPLICA_FAILURE_TYPE:
                self.replica_error = event
                return None
        if obj["type"] != GROUP_EVENT:
            if obj["type"] == "content_block_delta" and self._has_content(obj):
                self.ids_complete = False  # a replica that does not group: its text has no ids
            return self._one(obj)
        ids, events = unpack_group(obj, self.token_ids)
        self.saw_token_ids_field |= ids is not None
        out = [e for e in map(self._one, events) if e is not None]
        if self.keep_ids and isinstance(ids, list):
            out.append(_event("ping", {"type": "ping", "token_ids": ids}))
        return b"\n\n".join(out) if out else None

    @staticmethod
    def _has_content(obj: dict) -> bool:
        delta = obj.get("delta") if isinstance(obj.get("delta"), dict) else {}
        return any(delta.get(k) for k in ("text", "thinking", "partial_json"))

    def _one(self, obj: dict[str, Any]) -> bytes | None:
        """One Anthropic event, renumbered onto the client's blocks (None: dropped)."""
        kind = obj["type"]
        prefix: list[bytes] = []
        if kind == "message_start":
            if self.message_started:  # a resumed replica's: the client has one
                return None
            self.message_started = True
            message = obj.get("message") if isinstance(obj.get("message"), dict) else {}
            self.start_usage = message.get("usage") if isinstance(message.get("usage"), dict) else {}
        elif kind == "content_block_start":
            index = obj.get("index")
            block = obj.get("content_block") if isinstance(obj.get("content_block"), dict) else {}
            block_kind = block.get("type")
            continuing, self._continuing = self._continuing, False
            if (
                continuing
                and self.open_block is not None
                and self.open_block[1] == block_kind
                and not (block_kind == "tool_use" and block.get("id"))
            ):
                self._index_map[index] = self.open_block[0]
                return None
            if self.open_block is not None:  # the dead replica never closed it
                stop = {"type": "content_block_stop", "index": self.open_block[0]}
                prefix.append(_event("content_block_stop", stop))
            self._index_map[index] = self.next_index
            self.open_block = (self.next_index, str(block_kind))
            self.next_index += 1
            obj["index"] = self._index_map[index]
        elif kind == "content_block_delta":
            obj["index"] = self._index_map.get(obj.get("index"), obj.get("index"))
            if self._has_content(obj):
                self.content_choices += 1
        elif kind == "content_block_stop":
            index = self._index_map.get(obj.get("index"), obj.get("index"))
            obj["index"] = index
            if self.open_block is not None and self.open_block[0] == index:
                self.open_block = None
        elif kind == "message_delta":
            self.finished = True
            usage = obj.get("usage")
            if self.failovers and isinstance(usage, dict):
                # The input counts stay the ones message_start told the client (the resumed
                # replica's prefix cache held another part of the prompt); the output is the
                # whole answer's.
                for name in _INPUT_USAGE:
                    if name in usage and name in self.start_usage:
                        usage[name] = self.start_usage[name]
                if self.ids_complete:
                    usage["output_tokens"] = len(self.token_ids)
        elif kind in ("message_stop", "error"):
            self.done = True
        prefix.append(_event(kind, obj))
        return b"\n\n".join(prefix)


def anthropic_errors(send: Send) -> Send:
    """``send`` with error answers in OpenAI's shape (the router's own: no key, too large, no replica…)
    rewritten in Anthropic's (``{"type": "error", "error": {"type", "message"}, "request_id"}``, a
    capacity answer's status 529); the
    replicas' answers there have it already and pass as they are, as does everything that is not an
    error. Every answer's head also names its request in Anthropic's ``request-id`` header (the
    SDK's ``_request_id``): the id of its ``x-request-id``."""
    start: dict | None = None
    chunks: list[bytes] = []

    async def wrapped(message: dict) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            message = _named(message)
            if message["status"] >= 400:
                start = message  # held until the whole body is in
                return
        if start is None or message["type"] != "http.response.body":
            await send(message)
            return
        chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(chunks)
        try:
            obj = json.loads(body)
            error = obj["error"]
            if obj.get("type") != "error" and isinstance(error, dict):
                status = start["status"]
                code = error.get("code") if isinstance(error.get("code"), str) else None
                start = {**start, "status": anthropic_status(status, code)}  # the router's 429/503: 529
                shaped = {
                    "type": "error",
                    "error": {"type": error_type(status), "message": error.get("message")},
                }
                details = error_details(code)
                if details is not None:
                    shaped["error"]["details"] = details
                request_id = dict(start["headers"]).get(b"request-id")
                if request_id is not None:
                    shaped["request_id"] = request_id.decode("latin-1")
                body = json.dumps(shaped).encode()
        except (ValueError, KeyError, TypeError):
            pass
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        start = None

    return wrapped


def _named(start: dict) -> dict:
    """An answer's head with ``request-id`` set to its ``x-request-id`` (none without one)."""
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"request-id"]
    request_id = next((v for k, v in headers if k.lower() == b"x-request-id"), None)
    if request_id is not None:
        headers.append((b"request-id", request_id))
    return {**start, "headers": headers}
