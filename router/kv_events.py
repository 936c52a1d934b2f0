"""Exact cache knowledge for cache_aware: fold replicas' KV block events into the prefix index.

Replicas started with ``--kv-events`` publish block stored/removed/cleared events on Redis streams
``ferry:kv:events:{model_fingerprint}`` (``kvcache/events.py``). With ``--kv-tier redis://…`` the
router follows every such stream and applies *device* events of known replicas to the same
``PrefixIndex`` its routing history feeds: stored → the replica holds the blocks, removed → it no
longer does, cleared → it holds nothing. An event's ``replica`` field must be the replica's URL as
the router knows it (``ferry serve --advertise-url``); events of unknown replicas are counted and
skipped. Tier events are ignored here: every replica can load tier blocks, so they do not change
which replica is best.

The reader is redis-py's blocking client, so reads run in a worker thread; a Redis outage only
pauses exact updates (routing history keeps working) and is retried with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from router.discovery import normalize_url
from router.prefix_index import PrefixIndex

log = logging.getLogger("ferry.router")
STREAM_PATTERN = "ferry:kv:events:*"


class KVEventFollower:
    def __init__(
        self, redis_url: str, index: PrefixIndex, known_url: Callable[[str], bool], block_ms: int = 200
    ):
        from kvcache.redis_tier import client_url

        self.redis_url = redis_url
        self.client_url = client_url(redis_url)  # the router's --kv-tier: a tier URL, its parameters too
        self.index = index
        self.known_url = known_url
        self.block_ms = block_ms
        self.readers: dict[str, object] = {}  # stream name -> kvcache.events.KVEventReader
        self.applied = 0
        self.skipped = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ferry-router-kv-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for reader in self.readers.values():
            with contextlib.suppress(Exception):
                reader.close()  # type: ignore[attr-defined]

    def poll_once(self) -> int:
        """Discover streams, read what is new, apply it. Blocking: call from a worker thread."""
        import redis

        from kvcache.events import KVEventReader

        client = redis.Redis.from_url(self.client_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        try:
            streams = [k.decode() for k in client.scan_iter(match=STREAM_PATTERN, count=100)]
        finally:
            client.close()
        fresh = 0
        for name in streams:
            reader = self.readers.get(name)
            if reader is None:
                fingerprint = name.rsplit(":", 1)[1]
                reader = self.readers[name] = KVEventReader(self.client_url, fingerprint, start_id="0")
            for event in reader.read(count=10_000):  # type: ignore[attr-defined]
                fresh += self.apply(event)
        return fresh

    def apply(self, event) -> int:  # event: kvcache.events.KVEvent
        if event.medium != "device":
            return 0
        url = normalize_url(event.replica_id) if "://" in event.replica_id else event.replica_id
        if not self.known_url(url):
            self.skipped += 1
            return 0
        if event.kind == "cleared":
            self.index.drop_replica(url)
        else:
            hashes = [bytes.fromhex(h) for h in event.block_hashes]
            if event.kind == "stored":
                self.index.insert(hashes, url)
            else:
                self.index.remove(hashes, url)
        self.applied += 1
        return 1

    async def _run(self) -> None:
        delay = 0.2
        while True:
            try:
                fresh = await asyncio.to_thread(self.poll_once)
                delay = 0.2
                if not fresh:
                    await asyncio.sleep(0.2)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis outage: history-based routing continues meanwhile
                log.warning("reading KV events from %s failed: %s", self.redis_url, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
