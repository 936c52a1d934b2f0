"""Stored responses of the Responses API: ``store`` (true unless the request says false),
``previous_response_id``, ``GET`` / ``DELETE /v1/responses/{id}`` and
``GET /v1/responses/{id}/input_items``.

A record is one JSON document per response id: ``{"response": <the Response object as answered>,
"input": <the conversation's input items up to it: the input and output items of the responses
it continues, then its own input>}``. A request that continues it reads that one record: its
conversation is the record's ``input``, then the response's ``output``, then its own ``input``
(the earlier ``instructions`` are not carried over, as OpenAI's are not).

Where records live (``ferry serve --responses-store``):

* ``memory`` (default): this replica's memory, the least recently used dropped first beyond
  ``--responses-store-max-bytes`` (counted as the records' JSON and kept events, plus a fixed
  overhead per record, per indexed item and per event for the containers that hold them: see
  ``RECORD_OVERHEAD``; the memory really held then stays under the bound: 72-87 % of it for small
  records in the test, which allows 110 %). With ``--api-server-count`` the
  engine process holds them for every API server (``RemoteResponseStore``).
* ``redis://…`` / ``rediss://…`` / ``unix://…``: shared by every replica that names the same
  Redis, so a chain continues on whichever replica a router picks. Key ``ferry:response:{id}``,
  value the record's JSON.
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
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Protocol

from prometheus_client import Gauge

logger = logging.getLogger("ferry.server")

# What a record says while its response runs (background responses only).
RUNNING = frozenset({"queued", "in_progress"})
# The events of a streamed background response kept for resumption: the latest ones (a client
# resumes where its connection broke, near the end). 4096 text deltas are ~1 MB of JSON.
EVENT_LOG_LIMIT = 4096
# How many held events one read returns at most (a resumed stream reads again for the rest).
EVENT_READ_BATCH = 512
# What the memory store counts beyond the JSON it holds (CPython 3.11, 64-bit, measured with
# tracemalloc and rounded up), so that ``--responses-store-max-bytes`` bounds real memory and not
# only the JSON, which small records would pass by half or more:
# a record: its id (``+ len(id)``), the ``bytes`` object, its entry in the ordered map, its
# (expiry, data) tuple, its set of indexed item ids, and its cancel flag or lease when it has one;
RECORD_OVERHEAD = 480
# an indexed item: its id (``+ len(id)``), its entry in the item map and in its record's set;
ITEM_OVERHEAD = 200
# a record's event log (the log and its deque), and each event in it (the ``bytes`` object's
# header and the deque's slot).
EVENT_LOG_OVERHEAD = 1024
EVENT_OVERHEAD = 48

# The memory store's size (process-wide registry; with --api-server-count, the engine process's,
# summed with the API servers' zeros).
STORED = Gauge(
    "ferry:responses_stored", "Responses held in this replica's memory store.", multiprocess_mode="livesum"
)
STORED_BYTES = Gauge(
    "ferry:responses_stored_bytes", "Bytes of the responses (their JSON, kept events and index entries, with the overheads counted) in this replica's memory store.",
    multiprocess_mode="livesum",
)  # fmt: skip


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


def _record_bytes(response_id: str, data: bytes) -> int:
    return RECORD_OVERHEAD + len(response_id) + len(data)


def _item_bytes(item_id: str) -> int:
    return ITEM_OVERHEAD + len(item_id)


@dataclass
class _EventLog:
    """The latest events of one response: ``frames[0]`` is event ``first``."""

    first: int = 0
    frames: deque[bytes] = field(default_factory=deque)
    bytes: int = 0


class MemoryRecords:
    """Records as JSON bytes in insertion/use order, bounded in bytes and age, with the event logs,
    cancel flags and leases of background responses (synchronous: the engine process serves it to
    API servers from its event loop, so each call is atomic). A record's events and index entries
    count in its bytes (with the fixed overheads above) and go with it."""

    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._records: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._logs: dict[str, _EventLog] = {}
        self._cancels: set[str] = set()
        self._leases: dict[str, float] = {}  # response id -> when its lease expires (clock)
        self._item_records: dict[str, str] = {}  # item id -> the latest record holding it
        self._items_of: dict[str, set[str]] = {}  # response id -> the item ids it indexed
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def _live(self, response_id: str) -> bytes | None:
        """The record's bytes unless it is absent or expired (then dropped)."""
        entry = self._records.get(response_id)
        if entry is None:
            return None
        if self._clock() >= entry[0]:
            self.delete(response_id)
            return None
        return entry[1]

    def get(self, response_id: str) -> bytes | None:
        data = self._live(response_id)
        if data is not None:
            self._records.move_to_end(response_id)
        return data

    def put(self, response_id: str, data: bytes, items: Iterable[str] = (), ended: bool = False) -> bool:
        """``items``: the record's item ids (``item_ids``), indexed to it; a record replaced
        without them keeps the ones it indexed. ``ended``: the record says its response no longer
        runs, so its lease is given back now (nothing else would drop it while no other background
        response renews leases)."""
        if ended:
            self._leases.pop(response_id, None)
        indexed = self._items_of.get(response_id, set())
        new_items = {item_id for item_id in items if item_id not in indexed}
        charge = _record_bytes(response_id, data) + sum(map(_item_bytes, new_items))
        if charge + sum(map(_item_bytes, indexed)) > self.max_bytes:
            self.delete(response_id)
            self._leases.pop(response_id, None)
            return False
        old = self._records.pop(response_id, None)  # replaced: its events and flag stay
        if old is not None:
            self.bytes -= _record_bytes(response_id, old[1])
        self._records[response_id] = (self._clock() + self.ttl_s, data)
        self.bytes += charge
        if new_items:  # no empty set kept per record (216 bytes each)
            self._items_of[response_id] = indexed | new_items
        for item_id in items:
            self._item_records[item_id] = response_id
        self._evict()
        return True

    def find_item(self, item_id: str) -> bytes | None:
        response_id = self._item_records.get(item_id)
        return None if response_id is None else self.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._records.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= _record_bytes(response_id, entry[1])
        log = self._logs.pop(response_id, None)
        if log is not None:
            self.bytes -= log.bytes
        self._cancels.discard(response_id)
        self._leases.pop(response_id, None)
        for item_id in self._items_of.pop(response_id, ()):
            self.bytes -= _item_bytes(item_id)
            if self._item_records.get(item_id) == response_id:  # not since indexed to a later one
                del self._item_records[item_id]
        self._publish()
        return True

    def append_events(self, response_id: str, first_seq: int, frames: Iterable[bytes]) -> None:
        if self._live(response_id) is None:
            return
        log = self._logs.get(response_id)
        if log is None:
            log = self._logs[response_id] = _EventLog(first=first_seq, bytes=EVENT_LOG_OVERHEAD)
            self.bytes += EVENT_LOG_OVERHEAD
        for frame in frames:
            log.frames.append(frame)
            log.bytes += len(frame) + EVENT_OVERHEAD
            self.bytes += len(frame) + EVENT_OVERHEAD
        while len(log.frames) > EVENT_LOG_LIMIT:
            dropped = log.frames.popleft()
            log.first += 1
            log.bytes -= len(dropped) + EVENT_OVERHEAD
            self.bytes -= len(dropped) + EVENT_OVERHEAD
        self._records.move_to_end(response_id)
        self._evict()

    def read_events(self, response_id: str, after: int) -> tuple[int | None, list[bytes]]:
        log = self._logs.get(response_id) if self._live(response_id) is not None else None
        if log is None or not log.frames:
            return None, []
        start = max(0, after + 1 - log.first)
        return log.first, list(islice(log.frames, start, start + EVENT_READ_BATCH))

    def request_cancel(self, response_id: str) -> None:
        if self._live(response_id) is not None:
            self._cancels.add(response_id)

    def cancel_requested(self, response_ids: list[str]) -> list[str]:
        return [rid for rid in response_ids if rid in self._cancels]

    def claim(self, response_id: str, ttl_s: float) -> None:
        self._cancels.discard(response_id)
        self._leases[response_id] = self._clock() + ttl_s

    def renew_leases(self, response_ids: list[str], ttl_s: float) -> None:
        now = self._clock()
        # Leases nobody renews (their process died, their record was never kept) go here.
        for rid in [rid for rid, until in self._leases.items() if until <= now]:
            del self._leases[rid]
        for rid in response_ids:
            self._leases[rid] = now + ttl_s

    def lease_held(self, response_id: str) -> bool:
        return self._clock() < self._leases.get(response_id, float("-inf"))

    def replace_orphan(self, response_id: str, data: bytes) -> bool:
        current = self._live(response_id)
        if current is None or self.lease_held(response_id) or not says_running(current):
            return False
        return self.put(response_id, data, ended=True)

    def events_end(self, response_id: str) -> int:
        log = self._logs.get(response_id) if self._live(response_id) is not None else None
        return 0 if log is None else log.first + len(log.frames)

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._records:
            self.delete(next(iter(self._records)))
        self._publish()

    def _publish(self) -> None:
        STORED.set(len(self._records))
        STORED_BYTES.set(self.bytes)


