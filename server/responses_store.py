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
  ``--responses-store-max-bytes`` (counted as the records' JSON). With ``--api-server-count`` the
  engine process holds them for every API server (``RemoteResponseStore``).
* ``redis://…`` / ``rediss://…`` / ``unix://…``: shared by every replica that names the same
  Redis, so a chain continues on whichever replica a router picks. Key ``ferry:response:{id}``,
  value the record's JSON.
* ``none``: nothing is stored; ``previous_response_id`` is a 400.

Records expire ``--responses-store-ttl`` seconds after they were written (30 days by default, as
long as OpenAI keeps them). A store that fails (Redis down) raises ``StoreUnavailable``; the
server answers 503 to what needs a record and still serves the rest.

Background responses (``server/responses_background.py``) keep two more things per response, next
to its record and gone with it: the events of a streamed one (its last ``EVENT_LOG_LIMIT``, for
``GET /v1/responses/{id}?stream=true&starting_after=N``; Redis: the stream
``ferry:response-events:{id}``, entry id ``0-{sequence_number + 1}``), and a cancel flag that the
process running it polls (Redis: ``ferry:response-cancel:{id}``). ``shared`` says whether another
process may run a response this one reads (every store but this process's own memory).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Protocol

from prometheus_client import Gauge

logger = logging.getLogger("ferry.server")

KEY_PREFIX = "ferry:response:"
EVENTS_PREFIX = "ferry:response-events:"
CANCEL_PREFIX = "ferry:response-cancel:"
# The events of a streamed background response kept for resumption: the latest ones (a client
# resumes where its connection broke, near the end). 4096 text deltas are ~1 MB of JSON.
EVENT_LOG_LIMIT = 4096
# How many held events one read returns at most (a resumed stream reads again for the rest).
EVENT_READ_BATCH = 512

# The memory store's size (process-wide registry; with --api-server-count, the engine process's,
# summed with the API servers' zeros).
STORED = Gauge(
    "ferry:responses_stored", "Responses held in this replica's memory store.", multiprocess_mode="livesum"
)
STORED_BYTES = Gauge(
    "ferry:responses_stored_bytes", "JSON bytes of the responses (and their kept events) in this replica's memory store.",
    multiprocess_mode="livesum",
)  # fmt: skip


class StoreUnavailable(Exception):
    """The store could not be reached or refused the operation."""


class ResponseStore(Protocol):
    shared: bool  # records may be written by another process (and its responses run there)

    async def get(self, response_id: str) -> dict[str, Any] | None: ...

    async def put(self, response_id: str, record: dict[str, Any]) -> bool:
        """Store ``record``; False if it was not kept (larger than the whole store)."""
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

    async def clear_cancel(self, response_id: str) -> None: ...

    async def close(self) -> None: ...


def encode(record: dict[str, Any]) -> bytes:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass
class _EventLog:
    """The latest events of one response: ``frames[0]`` is event ``first``."""

    first: int = 0
    frames: deque[bytes] = field(default_factory=deque)
    bytes: int = 0


class MemoryRecords:
    """Records as JSON bytes in insertion/use order, bounded in bytes and age, with the event logs
    and cancel flags of background responses (synchronous: the engine process serves it to API
    servers from its event loop). A record's events count in its bytes and go with it."""

    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._records: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._logs: dict[str, _EventLog] = {}
        self._cancels: set[str] = set()
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

    def put(self, response_id: str, data: bytes) -> bool:
        if len(data) > self.max_bytes:
            self.delete(response_id)
            return False
        old = self._records.pop(response_id, None)  # replaced: its events and flag stay
        if old is not None:
            self.bytes -= len(old[1])
        self._records[response_id] = (self._clock() + self.ttl_s, data)
        self.bytes += len(data)
        self._evict()
        return True

    def delete(self, response_id: str) -> bool:
        entry = self._records.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= len(entry[1])
        log = self._logs.pop(response_id, None)
        if log is not None:
            self.bytes -= log.bytes
        self._cancels.discard(response_id)
        self._publish()
        return True

    def append_events(self, response_id: str, first_seq: int, frames: Iterable[bytes]) -> None:
        if self._live(response_id) is None:
            return
        log = self._logs.setdefault(response_id, _EventLog(first=first_seq))
        for frame in frames:
            log.frames.append(frame)
            log.bytes += len(frame)
            self.bytes += len(frame)
        while len(log.frames) > EVENT_LOG_LIMIT:
            dropped = log.frames.popleft()
            log.first += 1
            log.bytes -= len(dropped)
            self.bytes -= len(dropped)
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

    def clear_cancel(self, response_id: str) -> None:
        self._cancels.discard(response_id)

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._records:
            self.delete(next(iter(self._records)))
        self._publish()

    def _publish(self) -> None:
        STORED.set(len(self._records))
        STORED_BYTES.set(self.bytes)


# What an API server process may ask of the engine process's MemoryRecords (``EngineClient.store``).
MEMORY_OPS = frozenset(
    "get put delete append_events read_events request_cancel cancel_requested clear_cancel".split()
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
        return self.records.put(response_id, encode(record))

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

    async def clear_cancel(self, response_id: str) -> None:
        self.records.clear_cancel(response_id)

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
        return bool(await self._store("put", response_id, encode(record)))

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

    async def clear_cancel(self, response_id: str) -> None:
        await self._store("clear_cancel", response_id)

    async def close(self) -> None:
        pass


class RedisResponseStore:
    """``--responses-store redis://…``: records shared by every replica using that Redis."""

    shared = True

    def __init__(self, url: str, ttl_s: float) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.url = url
        self.ttl_ms = max(1, int(ttl_s * 1000))
        # One retry on a new connection: a restarted Redis leaves every pooled one dead, and each
        # would otherwise fail one request (a 503) on every replica.
        self._client = aioredis.from_url(
            url, socket_timeout=2.0, socket_connect_timeout=2.0, retry=Retry(NoBackoff(), 1)
        )

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        try:
            yield
        except Exception as e:  # noqa: BLE001 - any client failure is an unavailable store
            raise StoreUnavailable(f"the response store at {self.url} failed: {e}") from e

    async def get(self, response_id: str) -> dict[str, Any] | None:
        with self._failing():
            data = await self._client.get(KEY_PREFIX + response_id)
        return None if data is None else json.loads(data)

    async def put(self, response_id: str, record: dict[str, Any]) -> bool:
        with self._failing():
            await self._client.set(KEY_PREFIX + response_id, encode(record), px=self.ttl_ms)
        return True

    async def delete(self, response_id: str) -> bool:
        with self._failing():
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.delete(KEY_PREFIX + response_id)
                pipe.delete(EVENTS_PREFIX + response_id, CANCEL_PREFIX + response_id)
                existed, _ = await pipe.execute()
        return bool(existed)

    async def append_events(self, response_id: str, first_seq: int, frames: list[bytes]) -> None:
        key = EVENTS_PREFIX + response_id
        with self._failing():
            async with self._client.pipeline(transaction=False) as pipe:
                for i, frame in enumerate(frames):
                    # Entry id 0-(seq + 1): a read from any sequence number is one XRANGE.
                    pipe.xadd(
                        key,
                        {"e": frame},
                        id=f"0-{first_seq + i + 1}",
                        maxlen=EVENT_LOG_LIMIT,
                        approximate=False,
                    )
                pipe.pexpire(key, self.ttl_ms)
                await pipe.execute()

    async def read_events(self, response_id: str, after: int) -> tuple[int | None, list[bytes]]:
        key = EVENTS_PREFIX + response_id
        with self._failing():
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.xrange(key, "-", "+", count=1)
                pipe.xrange(key, f"0-{after + 2}", "+", count=EVENT_READ_BATCH)
                oldest, entries = await pipe.execute()
        if not oldest:
            return None, []
        first = int(oldest[0][0].split(b"-")[1]) - 1
        return first, [fields[b"e"] for _, fields in entries]

    async def request_cancel(self, response_id: str) -> None:
        with self._failing():
            await self._client.set(CANCEL_PREFIX + response_id, b"1", px=self.ttl_ms)

    async def cancel_requested(self, response_ids: list[str]) -> list[str]:
        with self._failing():
            flags = await self._client.mget([CANCEL_PREFIX + rid for rid in response_ids])
        return [rid for rid, flag in zip(response_ids, flags, strict=True) if flag is not None]

    async def clear_cancel(self, response_id: str) -> None:
        with self._failing():
            await self._client.delete(CANCEL_PREFIX + response_id)

    async def close(self) -> None:
        await self._client.aclose()


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
    return RedisResponseStore(spec, ttl_s)
