"""The engine process's side of ``--api-server-count N``: one ``AsyncEngine`` served over a Unix
socket to the API server processes (``server/engine_client.py`` is the other end; the process's
entry point is ``server/engine_process.py``, the stats and probes it sends every API server are
``server/engine_fanout.py``'s).

``EngineHost`` runs each API server's requests through the same ``AsyncEngine`` an in-process
server uses (so burst gathering, aborts, structured outputs and stats behave the same), under
engine request ids namespaced by connection (``rid@N``: two API servers may both see a client's
``X-Request-Id``). Outputs are relayed from ``AsyncEngine.start``'s sink, in the event-loop pass
that delivered them: no task or generator per request (this loop shares the GIL with the engine's
thread). An API server that goes away has its requests aborted and its announcements withdrawn at
once; those requests are counted here as aborts (``vllm:request_success_total``, with the prompt and
generation tokens they had, as their API server would have counted them), since no process that
saw them is left to.

Messages from an API server: ``("add", rid, admission, prompt_ids, params, resume_ids, kv_transfer,
pooling, lora_request, priority, cache_salt, images)`` (``prompt_ids``: a tensor for prompt
embeddings; ``admission``: the ``server.admission.Admission`` (key, number of sequences, lease) of
the HTTP request it belongs to, or None), ``("release", key)`` (that request ended before
all its sequences were sent, or a leasing one ended), ``("beam_end", key, prompt_index)`` (it
counted that beam search of the leasing request ``key``), ``("announce", token)``, ``("submitted", token)``,
``("probe_back", token)``, ``("load", requests)`` (its requests on the engine's routes, for the
others' ``GET /load``), ``("call", call_id, name, arg)`` (answered by ``server/engine_calls.py``)
with ``name`` one of ``abort`` / ``compile`` / ``reset_prefix_cache`` / ``store`` (``arg``: a
``MemoryRecords`` method's name and arguments) / ``add_lora`` / ``remove_lora`` / ``sleep`` /
``wake_up`` / ``pause`` / ``resume`` / ``start_profile`` / ``stop_profile`` / ``reload_weights``. To it:
``("hello", facts)`` first, ``("loras", served)`` to every API server after each ``add_lora`` /
``remove_lora`` call (its reply waits until every API server answered a probe sent after it),
``("model_info", ModelInfo)`` to every API server after a weight update (its fingerprint changed),
``("probe", token)`` (an idle engine gathering a burst, or the adapters' broadcast: answer after
two passes of the event loop), then
``("out", rid, RequestOutput)``, ``("err", rid, kind, message)`` (``kind``: ``value``, a bad request;
``overloaded``, refused by admission; ``dead``; ``other``), ``("reply", call_id, ok, value)``
and ``("stats", EngineStats, healthy, sequences_elsewhere, load_elsewhere)`` whenever the engine
published new stats or the other API servers' sequences changed (before a request's own output,
and to every API server within ``BROADCAST_DELAY_S`` of the news; the others' sequences alone
within ``STATS_INTERVAL_S`` while the queue is under half of ``--max-queued-requests``, and their
load alone within ``STATS_INTERVAL_S``): each API server admits requests (``Generation.queued``)
counting the others' too, and answers ``GET /load`` with the others' load added.

Admission (``server/admission.py``) is decided here for good: each API server's own check uses
counts up to ``BROADCAST_DELAY_S`` old, so requests reaching several at once could all pass it.
The first sequence of a request to arrive is checked against every API server's sequences (the
engine's, and the places held for sequences of admitted requests still on their way); the
request's other sequences take the places held for them, or are refused with it. No extra round
trip: a refusal comes back as the stream's first message, like a bad request's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.errors import EngineDeadError
from server.admission import Admission, HeldPlaces, overload_message, running_slots
from server.engine_calls import EngineCalls
from server.engine_fanout import ApiServerFanout
from server.engine_ipc import Channel
from server.metrics import ServerMetrics
from server.orphan_counts import BeamTallies, Tally, count_orphans
from server.responses_memory import MemoryRecords

logger = logging.getLogger("ferry.engine_process")


@dataclass(eq=False)
class _ApiServer:
    index: int
    channel: Channel
    # Its requests in the engine (request id -> None), or waiting for their structured-outputs
    # constraint to compile (-> that task).
    requests: dict[str, asyncio.Task[None] | None] = field(default_factory=dict)
    announced: dict[int, Callable[[], None]] = field(default_factory=dict)
    load: int = 0  # its requests on the engine's routes, as it last said ("load")
    places: HeldPlaces = field(default_factory=HeldPlaces)  # of its requests of several sequences
    # Its requests (in ``requests``) that run in a lease (beam search steps; -> the lease's key):
    # counted in ``places`` while the lease lasts.
    leased: dict[str, int] = field(default_factory=dict)
    tallies: dict[str, Tally] = field(default_factory=dict)  # of its requests in ``requests``
    beams: BeamTallies = field(default_factory=BeamTallies)  # its beam searches it has not counted
    # Its requests it asked to abort: it counted them already (``Generation.stream``).
    aborting: set[str] = field(default_factory=set)
    sent_stats: Any = None
    sent_healthy: bool = True
    sent_elsewhere: int = 0
    sent_load: int = 0


class EngineHost(EngineCalls, ApiServerFanout):
    """Serves one ``AsyncEngine`` to any number of API server connections."""

    def __init__(
        self,
        engine: Any,
        responses: MemoryRecords | None = None,
        max_queued_requests: int | None = None,
        metrics: ServerMetrics | None = None,
    ) -> None:
        """``metrics``: where the requests of an API server that died are counted (the engine
        process's share of the replica's metrics, ``server/engine_process.py``)."""
        self.engine = engine
        self.metrics = metrics
        self.responses = responses  # --responses-store memory: kept here for every API server
        # The API servers' admission limit (None: unknown, every change is news at once).
        self.max_queued_requests = max_queued_requests
        self._max_running = int(getattr(engine.config, "max_num_seqs", 0) or 0)
        self._servers: set[_ApiServer] = set()
        self._next_index = 0
        self._broadcast_scheduled = False
        self._told_busy = False  # an API server may hold counts from a busy queue
        self._load = 0  # every API server's ``load``
        self._probe_ids = itertools.count()
        self._probes: dict[int, tuple[set[_ApiServer], Callable[[], None]]] = {}
        engine.probe_submitters = self._probe_api_servers

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One API server's connection, until it closes."""
        conn = _ApiServer(self._next_index, Channel(reader, writer))
        self._next_index += 1
        self._servers.add(conn)
        engine = self.engine
        conn.sent_stats, conn.sent_healthy = engine.stats(), engine.is_healthy()
        conn.channel.send(
            (
                "hello",
                {
                    "config": engine.config,
                    "model_info": engine.model_info,
                    "model_dir": str(engine.engine.model_dir),
                    "tokenizer_dir": str(engine.engine.tokenizer_dir),
                    "stats": conn.sent_stats,
                    "healthy": conn.sent_healthy,
                    "loras": dict(engine.served_loras),
                    "instance_id": engine.instance_id,
                },
            )
        )
        logger.info("API server connection %d open", conn.index)
        try:
            loop = asyncio.get_running_loop()
            while (frame := await conn.channel.receive()) is not None:
                after_adds: list[Callable[[], None]] = []
                for message in frame:
                    self._dispatch(conn, message, after_adds)
                if after_adds:
                    # Once the adds of this frame reached the engine (their tasks start first): an
                    # engine gathering a burst stops waiting when nothing announced is unsubmitted
                    # and its probe is back.
                    loop.call_soon(_call_all, after_adds)
        finally:
            conn.channel.close()
            self._servers.discard(conn)
            self._load -= conn.load
            for token in list(self._probes):  # answered, as far as this API server goes
                self._probe_answered(token, conn)
            for rid, compiling in conn.requests.items():
                if compiling is not None:
                    compiling.cancel()
                else:
                    engine.cancel(f"{rid}@{conn.index}")
            for submitted in conn.announced.values():
                submitted()
            count_orphans(self.metrics, conn)
            logger.info(
                "API server connection %d closed (%d request(s) aborted)", conn.index, len(conn.requests)
            )

    def _dispatch(
        self, conn: _ApiServer, message: tuple[Any, ...], after_adds: list[Callable[[], None]]
    ) -> None:
        kind = message[0]
        if kind == "add":
            self._add(conn, message[1], message[2], message[3:])
            self._broadcast_stats()  # the others' admission counts this one
        elif kind == "release":
            self._release(conn, message[1])
        elif kind == "beam_end":
            conn.beams.end(message[1], message[2])
        elif kind == "announce":
            conn.announced[message[1]] = self.engine.announce()
        elif kind == "submitted":
            done = conn.announced.pop(message[1], None)
            if done is not None:
                after_adds.append(done)
        elif kind == "probe_back":
            back = self._probe_answered(message[1], conn)
            if back is not None:
                after_adds.append(back)
        elif kind == "call":
            if message[2] == "abort" and message[3] in conn.requests:
                conn.aborting.add(message[3])
            asyncio.ensure_future(self._call(conn, message[1], message[2], message[3]))
        elif kind == "load":  # news for the others with the next stats (publish_stats at the latest)
            self._load += message[1] - conn.load
            conn.load = message[1]
        else:
            logger.error("unknown message %r from API server %d", kind, conn.index)

    def _add(
        self, conn: _ApiServer, rid: str, admission: tuple[int, int] | None, request: tuple[Any, ...]
    ) -> None:
        """An "add" message's request: ``(prompt_ids, params, resume_ids, kv_transfer, pooling,
        lora_request, priority, cache_salt, images)``."""
        if admission is not None and not self._admitted(conn, rid, admission, request[4]):
            return
        if rid in conn.requests:
            conn.channel.send(("err", rid, "value", f"request id {rid!r} is already in use"))
            return
        leasing = Admission(*admission) if admission is not None else None
        if leasing is not None and leasing.lease:
            conn.leased[rid] = leasing.key
            if leasing.beam is not None:
                conn.beams.step(rid, leasing.key, leasing.beam)
        prompt = request[0]
        conn.tallies[rid] = Tally(len(prompt) if isinstance(prompt, list) else int(prompt.shape[0]))
        lora = request[5]
        if (
            request[1].structured_outputs is not None
            or (lora is not None and self.engine.engine.cached_lora(lora) is None)
            or request[8]
            or not isinstance(request[0], list)
        ):  # a constraint to compile, an adapter to read, images or prompt embeddings to process:
            # off this loop first
            conn.requests[rid] = asyncio.ensure_future(self._prepare_then_start(conn, rid, request))
        else:
            conn.requests[rid] = None
            self._start(conn, rid, request)

    def _admitted(self, conn: _ApiServer, rid: str, admission: tuple[Any, ...], pooling: bool) -> bool:
        """Whether sequence ``rid`` of the request ``admission`` names may run; refused, it is
        answered so. A request is checked at its first sequence here, as a whole."""
        key, size, lease, _ = Admission(*admission)
        known = conn.places.take(key)
        if known is None:
            limit = self.max_queued_requests
            refusal = None
            if limit is not None:
                stats = self.engine.stats()
                slots = running_slots(self._max_running, stats)
                refusal = overload_message(
                    self._in_flight(), slots, stats.num_waiting, size, limit, pooling, self._max_running
                )
            conn.places.decide(key, size, refusal is None, lease)
            if refusal is None:
                return True
        elif known:
            return True
        else:
            refusal = "Server is overloaded: this request's other sequences were refused. Retry later."
        conn.channel.send(("err", rid, "overloaded", refusal))
        return False

    def _release(self, conn: _ApiServer, key: int) -> None:
        """The request ``key`` ended: the places still held for its sequences are free (its
        leased steps still ending, aborted, count as themselves until they end)."""
        for rid in [rid for rid, lease in conn.leased.items() if lease == key]:
            del conn.leased[rid]
        conn.beams.release(key)
        if conn.places.release(key):
            self._broadcast_stats()

    async def _prepare_then_start(self, conn: _ApiServer, rid: str, request: tuple[Any, ...]) -> None:
        grammar = None
        try:
            if request[1].structured_outputs is not None:
                grammar = await self.engine.compile_structured(request[1].structured_outputs)
            if request[8]:
                request = (*request[:8], await self.engine.process_images(request[8]))
            if not isinstance(request[0], list):
                request = (await self.engine.prepare_prompt_embeds(request[0]), *request[1:])
            # Last, with nothing awaited between it and ``_start``: other requests' adapters,
            # loaded meanwhile, could evict it (``max_cpu_loras``), and ``start`` would read it
            # again on this loop.
            if request[5] is not None:
                await self.engine.load_lora(request[5])
        except Exception as e:  # noqa: BLE001 - reported to the request (ValueError: not a valid one)
            self._failed(conn, rid, e)
            return
        if conn.requests.get(rid) is asyncio.current_task():
            conn.requests[rid] = None
            self._start(conn, rid, request, grammar)

    def _start(self, conn: _ApiServer, rid: str, request: tuple[Any, ...], grammar: Any = None) -> None:
        prompt, params, resume_token_ids, kv_transfer, pooling, lora_request, priority, cache_salt, images = (
            request
        )
        send = conn.channel.send
        tally = conn.tallies[rid]

        def relay(out: Any) -> None:
            if isinstance(out, BaseException):
                self._failed(conn, rid, out)
                return
            if out.outputs:
                tally.generated += len(out.outputs[0].token_ids)
            out.request_id = rid
            out.prompt_token_ids = None  # its API server has them: not sent with every token
            self._send_stats(conn)  # before the output: a final output finds its stats there
            send(("out", rid, out))
            if out.finished:
                conn.beams.ended(rid, out)
                self._ended(conn, rid)
            self._broadcast_stats()

        try:
            self.engine.start(
                f"{rid}@{conn.index}",
                prompt,
                params,
                relay,
                resume_token_ids=resume_token_ids,
                kv_transfer=kv_transfer,
                grammar=grammar,
                pooling=pooling,
                lora_request=lora_request,
                priority=priority,
                cache_salt=cache_salt,
                images=images,
            )
        except Exception as e:  # noqa: BLE001 - reported to the request (ValueError: bad input)
            self._failed(conn, rid, e)

    def _failed(self, conn: _ApiServer, rid: str, error: BaseException) -> None:
        """End request ``rid`` with ``error``: ValueError is the client's (a 400 there)."""
        self._ended(conn, rid)
        if isinstance(error, ValueError):
            conn.channel.send(("err", rid, "value", str(error)))
        elif isinstance(error, EngineDeadError):
            conn.channel.send(("err", rid, "dead", str(error)))
        else:
            logger.error("request %s failed", rid, exc_info=error)
            conn.channel.send(("err", rid, "other", repr(error)))
        self._broadcast_stats()  # the others' admission; a dead engine: every /health turns 503

    @staticmethod
    def _ended(conn: _ApiServer, rid: str) -> None:
        conn.requests.pop(rid, None)
        conn.leased.pop(rid, None)
        conn.tallies.pop(rid, None)
        conn.aborting.discard(rid)
        conn.beams.ended(rid, None)


def _call_all(functions: list[Callable[[], None]]) -> None:
    for function in functions:
        function()