# What an API server process may ask of the engine process's MemoryRecords (``EngineClient.store``).
MEMORY_OPS = frozenset(
    "get put find_item delete append_events read_events request_cancel cancel_requested claim "
    "renew_leases lease_held replace_orphan events_end".split()
)


class MemoryResponseStore:
    """``--responses-store memory`` in a one-process replica."""

    shared = False

    def __init__(self, max_bytes: int, ttl_s: float) -> None:
        self.records = MemoryRecords(max_bytes, ttl_s)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        data = self.records.get(response_id)
        return None if data is None else json.loads(data)

    async def put(self, response_id: str, record: dict[str, Any]) -> bool:
        return self.records.put(response_id, encode(record), item_ids(record), ended(record))

    async def find_item(self, item_id: str) -> dict[str, Any] | None:
        data = self.records.find_item(item_id)
        return None if data is None else json.loads(data)

    async def delete(self, response_id: str) -> bool:
        return self.records.delete(response_id)

    async def append_events(self, response_id: str, first_seq: int, frames: list[bytes]) -> None:
        self.records.append_events(response_id, first_seq, frames)

    async def read_events(self, response_id: str, after: int) -> tuple[int | None, list[bytes]]:
        return self.records.read_events(response_id, after)

    async def request_cancel(self, response_id: str) -> None:
        self.records.request_cancel(response_id)

    async def cancel_requested(self, response_ids: list[str]) -> list[str]:
        return self.records.cancel_requested(response_ids)

    async def claim(self, response_id: str, ttl_s: float) -> None:
        self.records.claim(response_id, ttl_s)

    async def renew_leases(self, response_ids: list[str], ttl_s: float) -> None:
        self.records.renew_leases(response_ids, ttl_s)

    async def lease_held(self, response_id: str) -> bool:
        return self.records.lease_held(response_id)

    async def replace_orphan(self, response_id: str, record: dict[str, Any]) -> bool:
        return self.records.replace_orphan(response_id, encode(record))

    async def events_end(self, response_id: str) -> int:
        return self.records.events_end(response_id)

    async def close(self) -> None:
        pass


