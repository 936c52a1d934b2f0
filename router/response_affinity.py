"""Which replica answered a Responses API request, so what refers to that response goes there too.

A ferry replica names a response ``resp_{request id}``, or what the body's ``request_id`` (vLLM's
field) says (``server.middleware.response_id_for``), and keeps it in its ``--responses-store``
(``server/responses_store.py``). With the default memory store only that replica can continue it
(``previous_response_id``), answer ``GET`` / ``DELETE /v1/responses/{id}`` or cancel a background
response (``POST /v1/responses/{id}/cancel``); with a shared Redis store any replica can, but the
one that served the conversation also holds its KV blocks, and the one running a background
response cancels it and streams its events (``GET …?stream=true``) without a round through the
store. So the router remembers ``response id -> replica URL`` for every ``POST /v1/responses`` a
replica answered with 200 (the id follows from the body's ``request_id``, else from the
``X-Request-Id`` the replica answers with: the router's, or one of its own when it could not take
that) and routes requests that name that id to that replica while it is a candidate; otherwise the policy picks as usual. Not for a request with
``"store": false``: no replica holds that response, so nothing can name it (remembered, such ids
filled the map for nothing: ~400 bytes each, ~39 MiB at its bound). A stream resumed on
another replica (``router/responses_stream.py``) is finished and stored there under the same id,
so the id is remembered again with the replica that took it over.

An input item may name a stored item instead of repeating it (``{"type": "item_reference", "id"}``,
``server/responses_refs.py``): only a store that holds the item's record resolves it, so the router
also remembers ``item id -> replica`` for the items a replica stored: the output items of each
response it answered (a whole answer's body, a stream's ``response.completed`` or
``response.incomplete``: what the client has, so what it can name), the client's input items that
came with an id, and the items a ``GET`` of a stored response or its ``input_items`` shows (a
background response's output, ids a replica gave input items). Cheap for answers nobody refers to:
a whole answer is parsed once, after it is relayed; a stream's events are parsed by the failover
tracker anyway, and a stream relayed as it is (background) has only its stored end parsed.

A request naming items goes where they are. When they are on several replicas (memory stores: no
replica can resolve them all, so one reference is a 404 wherever it goes), its
``previous_response_id``'s replica wins if known (the conversation must be there; with a shared
store it also holds the KV blocks), else the replica most of its references name (the first named
among equals).

Bounded: the least recently used ids are forgotten beyond ``max_entries`` (responses and items
apart).

The Files and Batches API needs no map: a replica keeps its files and runs its batches itself
(``server/batch_store.py``), so every ``/v1/files*`` and ``/v1/batches*`` request goes to one
replica, ``batch_home``.
"""

from __future__ import annotations

import json
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Any

from router.sse import SSESplitter, typed_event
from server.middleware import response_id_for

if TYPE_CHECKING:
    from router.relay import ProxyCall
    from router.replica import Replica
    from router.upstream import Response

RESPONSES_PATH = "/v1/responses"

# OpenAI's Files and Batches API: a replica keeps its files and runs its batches itself
# (server/batch_store.py), so these go to one replica (``batch_home``) whatever the policy.
BATCH_PATH_PREFIXES = ("/v1/files", "/v1/batches")


def is_batch_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in BATCH_PATH_PREFIXES)


def batch_home(candidates: list[Replica]) -> str | None:
    """The replica every Files and Batches API request goes to: the routable one with the lowest URL,
    so lists are whole and every id resolves while the replica set stays as it is (ids of a replica
    that left are 404 elsewhere, as its files went with it)."""
    return min((r.url for r in candidates), default=None)


