"""Replica discovery through Redis heartbeats (``--discovery redis://host:port/db``).

Wire format (the writer is ``ferry serve --register redis://…``, ``server/registration.py``):

* key   ``ferry:replica:{url}``  e.g. ``ferry:replica:http://10.0.0.7:8000``
* value JSON ``{"url": "http://10.0.0.7:8000", "role": "mixed|prefill|decode",
  "model": "<served model name>", "started": <unix seconds, float>}``
* the replica SETs it with ``PX 6000`` every 2 s while it serves (a Redis that refuses the SET,
  full under ``noeviction``, still takes a ``PEXPIRE`` of the key it holds), so a replica that dies
  vanishes within 6 s by itself;
* on clean shutdown (draining) it SETs ``ferry:replica-left:{url}`` (``{"url", "left"}``, ``PX
  60000``) and DELetes its key: the deregistration, which a Redis losing keys never writes.

The router SCANs ``ferry:replica*`` about once a second and reads each registration with its
remaining TTL. A key missing is weak evidence: a restarted Redis (no persistence), a full one
refusing the heartbeats, a hung one that let keys expire, lose the registrations of replicas that
still serve. So a missing replica is removed when it deregistered, when its key stays away while
other registrations are being refreshed (its own heartbeat stopped), or when the router's own health
probes fail too (``router/discovery_sync.py``). Malformed entries are skipped (logged once), never
fatal: a bad writer must not take healthy replicas out of the router.
"""

from __future__ import annotations

import json
import logging

from router.discovery import DiscoveredReplica, Discovery, Listing, normalize_url

log = logging.getLogger("ferry.router")

KEY_PREFIX = "ferry:replica:"
DEPARTED_PREFIX = "ferry:replica-left:"
SCAN_MATCH = "ferry:replica*"  # both prefixes in one pass over the keyspace (the KV tier's too)
HEARTBEAT_INTERVAL_S = 2.0
HEARTBEAT_TTL_S = 6
DEPARTED_TTL_S = 60
# A registration refreshed within the last two heartbeat intervals has more than this left.
FRESH_PTTL_MS = int((HEARTBEAT_TTL_S - 2 * HEARTBEAT_INTERVAL_S) * 1000)


def replica_key(url: str) -> str:
    return KEY_PREFIX + url


def departed_key(url: str) -> str:
    return DEPARTED_PREFIX + url


def replica_value(url: str, role: str, model: str | None, started: float) -> str:
    """The JSON a replica writes (kept here so writer and reader agree; tests use it)."""
    return json.dumps({"url": url, "role": role, "model": model, "started": started})


class RedisDiscovery(Discovery):
    def __init__(self, url: str) -> None:
        import redis.asyncio as aioredis

        from kvcache.redis_tier import client_url

        self.url = url
        self.client = aioredis.from_url(client_url(url), socket_timeout=2.0, socket_connect_timeout=2.0)
        self._bad: set[bytes] = set()

    async def list_replicas(self) -> list[DiscoveredReplica]:
        return (await self.poll()).replicas

    async def poll(self) -> Listing:
        keys: list[bytes] = []
        departed: set[str] = set()
        async for key in self.client.scan_iter(match=SCAN_MATCH, count=500):
            if key.startswith(KEY_PREFIX.encode()):
                keys.append(key)
            elif key.startswith(DEPARTED_PREFIX.encode()):
                departed.add(normalize_url(key[len(DEPARTED_PREFIX) :].decode(errors="replace")))
        values: list[bytes | None] = []
        ttls: list[int] = []
        if keys:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.mget(keys)
                for key in keys:
                    pipe.pttl(key)
                values, *ttls = await pipe.execute()
        out: list[DiscoveredReplica] = []
        refreshing = False
        for key, raw, ttl in zip(keys, values, ttls, strict=True):
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
                continue
            refreshing = refreshing or ttl > FRESH_PTTL_MS
        return Listing(
            out,
            authoritative=False,
            departed=frozenset(departed),
            refreshing=refreshing,
            grace_s=HEARTBEAT_INTERVAL_S,
        )

    async def close(self) -> None:
        await self.client.aclose()