class RemoteResponseStore:
    """``--responses-store memory`` in an API server process: the engine process's records, through
    the engine connection (``EngineClient.store``), so every API server sees every response."""

    shared = True

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    async def _store(self, *args: Any) -> Any:
        try:
            return await self._engine.store(*args)
        except Exception as e:  # noqa: BLE001 - the engine process gone or failing
            raise StoreUnavailable(f"the engine process's response store failed: {e}") from e

    async def get(self, response_id: str) -> dict[str, Any] | None:
        data = await self._store("get", response_id)
        return None if data is None else json.loads(data)

    async def put(self, response_id: str, record: dict[str, Any]) -> bool:
        return bool(await self._store("put", response_id, encode(record), item_ids(record), ended(record)))

    async def find_item(self, item_id: str) -> dict[str, Any] | None:
        data = await self._store("find_item", item_id)
        return None if data is None else json.loads(data)

    async def delete(self, response_id: str) -> bool:
        return bool(await self._store("delete", response_id))

    async def append_events(self, response_id: str, first_seq: int, frames: list[bytes]) -> None:
        await self._store("append_events", response_id, first_seq, frames)

    async def read_events(self, response_id: str, after: int) -> tuple[int | None, list[bytes]]:
        first, frames = await self._store("read_events", response_id, after)
        return first, frames

    async def request_cancel(self, response_id: str) -> None:
        await self._store("request_cancel", response_id)

    async def cancel_requested(self, response_ids: list[str]) -> list[str]:
        return list(await self._store("cancel_requested", response_ids))

    async def claim(self, response_id: str, ttl_s: float) -> None:
        await self._store("claim", response_id, ttl_s)

    async def renew_leases(self, response_ids: list[str], ttl_s: float) -> None:
        await self._store("renew_leases", response_ids, ttl_s)

    async def lease_held(self, response_id: str) -> bool:
        return bool(await self._store("lease_held", response_id))

    async def replace_orphan(self, response_id: str, record: dict[str, Any]) -> bool:
        return bool(await self._store("replace_orphan", response_id, encode(record)))

    async def events_end(self, response_id: str) -> int:
        return int(await self._store("events_end", response_id))

    async def close(self) -> None:
        pass


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
        if hasattr(engine, "store"):
            return RemoteResponseStore(engine)
        return MemoryResponseStore(max_bytes, ttl_s)
    from server.responses_redis import RedisResponseStore

    return RedisResponseStore(spec, ttl_s)
