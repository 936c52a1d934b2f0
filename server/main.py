"""`ferry serve`: build the engine and the app from the flags, run uvicorn, drain on SIGTERM.

Shutdown on SIGTERM (or the first Ctrl-C): stop admitting (``/health`` and new requests answer
503, the ``--register`` key is deleted so routers stop sending), let in-flight requests finish
for up to ``--drain-timeout`` seconds (background responses too), abort what is left (a background
response's record then says it failed), then exit 0. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from server.args import engine_options, server_config
from server.config import ServerConfig
from server.conn_balance import PassedConnections
from server.heap import settle_heap
from server.roles import check_role_config
from server.tracing import tracing_args_problem
from server.vllm_compat import compat_notes, limited_problem

logger = logging.getLogger("ferry.server")


class DrainingServer(uvicorn.Server):
    """uvicorn whose first exit signal drains in-flight requests instead of closing at once."""

    def __init__(
        self,
        config: uvicorn.Config,
        app_state: Any,
        registration: Any = None,
        on_started: Callable[[], None] | None = None,
        passed: socket.socket | None = None,
    ) -> None:
        super().__init__(config)
        self.app_state = app_state
        self.registration = registration
        self.on_started = on_started
        self.passed = passed  # an API server process's channel from the supervisor (conn_balance)
        self._passed: PassedConnections | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started and self.passed is not None:
            self._passed = PassedConnections(self.passed, self._protocol, self.config.ssl)
            self._passed.ready()
        if self.started and self.registration is not None:
            await self.registration.start()  # only once the port answers: routers probe at once
        if self.started and self.on_started is not None:
            self.on_started()

    def _protocol(self) -> asyncio.Protocol:
        """What uvicorn's own listening socket would serve a new connection with."""
        return self.config.http_protocol_class(  # type: ignore[call-arg]
            config=self.config, server_state=self.server_state, app_state=self.lifespan.state
        )

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._passed is not None:  # no new connections: the supervisor passes them elsewhere
            self._passed.close()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is None and self._loop is not None and not self.should_exit:
            logger.info(
                "signal %s: draining (up to %.0f s)",
                signal.Signals(sig).name,
                self.app_state.config.drain_timeout,
            )
            # Signal handlers run between bytecodes of the loop's thread: hand over safely.
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        # Second signal: stop now (uvicorn aborts what is left).
        self.should_exit = True
        self.force_exit = True

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        generation = self.app_state.generation
        generation.draining = True
        await self.app_state.batches.stop_all()  # running batches end failed, their requests aborted
        if self.registration is not None:
            await self.registration.stop()
        timeout = self.app_state.config.drain_timeout
        if not await generation.wait_idle(timeout):
            logger.warning(
                "drain timeout (%.0f s): aborting %d in-flight sequence(s)", timeout, generation.in_flight
            )
            self.app_state.background.stop_all()  # saved as failed, not as answers cut short
            await generation.abort_all()
            await generation.wait_idle(5.0)
        self.should_exit = True


async def serve(
    engine: Any,
    config: ServerConfig,
    sockets: list[socket.socket] | None = None,
    on_started: Callable[[], None] | None = None,
    passed: socket.socket | None = None,
) -> None:
    """Run the API over an already-built engine (an ``AsyncEngine``, or an ``EngineClient`` in an API
    server process) until drained; shuts the engine down at the end. ``sockets``: listen on these
    instead of binding ``config.host:port`` (none: an API server process). ``passed``: serve the
    connections the supervisor passes over this channel (``server/conn_balance.py``)."""
    from server.app import build_app
    from server.registration import Registration

    app = build_app(engine, config)
    registration = None
    if config.register:
        registration = Registration(
            config.register,
            config.url,
            config.role,
            config.served_model_name,
            config.register_interval,
            config.register_ttl,
        )
    options = {"log_level": config.log_level, **config.http.uvicorn_kwargs()}  # TLS, root path
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        access_log=config.log_level == "debug" and config.http.access_log,  # --disable-uvicorn-access-log
        lifespan="off",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=30,
        **options,
    )
    server = DrainingServer(uv_config, app.state.ferry, registration, on_started, passed)
    settle_heap()
    try:
        await server.serve(sockets)
    finally:
        if registration is not None:
            await registration.stop()
        await app.state.ferry.batches.close()
        await app.state.ferry.background.close()  # before the store they save to closes
        responses = app.state.ferry.responses
        if responses is not None:
            await responses.close()
        tracing = app.state.ferry.generation.tracing
        if tracing is not None:  # the last spans leave (bounded: a collector may be down)
            await asyncio.to_thread(tracing.shutdown)
        await engine.shutdown()


