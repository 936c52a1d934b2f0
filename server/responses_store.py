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
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import Gauge

logger = logging.getLogger("ferry.server")

KEY_PREFIX = "ferry:response:"

# The memory store's size (process-wide registry; with --api-server-count, the engine process's,
# summed with the API servers' zeros).
STORED = Gauge(
    "ferry:responses_stored", "Responses held in this replica's memory store.", multiprocess_mode="livesum"
)
STORED_BYTES = Gauge(
    "ferry:responses_stored_bytes", "JSON bytes of the responses held in this replica's memory store.",
    multiprocess_mode="livesum",
)  # fmt: skip


class StoreUnavailable(Exception):
    """The store could not be reached or refused the operation."""


class ResponseStore(Protocol):
    async def get(self, response_id: str) -> dict[str, Any] | None: ...

    async def put(self, response_id: str, record: dict[str, Any]) -> bool:
        """Store ``record``; False if it was not kept (larger than the whole store)."""
        ...

    async def delete(self, response_id: str) -> bool: ...

    async def close(self) -> None: ...


def encode(record: dict[str, Any]) -> bytes:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()


class MemoryRecords:
    """Records as JSON bytes in insertion/use order, bounded in bytes and age (synchronous: the
    engine process serves it to API servers from its event loop)."""

    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._records: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def get(self, response_id: str) -> bytes | None:
        entry = self._records.get(response_id)
        if entry is None:
            return None
        if self._clock() >= entry[0]:
            self.delete(response_id)
            return None
        self._records.move_to_end(response_id)
        return entry[1]

    def put(self, response_id: str, data: bytes) -> bool:
        self.delete(response_id)
        if len(data) > self.max_bytes:
            return False
        self._records[response_id] = (self._clock() + self.ttl_s, data)
        self.bytes += len(data)
        while self.bytes > self.max_bytes:
            _, (_, dropped) = self._records.popitem(last=False)
            self.bytes -= len(dropped)
        self._publish()
        return True

    def delete(self, response_id: str) -> bool:
        entry = self._records.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= len(entry[1])
        self._publish()
        return True

    def _publish(self) -> None:
        STORED.set(len(self._records))
        STORED_BYTES.set(self.bytes)


class MemoryResponseStore:
    """``--responses-store memory`` in a one-process replica."""

    def __init__(self, max_bytes: int, ttl_s: float) -> None:
        self.records = MemoryRecords(max_bytes, ttl_s)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        data = self.records.get(response_id)
        return None if data is None else json.loads(data)

    async def put(self, response_id: str, record: dict[str, Any]) -> bool:
        return self.records.put(response_id, encode(record))

    async def delete(self, response_id: str) -> bool:
        return self.records.delete(response_id)

    async def close(self) -> None:
        pass


class RemoteResponseStore:
    """``--responses-store memory`` in an API server process: the engine process's records, through
    the engine connection (``EngineClient.store``), so every API server sees every response."""

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

    async def close(self) -> None:
        pass


class RedisResponseStore:
    """``--responses-store redis://…``: records shared by every replica using that Redis."""

    def __init__(self, url: str, ttl_s: float) -> None:
        import redis.asyncio as aioredis

        self.url = url
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._client = aioredis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        try:
            data = await self._client.get(KEY_PREFIX + response_id)
        except Exception as e:  # noqa: BLE001 - any client failure is an unavailable store
            raise StoreUnavailable(f"the response store at {self.url} failed: {e}") from e
        return None if data is None else json.loads(data)

    async def put(self, response_id: str, record: dict[str, Any]) -> bool:
        try:
            await self._client.set(KEY_PREFIX + response_id, encode(record), px=self.ttl_ms)
        except Exception as e:  # noqa: BLE001
            raise StoreUnavailable(f"the response store at {self.url} failed: {e}") from e
        return True

    async def delete(self, response_id: str) -> bool:
        try:
            return bool(await self._client.delete(KEY_PREFIX + response_id))
        except Exception as e:  # noqa: BLE001
            raise StoreUnavailable(f"the response store at {self.url} failed: {e}") from e

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
