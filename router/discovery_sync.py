"""Keeps the router's pools in step with a discovery backend.

Every ``interval`` seconds: replicas the backend lists and the router lacks are added (and probed
before they take traffic); replicas the router added from discovery that the backend no longer
lists are removed (requests already relayed to them finish). Replicas added with ``--replica`` or
the admin API are never removed by discovery. A backend error keeps the previous view.

A source of truth (Kubernetes, DNS) is followed at once. Heartbeat registrations (Redis) are not
one: a Redis that restarts without persistence, fills up under ``noeviction`` (refusing the
heartbeats) or hangs past the TTL loses the keys of every replica at once while they all serve, and
dropping them would turn a Redis hiccup into a total outage. So a replica missing from such a
listing (``Listing.authoritative`` false) is removed only when

* it deregistered (``Listing.departed``: a replica's clean shutdown writes it), at once;
* after ``grace`` (a heartbeat interval and a poll, time for a restarted Redis to get every live
  replica's key back): when the router's own health probes no longer find it healthy (a replica
  that is really gone is ejected by them anyway), or when its key has stayed away for ``grace``
  while the source kept refreshing registrations (``Listing.refreshing``: other replicas'
  heartbeats land, so its own stopped).

Otherwise it stays, routed as its probes say, for as long as the registrations cannot be written.
This is Envoy's rule for eventually consistent discovery (absent but passing health checks: keep
routing), plus an explicit deregistration so a clean shutdown is still followed at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.discovery import Discovery, Listing
from router.pool import Replicas
from router.replica import Health, Replica
from server.task_cancel import cancel_and_wait

log = logging.getLogger("ferry.router")


@dataclass
class _Missing:
    """A discovered replica its (non-authoritative) backend no longer lists."""

    since: float  # the first poll it was missing from
    refreshed_since: float | None = None  # since when the others' registrations kept being refreshed
    reported: bool = False  # "kept while its probes pass" logged


class DiscoverySync:
    def __init__(
        self,
        discovery: Discovery,
        replicas: Replicas,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.discovery = discovery
        self.replicas = replicas
        self.interval = interval
        self.clock = clock
        self._task: asyncio.Task | None = None
        self.errors = 0
        self._refused: set[str] = set()  # URLs already logged as unusable
        self._missing: dict[str, _Missing] = {}

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ferry-router-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)  # redis-py can swallow one cancellation
        await self.discovery.close()

    async def sync_once(self) -> None:
        listing = await self.discovery.poll()
        now = self.clock()
        seen = set()
        for d in listing.replicas:
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
        missing: dict[str, _Missing] = {}
        for r in list(self.replicas):
            if r.source != "discovery" or r.url in seen:
                continue
            reason = self._gone(r, listing, now)
            if reason is None:
                missing[r.url] = self._missing[r.url]
                continue
            self.replicas.remove(r.url)
            log.warning("replica %s left discovery (%s)", r.url, reason)
        self._missing = missing  # back in the listing, or removed: forgotten

    def _gone(self, r: Replica, listing: Listing, now: float) -> str | None:
        """Why ``r``, a discovered replica ``listing`` lacks, is gone; None to keep it."""
        if listing.authoritative:
            return "no longer listed"
        if r.url in listing.departed:
            return "deregistered"
        m = self._missing.setdefault(r.url, _Missing(since=now))
        if not listing.refreshing:
            m.refreshed_since = None
        elif m.refreshed_since is None:
            m.refreshed_since = now
        grace = listing.grace_s + self.interval
        if now - m.since < grace:
            return None
        if r.health is not Health.HEALTHY:
            return "registration gone and health probes failing"
        if m.refreshed_since is not None and now - m.refreshed_since >= grace:
            return "its registration stopped while others' are refreshed"
        if not m.reported:
            m.reported = True
            log.warning(
                "replica %s: registration gone while the discovery source keeps none fresh (restarted,"
                " full or hung?); kept while its health probes pass",
                r.url,
            )
        return None

    def source_failed(self) -> None:
        """The backend could not be read: what it refreshed meanwhile is unknown."""
        for m in self._missing.values():
            m.refreshed_since = None

    async def _run(self) -> None:
        while True:
            try:
                await self.sync_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # backend outage: keep the current view, try again
                self.errors += 1
                self.source_failed()
                if self.errors == 1 or self.errors % 60 == 0:
                    log.warning(
                        "discovery %s failed (%d times): %s", type(self.discovery).__name__, self.errors, e
                    )
            await asyncio.sleep(self.interval)
