"""The ``--responses-store memory`` stores the API uses: ``MemoryResponseStore`` over this process's
``MemoryRecords`` (a one-process replica), ``RemoteResponseStore`` over the engine process's, through
the engine connection (``EngineClient.store``), so that every API server of a replica
(``--api-server-count``) sees every response. Both speak ``ResponseStore``
(``server/responses_store.py``) and store the same JSON bytes.
"""

from __future__ import annotations

import json
from typing import Any

from server.responses_memory import MemoryRecords
from server.responses_store import StoreUnavailable, encode, ended, item_ids


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
