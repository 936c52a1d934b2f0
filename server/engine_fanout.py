"""What the engine process sends every API server at once (``server/engine_host.py``'s
``EngineHost`` is built on it): the engine's stats and health with the other API servers'
sequences and load (``("stats", …)``, within ``BROADCAST_DELAY_S`` of news that could change an
admission, else every ``STATS_INTERVAL_S``), a heartbeat every ``HEARTBEAT_S``, the served LoRA
adapters, and probes through every API server's event loop (``("probe", token)``: a burst being
gathered, an adapters' broadcast taken in).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from server.admission import queued_after, running_slots

if TYPE_CHECKING:
    from server.engine_host import _ApiServer

# How often idle connections hear of changed stats or health (outputs carry them when busy).
STATS_INTERVAL_S = 0.1
HEARTBEAT_S = 1.0  # at least one message this often to every API server (server/engine_client.py)
# News for the other API servers (a step's stats, a request added or ended elsewhere) waits this
# long to go out with whatever follows: a burst's requests come in one by one, and a broadcast
# per arrival would cost every API server a frame to read per request of the burst while it is
# still parsing its own share. Sequences added or ended elsewhere with no new stats (a burst taken
# in while the idle engine gathers it) wait for STATS_INTERVAL_S unless the queue is at least half
# of the admission limit, or was when last told: a frame costs tens of microseconds to write here
# and to read there, and a wave of 32 requests made ten such broadcasts. An API server's own
# outputs always carry fresh stats.
BROADCAST_DELAY_S = 0.002


class ApiServerFanout:
    """The stats, heartbeats, adapters and probes ``EngineHost`` sends to its API servers (the state
    it reads is ``EngineHost``'s, set up by its ``__init__``)."""

    engine: Any
    max_queued_requests: int | None
    _max_running: int
    _servers: set[_ApiServer]
    _broadcast_scheduled: bool
    _told_busy: bool
    _load: int
    _probe_ids: Iterator[int]
    _probes: dict[int, tuple[set[_ApiServer], Callable[[], None]]]

    async def _broadcast_loras(self) -> None:
        """The served adapters to every API server, whole (the only writer of their copies,
        ``EngineClient.served_loras``, in the order of the changes); returns once every one has
        taken them in: a probe through its loop, answered after the message sent before it. The
        frames to the API servers leave one by one, and one may be read after the reply to the
        call's API server has reached its client, who then finds an adapter it loaded missing
        (or one it unloaded still there) through another API server."""
        served = dict(self.engine.served_loras)
        for conn in self._servers:
            conn.channel.send(("loras", served))
        taken_in = asyncio.get_running_loop().create_future()
        self._probe_api_servers(lambda: taken_in.done() or taken_in.set_result(None))
        await taken_in

    def _probe_api_servers(self, back: Callable[[], None]) -> None:
        """``AsyncEngine.probe_submitters``: ask every API server to pass its event loop twice (the
        passes that turn requests it has received into announcements) and answer; ``back`` once
        all did (a burst's requests spread over all of them). Each has then also taken in what
        was sent to it before (``_broadcast_loras``)."""
        servers = {conn for conn in self._servers if not conn.channel.closed}
        if not servers:
            back()
            return
        token = next(self._probe_ids)
        self._probes[token] = (servers, back)
        for conn in servers:
            conn.channel.send(("probe", token))

    def _probe_answered(self, token: int, conn: _ApiServer) -> Callable[[], None] | None:
        """Record ``conn``'s answer; the probe's ``back`` once every API server answered."""
        probe = self._probes.get(token)
        if probe is None:
            return None
        probe[0].discard(conn)
        if probe[0]:
            return None
        del self._probes[token]
        if conn.channel.closed:  # from the closing connection's cleanup: nothing else to wait for
            probe[1]()
            return None
        return probe[1]

    @staticmethod
    def _sequences(conn: _ApiServer) -> int:
        """One API server's sequences: in the engine (those in a lease counted by it), admitted
        and on their way, or leased."""
        return len(conn.requests) - len(conn.leased) + conn.places.num_held

    def _in_flight(self) -> int:
        """Every API server's sequences: in the engine, or admitted and on their way."""
        return sum(self._sequences(conn) for conn in self._servers)

    def _queue_busy(self) -> bool:
        """Whether the engine's queue is at least half of the API servers' admission limit: the
        sequences beyond its batch slots (as ``Generation.queued`` counts them) or its waiting ones."""
        limit = self.max_queued_requests
        if limit is None:
            return True
        stats = self.engine.stats()
        queued = queued_after(self._in_flight(), running_slots(self._max_running, stats), stats.num_waiting)
        return 2 * queued >= limit

    def _send_stats(self, conn: _ApiServer, counts: bool = True) -> None:
        """``conn``'s stats if they changed; the other API servers' sequences or load alone only if
        ``counts``."""
        stats, healthy = self.engine.stats(), self.engine.is_healthy()
        elsewhere = self._in_flight() - self._sequences(conn)
        load = self._load - conn.load
        if (
            stats is not conn.sent_stats
            or healthy != conn.sent_healthy
            or (counts and (elsewhere != conn.sent_elsewhere or load != conn.sent_load))
        ):
            conn.sent_stats, conn.sent_healthy = stats, healthy
            conn.sent_elsewhere, conn.sent_load = elsewhere, load
            conn.channel.send(("stats", stats, healthy, elsewhere, load))
            if not self._told_busy and self._queue_busy():
                self._told_busy = True

    def _broadcast_stats(self) -> None:
        """Within ``BROADCAST_DELAY_S`` of news: every API server admits by the engine's queue
        (``Generation.queued``), so each hears of a step or an abort, not only the one whose
        requests it concerned. The other API servers' sequences alone (requests added while an
        idle engine gathers a burst, or ended after the step that last published stats) are news
        only while they could change an admission; else they wait for ``publish_stats``."""
        if not self._broadcast_scheduled:
            self._broadcast_scheduled = True
            asyncio.get_running_loop().call_later(BROADCAST_DELAY_S, self._broadcast)

    def _broadcast(self) -> None:
        self._broadcast_scheduled = False
        if self._told_busy or self._queue_busy():
            self._send_all()
        else:
            for conn in self._servers:
                self._send_stats(conn, counts=False)

    def _send_all(self) -> None:
        told_busy = self._queue_busy()
        for conn in self._servers:
            self._send_stats(conn)
        self._told_busy = told_busy  # every API server now holds these counts

    async def publish_stats(self) -> None:
        """Keep every connection's stats and health current: news that could not change an
        admission, a dead engine loop, a finished abort; and a heartbeat every ``HEARTBEAT_S``, so an
        API server tells a stopped or wedged engine process from an idle one."""
        rounds_per_beat = max(1, round(HEARTBEAT_S / STATS_INTERVAL_S))
        for n in itertools.count(1):
            await asyncio.sleep(STATS_INTERVAL_S)
            self._send_all()
            if n % rounds_per_beat == 0:
                for conn in self._servers:
                    conn.channel.send(("beat",))
