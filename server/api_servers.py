"""`ferry serve --api-server-count N` (N > 1): one engine process, N API server processes.

With one process, the HTTP work of every request (parsing, validation, tokenizing, SSE writes)
runs on one event loop that also shares the GIL with the engine's loop thread; a burst of
requests is taken in one at a time. Here (vLLM's ``--api-server-count``):

* this process, the **supervisor**, binds the port, starts the engine process and, alongside it,
  N API server processes, and registers the replica (``--register``) once they serve; it restarts
  an API server that dies or goes silent (its event loop stopped: ``API_SERVER_SILENCE_S``), and
  stops everything if the engine process dies (the orchestrator restarts the replica: ``/health``
  has answered 503 since);
* the **engine process** (``server/engine_process.py``) loads the model and runs the one
  ``AsyncEngine`` behind a Unix socket;
* each **API server process** runs the whole OpenAI app over an ``EngineClient``
  (``server/engine_client.py``) on the connections the supervisor accepts on the replica's port
  and passes to it, to whichever API server holds the fewest (``server/conn_balance.py``).

Startup overlaps, as vLLM's: while the engine process loads the model, each API server process
imports the app and its libraries (most of its start), then waits on its pipe to the supervisor.
Once the engine says ready, the supervisor tells each one to go: it connects to the engine and
serves. If the engine cannot start, the API servers, which never served, are killed before the
engine's reason is printed (exit 2, as with one process); a signal meanwhile stops them likewise.
An API server started again later is told to go at once.

Prometheus metrics of every process go through prometheus-client's multiprocess mode (a private
directory in ``PROMETHEUS_MULTIPROC_DIR``): whichever API server answers ``/metrics`` reports the
whole replica's counters and histograms, and the engine's gauges from its latest stats.

SIGTERM (or Ctrl-C) to the supervisor: deregister, let each API server drain (``--drain-timeout``),
then stop the engine. A second signal makes the API servers stop at once. Children live in their
own process groups and die with the supervisor (``PR_SET_PDEATHSIG``), even on ``kill -9``.

This module is the supervisor; the children's entry points (and an API server's prepare, "go" and
beat) are in ``server/api_server_child.py``, the replica's socket in ``server/listen_socket.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from server.api_server_child import LOG_FORMAT, api_server_main, engine_main
from server.config import ServerConfig
from server.conn_balance import ConnectionBalancer
from server.listen_socket import bind_port, listen_unix
from server.main import usage_error

logger = logging.getLogger("ferry.server")

# An API server that died is started again, at most once per this many seconds.
RESTART_BACKOFF_S = 1.0
# How long the supervisor waits for an API server to serve, from its "go" (the engine serves).
API_SERVER_START_TIMEOUT_S = 120.0
# A serving API server's event loop tells the supervisor it runs every API_SERVER_BEAT_S
# (``server/api_server_child.py``); one silent for API_SERVER_SILENCE_S (stopped, or its loop
# blocked) is killed and started again: the connections it holds would hang, and it would go on
# taking new ones.
API_SERVER_SILENCE_S = 10.0


def run_api_servers(config: ServerConfig, engine_config: Any, count: int) -> int:
    """Run one replica as a supervisor, an engine process and ``count`` API server processes."""
    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
    uds = config.http.uds
    try:
        reservation = listen_unix(uds) if uds else bind_port(config.host, config.port)
    except OSError as e:
        where = uds or f"{config.host}:{config.port}"
        return usage_error(f"cannot listen on {where}: {e.strerror or e}")
    workdir = tempfile.mkdtemp(prefix="ferry-serve-")  # mode 0700: the engine socket lives here
    metrics_dir = os.path.join(workdir, "metrics")
    os.mkdir(metrics_dir)
    # Inherited by every child, read by prometheus-client when they import it.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    if not uds:
        config = dataclasses.replace(config, port=reservation.getsockname()[1])
    if config.batch_dir is None:  # one Batch API directory for every API server (server/batch_store.py)
        config = dataclasses.replace(config, batch_dir=os.path.join(workdir, "batches"))
    supervisor = Supervisor(config, engine_config, count, os.path.join(workdir, "engine.sock"), reservation)
    try:
        return asyncio.run(supervisor.run())
    finally:
        reservation.close()
        if uds:
            with contextlib.suppress(OSError):
                os.unlink(uds)
        shutil.rmtree(workdir, ignore_errors=True)


class Supervisor:
    def __init__(
        self,
        config: ServerConfig,
        engine_config: Any,
        count: int,
        engine_path: str,
        listener: socket.socket,
    ) -> None:
        self.config = config
        # Accepts on the replica's socket, hands each connection to an API server.
        self.balancer = ConnectionBalancer(listener, count)
        self.engine_config = engine_config
        self.count = count
        self.engine_path = engine_path
        self._ctx = multiprocessing.get_context("spawn")
        self.engine: BaseProcess | None = None
        self.api_servers: list[BaseProcess | None] = [None] * count
        self._started_at = [0.0] * count
        # Each API server's pipe: its messages ("ready", then a beat every API_SERVER_BEAT_S) and
        # ours ("go", once the engine serves); when its latest came, and whether it has said it serves.
        self._beats: list[Connection | None] = [None] * count
        self._heard = [0.0] * count
        self._serving = [False] * count
        self._engine_ready = False
        self._signals = 0
        self._stop = asyncio.Event()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            return await self._run()
        finally:
            self.balancer.stop()
            self._kill_all()

    async def _run(self) -> int:
        engine = self._start_engine()
        # They import and prepare while the engine loads; each connects once told to go.
        readies = [self._start_api_server(i) for i in range(self.count)]
        message = await self._engine_started(engine)
        if message[0] != "ready" or self._stop.is_set():
            self._kill_api_servers()  # none has served: nothing to drain, nothing more to print
            if message[0] == "error":
                return usage_error(message[1])
            return 0 if self._stop.is_set() else self._engine_died()
        self._engine_ready = True
        for index in range(self.count):
            self._go(index)
        for index, ready in enumerate(readies):
            message = await _receive(ready, self.api_servers[index], API_SERVER_START_TIMEOUT_S)
            if message != ("ready",):
                if self._stop.is_set():
                    return await self._shutdown()
                logger.error("API server %d did not start", index)
                return 1
            self._heard[index], self._serving[index] = time.monotonic(), True
        self.balancer.start()
        registration = None
        if self.config.register:
            from server.registration import Registration

            registration = Registration(
                self.config.register,
                self.config.url,
                self.config.role,
                self.config.served_model_name,
                self.config.register_interval,
                self.config.register_ttl,
            )
            await registration.start()
        logger.info(
            "serving %s on %s (role %s): engine process %d, %d API server processes",
            self.config.served_model_name,
            self.config.url,
            self.config.role,
            self.engine.pid if self.engine else -1,
            self.count,
        )
        try:
            while not self._stop.is_set():
                if self.engine is None or not self.engine.is_alive():
                    # In-flight requests have failed (503) already; let the API servers answer them.
                    await self._stop_api_servers(10.0)
                    return self._engine_died()
                self._kill_silent_api_servers()
                self._restart_dead_api_servers()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 0.2)
        finally:
            if registration is not None:
                await registration.stop()
        return await self._shutdown()

    # -- processes ---------------------------------------------------------------------------------

    def _start_engine(self) -> Connection:
        receiver, sender = self._ctx.Pipe(duplex=False)
        self.engine = self._ctx.Process(
            target=engine_main,
            args=(self.engine_config, self.engine_path, self.config, sender, os.getpid()),
            name="engine",
        )
        self.engine.start()
        sender.close()
        return receiver

    async def _engine_started(self, receiver: Connection) -> tuple[Any, ...]:
        """The engine process's first message (``("ready",)`` or ``("error", message)``), or
        ``("gone",)`` if it exited or a signal came first."""
        while True:  # loading a model takes a while: wake for signals meanwhile
            message = await _receive(receiver, self.engine, 0.5)
            if message is not None or not self.engine.is_alive() or self._stop.is_set():
                receiver.close()
                return message or ("gone",)

    def _start_api_server(self, index: int) -> Connection:
        ours, theirs = self._ctx.Pipe(duplex=True)
        channel = self.balancer.attach(index)
        # API servers never register (the supervisor does, once for the replica).
        config = dataclasses.replace(self.config, register=None)
        proc = self._ctx.Process(
            target=api_server_main,
            args=(index, config, self.engine_path, theirs, os.getpid(), channel),
            name=f"api-server-{index}",
        )
        proc.start()
        theirs.close()
        channel.close()  # the API server's end: its copy is its own (EOF here once it exits)
        self.api_servers[index] = proc
        self._started_at[index] = self._heard[index] = time.monotonic()
        if self._beats[index] is not None:
            self._beats[index].close()
        self._beats[index], self._serving[index] = ours, False
        if self._engine_ready:  # a restart: the engine serves already
            self._go(index)
        return ours

    def _go(self, index: int) -> None:
        """Tell a started API server the engine serves: it connects and serves (within
        API_SERVER_START_TIMEOUT_S from now)."""
        pipe = self._beats[index]
        if pipe is None:
            return
        with contextlib.suppress(OSError):  # it has exited: the caller's wait or the restart sees to it
            pipe.send(("go",))
        self._heard[index] = time.monotonic()

    def _kill_api_servers(self) -> None:
        for proc in self.api_servers:
            if proc is not None and proc.is_alive():
                proc.kill()
        for proc in self.api_servers:
            if proc is not None:
                proc.join(5.0)

    def _restart_dead_api_servers(self) -> None:
        for index, proc in enumerate(self.api_servers):
            if proc is None or proc.is_alive():
                continue
            if time.monotonic() - self._started_at[index] < RESTART_BACKOFF_S:
                continue
            logger.error(
                "API server %d (pid %s) exited with %s: starting it again", index, proc.pid, proc.exitcode
            )
            self._start_api_server(index)

    def _kill_silent_api_servers(self) -> None:
        """Kill an API server that has sent nothing for API_SERVER_SILENCE_S (or, starting, for
        API_SERVER_START_TIMEOUT_S): it is stopped or its event loop is blocked. It is started again."""
        now = time.monotonic()
        for index, proc in enumerate(self.api_servers):
            beats = self._beats[index]
            if proc is None or beats is None or not proc.is_alive():
                continue
            try:
                while beats.poll():
                    if beats.recv() == ("ready",):
                        self._serving[index] = True
                    self._heard[index] = now
            except (EOFError, OSError):  # it is exiting: the restart sees to it
                continue
            limit = API_SERVER_SILENCE_S if self._serving[index] else API_SERVER_START_TIMEOUT_S
            if now - self._heard[index] > limit:
                logger.error(
                    "API server %d (pid %s) sent nothing for %.0f s: killing it (it is started again)",
                    index,
                    proc.pid,
                    limit,
                )
                proc.kill()

    def _engine_died(self) -> int:
        code = self.engine.exitcode if self.engine is not None else None
        logger.error("the engine process exited (code %s): stopping the replica", code)
        return 1

    async def _stop_api_servers(self, timeout: float) -> None:
        for proc in self.api_servers:
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.api_servers:
            if proc is not None:
                await _join(proc, deadline - time.monotonic())

    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals == 1:
            logger.info(
                "signal %s: draining (up to %.0f s)", signal.Signals(sig).name, self.config.drain_timeout
            )
            self._stop.set()
            return
        logger.info("signal %s again: stopping now", signal.Signals(sig).name)
        for proc in self.api_servers:  # a second signal makes uvicorn stop without draining
            _signal(proc, signal.SIGTERM)

    async def _shutdown(self) -> int:
        """Drain the API servers, then stop the engine."""
        await self._stop_api_servers(self.config.drain_timeout + 10.0)
        _signal(self.engine, signal.SIGTERM)
        if self.engine is not None:
            await _join(self.engine, 30.0)
        return 0

    def _kill_all(self) -> None:
        self._kill_api_servers()
        if self.engine is not None and self.engine.is_alive():
            self.engine.kill()
            self.engine.join(5.0)


def _signal(proc: BaseProcess | None, sig: int) -> None:
    if proc is not None and proc.pid is not None and proc.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)


async def _join(proc: BaseProcess, timeout: float) -> None:
    deadline = time.monotonic() + max(0.0, timeout)
    while proc.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if proc.is_alive():
        logger.warning("%s (pid %s) did not stop in time: killing it", proc.name, proc.pid)
        proc.kill()
    await asyncio.to_thread(proc.join, 5.0)


async def _receive(conn: Connection, proc: BaseProcess | None, timeout: float) -> tuple[Any, ...] | None:
    """The next message on ``conn``; None if ``proc`` exited first or ``timeout`` passed."""

    def receive() -> tuple[Any, ...] | None:
        sentinel = [proc.sentinel] if proc is not None else []
        if not wait([conn, *sentinel], timeout):
            return None
        try:
            return conn.recv() if conn.poll() else None
        except (EOFError, OSError):
            return None

    return await asyncio.to_thread(receive)
