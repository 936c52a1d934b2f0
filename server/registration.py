"""Announce this replica to routers through a Redis heartbeat (``ferry serve --register redis://…``).

Wire format (read by ``router/discovery_redis.py``; both sides must agree):

* key   ``ferry:replica:{url}``, e.g. ``ferry:replica:http://10.0.0.7:8000``
* value JSON ``{"url": "http://10.0.0.7:8000", "role": "mixed|prefill|decode",
  "model": "<served model name>", "started": <unix seconds, float>}``
* ``SET key value EX 6`` every 2 s while serving; ``DEL key`` when draining starts, so routers
  stop sending new work before the replica goes away. A replica that dies vanishes within the
  TTL by itself.

Redis being down never stops the replica from serving: failed heartbeats are logged and retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

logger = logging.getLogger("ferry.server")

KEY_PREFIX = "ferry:replica:"


def replica_key(url: str) -> str:
    return KEY_PREFIX + url


def replica_value(url: str, role: str, model: str, started: float) -> str:
    return json.dumps({"url": url, "role": role, "model": model, "started": started})


class Registration:
    """A background heartbeat task owning one Redis key."""

    def __init__(
        self, redis_url: str, url: str, role: str, model: str, interval_s: float = 2.0, ttl_s: float = 6.0
    ) -> None:
        self.redis_url = redis_url
        self.key = replica_key(url)
        self.value = replica_value(url, role, model, time.time())
        self.interval_s = interval_s
        self.ttl_ms = int(ttl_s * 1000)
        self._client: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        import redis.asyncio as aioredis

        self._client = aioredis.from_url(self.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        await self._beat()  # registered before start() returns: a router can find us at once
        self._task = asyncio.ensure_future(self._loop())

    async def _beat(self) -> None:
        try:
            await self._client.set(self.key, self.value, px=self.ttl_ms)
        except Exception as e:  # Redis down: keep serving, keep trying
            logger.warning("replica heartbeat to %s failed: %s", self.redis_url, e)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self._beat()

    async def stop(self) -> None:
        """Stop the heartbeat and delete the key (routers stop sending new work)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._client is not None:
            try:
                await self._client.delete(self.key)
            except Exception as e:
                logger.warning("could not delete replica key %s: %s", self.key, e)
            await self._client.aclose()
            self._client = None
