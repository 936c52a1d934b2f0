"""Which replica answered a Responses API request, so what refers to that response goes there too.

A ferry replica names a response ``resp_{request id}`` (``server.middleware.response_id_for``) and keeps it in its ``--responses-store``
(``server/responses_store.py``). With the default memory store only that replica can continue it
(``previous_response_id``), answer ``GET`` / ``DELETE /v1/responses/{id}`` or cancel a background
response (``POST /v1/responses/{id}/cancel``); with a shared Redis store any replica can, but the
one that served the conversation also holds its KV blocks, and the one running a background
response cancels it and streams its events (``GET …?stream=true``) without a round through the
store. So the router remembers ``response id -> replica URL`` for every ``POST /v1/responses`` a
replica answered with 200 (the id follows from the ``X-Request-Id`` the replica answers with: the
router's, or one of its own when it could not take that) and routes requests that name that id to
that replica while it is a candidate; otherwise the policy picks as usual. A stream resumed on
another replica (``router/responses_stream.py``) is finished and stored there under the same id,
so the id is remembered again with the replica that took it over.

Bounded: the least recently used ids are forgotten beyond ``max_entries``.

The Files and Batches API needs no map: a replica keeps its files and runs its batches itself
(``server/batch_store.py``), so every ``/v1/files*`` and ``/v1/batches*`` request goes to one
replica, ``batch_home``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.replica import Replica

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


class ResponseAffinity:
    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._replicas: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._replicas)

    def remember(self, response_id: str, url: str) -> None:
        self._replicas[response_id] = url
        self._replicas.move_to_end(response_id)
        while len(self._replicas) > self.max_entries:
            self._replicas.popitem(last=False)

    def lookup(self, response_id: str) -> str | None:
        url = self._replicas.get(response_id)
        if url is not None:
            self._replicas.move_to_end(response_id)
        return url

    def forget(self, response_id: str) -> None:
        self._replicas.pop(response_id, None)
