"""Stored responses of the Responses API: ``store`` (true unless the request says false),
``previous_response_id``, ``GET`` / ``DELETE /v1/responses/{id}`` and
``GET /v1/responses/{id}/input_items``.

A record is one JSON document per response id: ``{"response": <the Response object as answered>,
"input": <the conversation's input items up to it: the input and output items of the responses
it continues, then its own input>}``. A request that continues it reads that one record: its
conversation is the record's ``input``, then the response's ``output``, then its own ``input``
(the earlier ``instructions`` are not carried over, as OpenAI's are not).

Where records live (``ferry serve --responses-store``):

* ``memory`` (default): this replica's memory (``server/responses_memory.py``), the least
  recently used dropped first beyond ``--responses-store-max-bytes`` (counted as the records' JSON
  and kept events, plus a fixed overhead per record, per indexed item and per event for the
  containers that hold them: see ``RECORD_OVERHEAD``; the memory really held then stays under the
  bound: 72-87 % of it for small records in the test, which allows 110 %). With
  ``--api-server-count`` the engine process holds them for every API server
  (``RemoteResponseStore``, ``server/responses_memory_stores.py``).
* ``redis://…`` / ``rediss://…`` / ``unix://…``: shared by every replica that names the same
  Redis, so a chain continues on whichever replica a router picks (``server/responses_redis.py``).
  Key ``ferry:response:{id}``, value the record's JSON.
* ``none``: nothing is stored; ``previous_response_id`` is a 400.

An input item may name a stored item instead of repeating it (``{"type": "item_reference", "id"}``,
``server/responses_refs.py``): every item of a record (its ``input`` and its response's ``output``)
is indexed by id, pointing at the latest record written that holds it (Redis: the key
``ferry:response-item:{item id}`` = the response id, with the record's TTL; in memory, beside the
records and gone with the one it points at). ``find_item`` reads the record an item id points at.

Records expire ``--responses-store-ttl`` seconds after they were written (30 days by default, as
long as OpenAI keeps them). A store that fails (Redis down) raises ``StoreUnavailable``; the
server answers 503 to what needs a record and still serves the rest.

Background responses (``server/responses_background.py``) keep three more things per response, next
to its record and gone with it: the events of a streamed one (its last ``EVENT_LOG_LIMIT``, for
``GET /v1/responses/{id}?stream=true&starting_after=N``; Redis: the stream
``ferry:response-events:{id}``, entry id ``0-{sequence_number + 1}``), a cancel flag that the
process running it polls (Redis: ``ferry:response-cancel:{id}``), and the lease of the process
running it, which expires unless renewed (Redis: ``ferry:response-lease:{id}``, ``PX``; see
``server/responses_lease.py``). ``shared`` says whether another process may run a response this
one reads (every store but this process's own memory).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

# What a record says while its response runs (background responses only).
RUNNING = frozenset({"queued", "in_progress"})
# The events of a streamed background response kept for resumption: the latest ones (a client
# resumes where its connection broke, near the end). 4096 text deltas are ~1 MB of JSON.
EVENT_LOG_LIMIT = 4096
# How many held events one read returns at most (a resumed stream reads again for the rest).
EVENT_READ_BATCH = 512


class StoreUnavailable(Exception):
    """The store could not be reached or refused the operation."""


class ResponseStore(Protocol):
    shared: bool  # records may be written by another process (and its responses run there)

    async def get(self, response_id: str) -> dict[str, Any] | None: ...

    async def put(self, response_id: str, record: dict[str, Any]) -> bool:
        """Store ``record`` and index its items (``item_ids``); False if it was not kept (larger
        than the whole store)."""
        ...

    async def find_item(self, item_id: str) -> dict[str, Any] | None:
        """The latest record written that holds item ``item_id``, or None (never stored, expired,
        or its record deleted)."""
        ...

    async def delete(self, response_id: str) -> bool:
        """Drop the record, its events and its cancel flag; False if there was no record."""
        ...

    async def append_events(self, response_id: str, first_seq: int, frames: list[bytes]) -> None:
        """Add events ``first_seq``, ``first_seq + 1``, … (SSE frames, in order) to the response's
        log, which keeps the latest ``EVENT_LOG_LIMIT``."""
        ...

    async def read_events(self, response_id: str, after: int) -> tuple[int | None, list[bytes]]:
        """(the sequence number of the oldest event held, or None when none is; up to
        ``EVENT_READ_BATCH`` held events after sequence number ``after``)."""
        ...

    async def request_cancel(self, response_id: str) -> None: ...

    async def cancel_requested(self, response_ids: list[str]) -> list[str]:
        """Those of ``response_ids`` whose cancel was requested."""
        ...

    async def claim(self, response_id: str, ttl_s: float) -> None:
        """This process runs the response from now: its lease taken for ``ttl_s`` seconds, and
        a cancel flag left by an earlier response of this id dropped."""
        ...

    async def renew_leases(self, response_ids: list[str], ttl_s: float) -> None:
        """Every lease of ``response_ids`` held for ``ttl_s`` seconds from now (one round trip)."""
        ...

    async def lease_held(self, response_id: str) -> bool: ...

    async def replace_orphan(self, response_id: str, record: dict[str, Any]) -> bool:
        """Store ``record`` only if the stored one still says it runs (``RUNNING``) and no
        process holds its lease, atomically: True if written (by one caller of many)."""
        ...

    async def events_end(self, response_id: str) -> int:
        """The sequence number after the last event held (0 when none is)."""
        ...

    async def close(self) -> None: ...


def item_ids(record: dict[str, Any]) -> list[str]:
    """The ids of a record's items: the conversation before its response, then the output."""
    items = [*record.get("input", ()), *record["response"].get("output", ())]
    return [item["id"] for item in items if isinstance(item, dict) and isinstance(item.get("id"), str)]


def ended(record: dict[str, Any]) -> bool:
    """The record says its response no longer runs (a background one's final record)."""
    return record["response"].get("status") not in RUNNING


def encode(record: dict[str, Any]) -> bytes:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()


def event_frame(kind: str, seq: int, **fields: Any) -> bytes:
    """A Responses stream event as the SSE frame that is sent and kept."""
    payload = {"type": kind, "sequence_number": seq, **fields}
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def says_running(data: bytes) -> bool:
    return json.loads(data)["response"].get("status") in RUNNING


def check_store_spec(spec: str) -> str | None:
    """What is wrong with a ``--responses-store`` value, or None."""
    if spec in ("memory", "none") or spec.startswith(("redis://", "rediss://", "unix://")):
        return None
    return f"--responses-store must be memory, none or a redis:// URL, got {spec!r}"


def open_response_store(spec: str, max_bytes: int, ttl_s: float, engine: Any) -> ResponseStore | None:
    """The store a replica's API uses (``engine``: an ``AsyncEngine``, or an API server process's
    ``EngineClient``, whose engine process holds the memory store)."""
    if spec == "none":
        return None
    if spec == "memory":
        from server.responses_memory_stores import MemoryResponseStore, RemoteResponseStore

        if hasattr(engine, "store"):
            return RemoteResponseStore(engine)
        return MemoryResponseStore(max_bytes, ttl_s)
    from server.responses_redis import RedisResponseStore

    return RedisResponseStore(spec, ttl_s)