def referenced_response(method: str, path: str, body: dict[str, Any] | None) -> str | None:
    """The stored response a request names: ``previous_response_id`` of a ``POST /v1/responses``,
    or the ``{id}`` of ``/v1/responses/{id}[/input_items|/cancel]`` (``GET ...?stream=true`` of a
    background response included: the query is not part of ``path``)."""
    if path == RESPONSES_PATH:
        if method == "POST" and body is not None and isinstance(body.get("previous_response_id"), str):
            return body["previous_response_id"]
        return None
    if path.startswith(RESPONSES_PATH + "/"):
        rest = path[len(RESPONSES_PATH) + 1 :].split("/")
        if rest[0] and (len(rest) == 1 or rest[1:] in (["input_items"], ["cancel"])):
            return rest[0]
    return None


def named_id(body: dict[str, Any] | None) -> str | None:
    """The response id a ``POST /v1/responses`` body names (vLLM's ``request_id``): a replica
    answered 200, so it took it as the id (``server.middleware.response_id_for``)."""
    named = None if body is None else body.get("request_id")
    return named if isinstance(named, str) else None


def _is_reference(item: Any) -> bool:
    """An input item that names a stored item: the replica's rule (``server/responses_refs.py``)."""
    if not isinstance(item, dict):
        return False
    kind = item.get("type")
    return kind == "item_reference" or (kind is None and "id" in item and "role" not in item)


def referenced_items(body: dict[str, Any] | None) -> list[str]:
    """The ids of the stored items a ``POST /v1/responses`` body's input names, in input order."""
    input_ = None if body is None else body.get("input")
    if not isinstance(input_, list):
        return []
    return [item["id"] for item in input_ if _is_reference(item) and isinstance(item.get("id"), str)]


def stored_item_ids(body: dict[str, Any] | None, response: dict[str, Any]) -> list[str]:
    """The ids of the items a replica stored with ``response`` (its answer to ``body``): the client's
    input items that came with an id (references too: the record holds the items they name) and the
    response's output items. None of them when the response was not stored (``store`` false in the answer:
    the request said so, or the store failed)."""
    if response.get("store") is not True:
        return []
    input_ = None if body is None else body.get("input")
    items = [*(input_ if isinstance(input_, list) else ()), *(response.get("output") or ())]
    return [item["id"] for item in items if isinstance(item, dict) and isinstance(item.get("id"), str)]


def listed_item_ids(obj: dict[str, Any]) -> list[str]:
    """The ids of the items a stored response's ``GET`` answer shows: its output, or the page of its
    input items (``data``)."""
    if obj.get("object") == "response" and obj.get("store") is not True:
        return []
    items = [*(obj.get("output") or ()), *(obj.get("data") or ())]
    return [item["id"] for item in items if isinstance(item, dict) and isinstance(item.get("id"), str)]


# The most of a whole answer the relay keeps to read once it is relayed: a Responses answer is its
# output items' text and a few fields; one larger is relayed unread (its items not learned).
KEEP_MAX_BYTES = 8 << 20
# The events of a Responses stream that carry the response as stored (a stream that failed is not).
_STORED_ENDS = (b"event: response.completed\n", b"event: response.incomplete\n")


class WholeAnswer:
    """A JSON answer's bytes as they are relayed, read once at its end (none past the cap)."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size <= KEEP_MAX_BYTES:
            self.chunks.append(chunk)
        else:
            self.chunks = []

    def result(self) -> dict[str, Any] | None:
        if self.size > KEEP_MAX_BYTES:
            return None
        try:
            obj = json.loads(b"".join(self.chunks))
        except ValueError:
            return None
        return obj if isinstance(obj, dict) else None


class StreamEnd:
    """A Responses stream relayed as it is (a background one, or its replay): only its stored end
    is parsed, the response its ``response.completed`` / ``response.incomplete`` event carries."""

    def __init__(self) -> None:
        self.splitter = SSESplitter()
        self.response: dict[str, Any] | None = None

    def add(self, chunk: bytes) -> None:
        for event in self.splitter.feed(chunk):
            if event.startswith(_STORED_ENDS) and (obj := typed_event(event)) is not None:
                response = obj.get("response")
                self.response = response if isinstance(response, dict) else self.response

    def result(self) -> dict[str, Any] | None:
        return self.response


def answer_reader(response: Response) -> WholeAnswer | StreamEnd | None:
    """What reads a replica's 200 answer for the Responses object in it (None: nothing to read)."""
    if response.status_code != 200:
        return None
    content_type = response.headers.get("content-type", "")
    if content_type.startswith("application/json"):
        return WholeAnswer()
    return StreamEnd() if content_type.startswith("text/event-stream") else None


