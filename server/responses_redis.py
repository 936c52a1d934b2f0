"""``--responses-store redis://…``: stored responses shared by every replica that names the same
Redis (``server/responses_store.py`` says what is kept).

Keys, each ``PX`` the record's TTL unless said otherwise: the record ``ferry:response:{id}`` (its
JSON); a background response's events, the stream ``ferry:response-events:{id}`` (entry id
``0-{sequence_number + 1}``, field ``e`` the SSE frame, ``MAXLEN`` ``EVENT_LOG_LIMIT``); its cancel
flag ``ferry:response-cancel:{id}``; the lease of the process running it
``ferry:response-lease:{id}`` (``PX`` the lease's own short TTL, ``server/responses_lease.py``);
each item of a record, ``ferry:response-item:{item id}`` = the id of the latest record written that
holds it (left to expire when that record is deleted: ``find_item`` then finds no record).
Every call that fails raises ``StoreUnavailable``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

from kvcache.tier import redact_url
from server.responses_store import (
    EVENT_LOG_LIMIT,
    EVENT_READ_BATCH,
    StoreUnavailable,
    encode,
    item_ids,
    says_running,
)

KEY_PREFIX = "ferry:response:"
EVENTS_PREFIX = "ferry:response-events:"
CANCEL_PREFIX = "ferry:response-cancel:"
LEASE_PREFIX = "ferry:response-lease:"
ITEM_PREFIX = "ferry:response-item:"


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class RedisResponseStore:
    """``--responses-store redis://…``: records shared by every replica using that Redis."""

    shared = True

    def __init__(self, url: str, ttl_s: float) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        from kvcache.redis_tier import client_url

        self.url = url
        self.ttl_ms = _ms(ttl_s)
        # One retry on a new connection: a restarted Redis leaves every pooled one dead, and each
        # would otherwise fail one request (a 503) on every replica.
        self._client = aioredis.from_url(
            client_url(url),  # the KV tier's URL, as `ferry up` passes it, with its parameters
            socket_timeout=2.0,
            socket_connect_timeout=2.0,
            retry=Retry(NoBackoff(), 1),
        )

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        try:
            yield
        except Exception as e:  # noqa: BLE001 - any client failure is an unavailable store
            # the message reaches clients (a 503) and logs: never the URL's password
            raise StoreUnavailable(f"the response store at {redact_url(self.url)} failed: {e}") from e

    async def get(self, response_id: str) -> dict[str, Any] | None:
        with self._failing():
            data = await self._client.get(KEY_PREFIX + response_id)
        return None if data is None else json.loads(data)

    async def put(self, response_id: str, record: dict[str, Any]) -> bool:
        with self._failing():
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.set(KEY_PREFIX + response_id, encode(record), px=self.ttl_ms)
                for item_id in item_ids(record):
                    pipe.set(ITEM_PREFIX + item_id, response_id, px=self.ttl_ms)
                await pipe.execute()
        return True

    async def find_item(self, item_id: str) -> dict[str, Any] | None:
        with self._failing():
            response_id = await self._client.get(ITEM_PREFIX + item_id)
            data = None if response_id is None else await self._client.get(KEY_PREFIX + response_id.decode())
        return None if data is None else json.loads(data)

    async def delete(self, response_id: str) -> bool:
        with self._failing():
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.delete(KEY_PREFIX + response_id)
                pipe.delete(
                    EVENTS_PREFIX + response_id, CANCEL_PREFIX + response_id, LEASE_PREFIX + response_id
                )
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

    async def claim(self, response_id: str, ttl_s: float) -> None:
        with self._failing():
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.delete(CANCEL_PREFIX + response_id)
                pipe.set(LEASE_PREFIX + response_id, b"1", px=_ms(ttl_s))
                await pipe.execute()

    async def renew_leases(self, response_ids: list[str], ttl_s: float) -> None:
        # SET, not PEXPIRE: a live process whose lease lapsed (a stalled loop) takes it again.
        with self._failing():
            async with self._client.pipeline(transaction=False) as pipe:
                for rid in response_ids:
                    pipe.set(LEASE_PREFIX + rid, b"1", px=_ms(ttl_s))
                await pipe.execute()

    async def lease_held(self, response_id: str) -> bool:
        with self._failing():
            return bool(await self._client.exists(LEASE_PREFIX + response_id))

    async def replace_orphan(self, response_id: str, record: dict[str, Any]) -> bool:
        # Optimistic: WATCH the record and the lease, check, then SET in MULTI/EXEC, which Redis
        # refuses if either changed since (a renewal, the owner's own write, another reader's).
        from redis.exceptions import WatchError

        key, lease = KEY_PREFIX + response_id, LEASE_PREFIX + response_id
        with self._failing():
            async with self._client.pipeline(transaction=True) as pipe:
                await pipe.watch(key, lease)
                data = await pipe.get(key)
                if data is None or await pipe.exists(lease) or not says_running(data):
                    return False
                pipe.multi()
                pipe.set(key, encode(record), px=self.ttl_ms)
                try:
                    await pipe.execute()
                except WatchError:
                    return False
        return True

    async def events_end(self, response_id: str) -> int:
        with self._failing():
            last = await self._client.xrevrange(EVENTS_PREFIX + response_id, "+", "-", count=1)
        return int(last[0][0].split(b"-")[1]) if last else 0  # entry 0-(seq + 1): seq + 1

    async def close(self) -> None:
        await self._client.aclose()
