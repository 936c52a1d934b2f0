"""Announce this replica to routers through a Redis heartbeat (``ferry serve --register redis://…``).

Wire format (read by ``router/discovery_redis.py``; both sides must agree):

* key   ``ferry:replica:{url}``, e.g. ``ferry:replica:http://10.0.0.7:8000``
* value JSON ``{"url": "http://10.0.0.7:8000", "role": "mixed|prefill|decode",
  "model": "<served model name>", "started": <unix seconds, float>}``
* ``SET key value PX 6000`` every 2 s while serving. A Redis that refuses it (full under
  ``noeviction``: ``SET`` may grow memory) still takes ``PEXPIRE key 6000``, which keeps the
  registration it holds from expiring under a replica that serves.
* When draining starts: ``SET ferry:replica-left:{url} {"url", "left"} PX 60000`` then ``DEL key``
  (not one transaction: a full Redis refuses the first, the second must still run). The
  deregistration tells routers to stop sending new work at once; a key that merely vanished (a
  Redis restarted, full or hung) makes them wait for their own health probes instead. The first
  registration deletes a deregistration left by an earlier run under the same URL. A replica that
  dies vanishes within the TTL by itself.

Redis being down never stops the replica from serving: failed heartbeats are logged and retried.
A ``--register`` URL may be the KV tier's, parameters and all (``kvcache.redis_tier.client_url``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from kvcache.log_limit import RateLimitedLog
from kvcache.tier import redact_url
from server.task_cancel import cancel_and_wait

logger = logging.getLogger("ferry.server")

KEY_PREFIX = "ferry:replica:"
DEPARTED_PREFIX = "ferry:replica-left:"
DEPARTED_TTL_MS = 60_000  # routers poll about once a second: long enough for every one to read it


def replica_key(url: str) -> str:
    return KEY_PREFIX + url


def departed_key(url: str) -> str:
    return DEPARTED_PREFIX + url


def replica_value(url: str, role: str, model: str, started: float) -> str:
    return json.dumps({"url": url, "role": role, "model": model, "started": started})


class Registration:
    """A background heartbeat task owning one Redis key."""

    def __init__(
        self, redis_url: str, url: str, role: str, model: str, interval_s: float = 2.0, ttl_s: float = 6.0
    ) -> None:
        self.redis_url = redis_url
        self.url = url
        self.key = replica_key(url)
        self.value = replica_value(url, role, model, time.time())
        self.interval_s = interval_s
        self.ttl_ms = int(ttl_s * 1000)
        self._client: Any = None
        self._task: asyncio.Task[None] | None = None
        self._registered = False  # a SET landed (and an earlier run's deregistration was deleted)
        # A refusal lasts (a full Redis, a read-only replica): said once a minute, not every beat.
        self._refusal_log = RateLimitedLog(logger, burst=1, window=60.0)

    async def start(self) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        from kvcache.redis_tier import client_url

        # One retry on a new connection: a restarted Redis leaves the pooled one dead, and the
        # registration would otherwise wait a heartbeat more to come back.
        self._client = aioredis.from_url(
            client_url(self.redis_url),
            socket_timeout=2.0,
            socket_connect_timeout=2.0,
            retry=Retry(NoBackoff(), 1),
        )
        await self._beat()  # registered before start() returns: a router can find us at once
        self._task = asyncio.ensure_future(self._loop())

    async def _beat(self) -> None:
        import redis.exceptions

        try:
            await self._client.set(self.key, self.value, px=self.ttl_ms)
            if not self._registered:
                await self._client.delete(departed_key(self.url))
                self._registered = True
        except redis.exceptions.ResponseError as e:  # reachable, but refusing the write
            kept = await self._keep_alive()
            if isinstance(e, redis.exceptions.ReadOnlyError):
                # A replica now (the old primary after a failover): the next beat connects anew, so
                # it reaches the new primary where the endpoint's name now points.
                await self._client.connection_pool.disconnect()
            self._refusal_log.warning(
                "replica heartbeat to %s refused: %s%s",
                redact_url(self.redis_url),
                e,
                " (the registration it holds was kept alive)" if kept else "",
            )
        except Exception as e:  # Redis down: keep serving, keep trying
            logger.warning("replica heartbeat to %s failed: %s", redact_url(self.redis_url), e)

    async def _keep_alive(self) -> bool:
        """Refresh the TTL of the key Redis holds (``PEXPIRE`` is not refused by a full Redis)."""
        try:
            return bool(await self._client.pexpire(self.key, self.ttl_ms))
        except Exception:  # noqa: BLE001 - a read-only replica refuses it too: the key will expire
            return False

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self._beat()

    async def stop(self) -> None:
        """Stop the heartbeat and deregister (routers stop sending new work)."""
        if self._task is not None:
            await cancel_and_wait(self._task)  # redis-py can swallow one cancellation
            self._task = None
        if self._client is not None:
            left = json.dumps({"url": self.url, "left": time.time()})
            try:
                async with self._client.pipeline(transaction=False) as pipe:
                    pipe.set(departed_key(self.url), left, px=DEPARTED_TTL_MS)
                    pipe.delete(self.key)
                    for reply in await pipe.execute(raise_on_error=False):
                        if isinstance(reply, Exception):
                            logger.warning("deregistering %s: %s", self.key, reply)
            except Exception as e:
                logger.warning("could not delete replica key %s: %s", self.key, e)
            await self._client.aclose()
            self._client = None
