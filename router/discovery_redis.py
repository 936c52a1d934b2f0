"""Replica discovery through Redis heartbeats (``--discovery redis://host:port/db``).

Wire format (the writer is ``ferry serve --register redis://…``):

* key   ``ferry:replica:{url}``  e.g. ``ferry:replica:http://10.0.0.7:8000``
* value JSON ``{"url": "http://10.0.0.7:8000", "role": "mixed|prefill|decode",
  "model": "<served model name>", "started": <unix seconds, float>}``
* the replica SETs it with ``EX 6`` every 2 s while it serves and DELetes it on clean shutdown,
  so a replica that dies vanishes within 6 s by itself.

The router SCANs ``ferry:replica:*`` about once a second. Malformed entries are skipped (logged
once), never fatal: a bad writer must not take healthy replicas out of the router.
"""

from __future__ import annotations

import json
import logging

from router.discovery import DiscoveredReplica, Discovery

log = logging.getLogger("ferry.router")

KEY_PREFIX = "ferry:replica:"
HEARTBEAT_INTERVAL_S = 2.0
HEARTBEAT_TTL_S = 6


def replica_key(url: str) -> str:
    return KEY_PREFIX + url


def replica_value(url: str, role: str, model: str | None, started: float) -> str:
    """The JSON a replica writes (kept here so writer and reader agree; tests use it)."""
    return json.dumps({"url": url, "role": role, "model": model, "started": started})


class RedisDiscovery(Discovery):
    def __init__(self, url: str) -> None:
        import redis.asyncio as aioredis

        self.url = url
        self.client = aioredis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._bad: set[bytes] = set()

    async def list_replicas(self) -> list[DiscoveredReplica]:
        keys = [k async for k in self.client.scan_iter(match=KEY_PREFIX + "*", count=500)]
        if not keys:
            return []
        values = await self.client.mget(keys)
        out: list[DiscoveredReplica] = []
        for key, raw in zip(keys, values, strict=True):
            if raw is None:  # expired between SCAN and MGET
                continue
            try:
                data = json.loads(raw)
                out.append(
                    DiscoveredReplica(
                        url=data["url"], role=data.get("role") or "mixed", model=data.get("model")
                    )
                )
            except (ValueError, KeyError, TypeError) as e:
                if key not in self._bad:
                    self._bad.add(key)
                    log.warning("ignoring malformed replica registration %r: %s", key, e)
        return out

    async def close(self) -> None:
        await self.client.aclose()