def run_serve(args: argparse.Namespace) -> int:
    from engine import AsyncEngine
    from server.lora import preload

    try:
        config, engine_config = serve_configs(args)
    except ValueError as e:
        return usage_error(e)
    log_format = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    if args.api_server_count > 1:
        from server.api_server_child import LOG_FORMAT as log_format
    logging.basicConfig(level=config.log_level.upper(), format=log_format)
    for note in compat_notes(args):
        logger.info(note)
    if args.api_server_count > 1:
        from server.api_servers import run_api_servers

        return run_api_servers(config, engine_config, args.api_server_count)
    from server.listen_socket import bind_port, listen_unix

    # The address is taken before the model loads (minutes, for a large one), so a port in use is
    # said at once; connections are refused until the server serves, as before.
    uds = config.http.uds
    try:
        listener = listen_unix(uds) if uds else bind_port(config.host, config.port)
    except (OSError, OverflowError) as e:
        where = uds or f"{config.host}:{config.port}"
        return usage_error(f"cannot listen on {where}: {getattr(e, 'strerror', None) or e}")

    async def main() -> None:
        # Built inside the loop: the engine may bind its output queues to the running loop.
        try:
            engine = AsyncEngine(engine_config)
            await preload(engine, config.lora_modules)
        except (ValueError, OSError) as e:  # the model directory, flags the model cannot meet, an adapter
            raise _StartupError(e) from e
        logger.info("serving %s on %s (role %s)", config.served_model_name, config.url, config.role)
        await serve(engine, config, sockets=[listener])

    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(main())
    except _StartupError as e:
        logger.debug("engine start failed", exc_info=e.__cause__)
        return usage_error(e)
    finally:
        listener.close()
    return 0


def serve_configs(args: argparse.Namespace) -> tuple[ServerConfig, Any]:
    """The server's and the engine's configuration from the `ferry serve` flags (also `ferry
    run-batch`'s); ValueError names what is wrong with them."""
    from engine.config import EngineConfig

    problem = check_serve_args(args)
    if problem is not None:
        raise ValueError(problem)
    return server_config(args), EngineConfig.from_options(**engine_options(args))


def check_serve_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the `ferry serve` flags (shared by `ferry run-batch`), or None; takes the
    positional model (`ferry serve MODEL`) into ``args.model``."""
    from server.responses_store import check_store_spec

    problem = check_role_config(args.role, args.kv_tier)
    tag = getattr(args, "model_tag", None)
    if tag is not None:  # `ferry serve MODEL`, as `vllm serve MODEL`
        if args.model is not None and args.model != tag:
            problem = f"the model is given twice, as {tag!r} and as --model {args.model!r}"
        args.model = tag
    if problem is None:
        problem = limited_problem(args)
    if problem is None:
        problem = tracing_args_problem(args)
    if problem is None and args.enable_auto_tool_choice and not args.tool_call_parser:
        problem = "--enable-auto-tool-choice needs --tool-call-parser (the model's tool-call format)"
    if problem is None and args.api_server_count < 1:
        problem = f"--api-server-count must be at least 1, got {args.api_server_count}"
    if problem is None and not 0 <= args.port <= 65535:
        problem = f"--port must be in 0..65535, got {args.port}"
    if problem is None and args.max_queued_requests < 0:
        problem = f"--max-queued-requests must be >= 0, got {args.max_queued_requests}"
    if problem is None and args.max_request_sequences < 1:
        problem = f"--max-request-sequences must be at least 1, got {args.max_request_sequences}"
    if problem is None and args.request_timeout is not None and not args.request_timeout > 0:
        problem = f"--request-timeout must be positive, got {args.request_timeout}"
    if problem is None and args.max_request_bytes < 1:
        problem = f"--max-request-bytes must be positive, got {args.max_request_bytes}"
    if problem is None and not args.drain_timeout >= 0:
        problem = f"--drain-timeout must be >= 0, got {args.drain_timeout}"
    if problem is None:
        problem = check_store_spec(args.responses_store)
    if problem is None and (args.responses_store_max_bytes < 1 or args.responses_store_ttl <= 0):
        problem = "--responses-store-max-bytes and --responses-store-ttl must be positive"
    if problem is None and not args.responses_lease_ttl >= 1:
        problem = f"--responses-lease-ttl must be at least 1 second, got {args.responses_lease_ttl}"
    if problem is None and args.max_batch_concurrency is not None and args.max_batch_concurrency < 1:
        problem = f"--max-batch-concurrency must be at least 1, got {args.max_batch_concurrency}"
    if problem is None and args.max_file_bytes < 1:
        problem = f"--max-file-bytes must be positive, got {args.max_file_bytes}"
    return problem


class _StartupError(Exception):
    """The engine refused its configuration: a message for the operator, not a traceback."""


def usage_error(problem: object) -> int:
    print(f"ferry serve: error: {problem}", file=sys.stderr)
    return 2


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed (``uvicorn[standard]`` brings it), as ``uvicorn.run`` would pick; ``serve``
    builds the engine inside the loop, so it runs the loop itself. The loop wakes for every token of
    every stream: uvloop spends 11-15 % less CPU per token there (``bench/server_overhead.py``)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