class _LRU:
    """``id -> replica URL``, the least recently used forgotten beyond ``max_entries``."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._urls: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._urls)

    def put(self, key: str, url: str) -> None:
        self._urls[key] = url
        self._urls.move_to_end(key)
        while len(self._urls) > self.max_entries:
            self._urls.popitem(last=False)

    def get(self, key: str) -> str | None:
        url = self._urls.get(key)
        if url is not None:
            self._urls.move_to_end(key)
        return url

    def pop(self, key: str) -> None:
        self._urls.pop(key, None)


class ResponseAffinity:
    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._responses = _LRU(max_entries)
        self._items = _LRU(max_entries)

    def __len__(self) -> int:
        return len(self._responses)

    @property
    def items(self) -> int:
        return len(self._items)

    def remember(self, response_id: str, url: str) -> None:
        self._responses.put(response_id, url)

    def remember_items(self, item_ids: list[str], url: str) -> None:
        for item_id in item_ids:
            self._items.put(item_id, url)

    def lookup(self, response_id: str) -> str | None:
        return self._responses.get(response_id)

    def lookup_items(self, item_ids: list[str]) -> str | None:
        """The replica holding the items ``item_ids`` name: the one most of them are on, the first
        named among equals (None: none is known)."""
        urls = [url for url in map(self._items.get, item_ids) if url is not None]
        if not urls:
            return None
        counts = Counter(urls)
        return max(counts, key=counts.__getitem__)  # ties: the first counted (Counter keeps order)

    def forget(self, response_id: str) -> None:
        self._responses.pop(response_id)

    def follow(self, call: ProxyCall) -> bool:
        """Send what ``call`` names (a stored response, stored items) to the replica that holds it
        (``call.route.prefer_url``), and have the call tell who answers new responses and what they
        stored. False when it names something whose replica is not known (a miss)."""
        referenced = referenced_response(call.method, call.path, call.json)
        is_post = call.path == RESPONSES_PATH and call.method == "POST"
        stores = is_post and (call.json or {}).get("store") is not False
        items = referenced_items(call.json) if is_post else []
        if referenced is not None:
            call.route.prefer_url = self.lookup(referenced)
        if call.route.prefer_url is None and items:
            call.route.prefer_url = self.lookup_items(items)
        answered_by: list[str] = []  # the replica answering (a resumed stream: the last one)

        def answered(replica: Replica, response: Response) -> None:
            if response.status_code == 200:
                answered_by[:] = [replica.url]
                if stores:  # the id the replica used (it replaces a request id it cannot take)
                    used = response.headers.get("x-request-id") or call.request_id
                    self.remember(response_id_for(used, named_id(call.json)), replica.url)

        if is_post:

            def finished(response: dict[str, Any]) -> None:
                if answered_by:
                    self.remember_items(stored_item_ids(call.json, response), answered_by[0])

            call.on_answered, call.on_response = answered, finished
        elif referenced is not None and call.method == "GET":
            # A stored response or its input items as the client reads them: ids it may name next
            # that no answer to a POST showed (a background response's output, the ids a replica
            # gave input items sent without one).

            def read(obj: dict[str, Any]) -> None:
                if answered_by:
                    self.remember_items(listed_item_ids(obj), answered_by[0])

            call.on_answered, call.on_response = answered, read
        elif referenced is not None and call.method == "DELETE":

            def deleted(replica: Replica, response: Response) -> None:
                if response.status_code == 200:
                    self.forget(referenced)

            call.on_answered = deleted
        return call.route.prefer_url is not None or (referenced is None and not items)
