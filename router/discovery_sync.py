"""Keeps the router's pools in step with a discovery backend.

Every ``interval`` seconds: replicas the backend lists and the router lacks are added (and probed
before they take traffic); replicas the router added from discovery that the backend no longer
lists are removed (requests already relayed to them finish). Replicas added with ``--replica`` or
the admin API are never removed by discovery. A backend error keeps the previous view.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from router.discovery import Discovery
from router.pool import Replicas

log = logging.getLogger("ferry.router")


class DiscoverySync:
    def __init__(self, discovery: Discovery, replicas: Replicas, interval: float) -> None:
        self.discovery = discovery
        self.replicas = replicas
        self.interval = interval
        self._task: asyncio.Task | None = None
        self.errors = 0
        self._refused: set[str] = set()  # URLs already logged as unusable

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ferry-router-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.discovery.close()

    async def sync_once(self) -> None:
        listed = await self.discovery.list_replicas()
        seen = set()
        for d in listed:
            seen.add(d.url)
            existing = self.replicas.find(d.url)
            if existing is None:
                try:
                    self.replicas.add(d.url, d.role, source="discovery")
                except ValueError as e:  # one bad entry must not stop the rest of the sync
                    if d.url not in self._refused:
                        self._refused.add(d.url)
                        log.warning("ignoring discovered replica: %s", e)
                    continue
                log.warning("discovered replica %s (%s)", d.url, d.role)
        for r in list(self.replicas):
            if r.source == "discovery" and r.url not in seen:
                self.replicas.remove(r.url)
                log.warning("replica %s left discovery", r.url)

    async def _run(self) -> None:
        while True:
            try:
                await self.sync_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # backend outage: keep the current view, try again
                self.errors += 1
                if self.errors == 1 or self.errors % 60 == 0:
                    log.warning(
                        "discovery %s failed (%d times): %s", type(self.discovery).__name__, self.errors, e
                    )
            await asyncio.sleep(self.interval)
