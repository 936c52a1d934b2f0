"""The engine process of a replica run with ``--api-server-count N``: its entry point
(``engine_process_main``, spawned by ``server/api_servers.py``), which loads the model, serves it
to the API server processes over a Unix socket (``server/engine_host.py``: the messages both ways)
and stops on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

from server.engine_host import EngineHost
from server.heap import settle_heap
from server.metrics import ServerMetrics
from server.responses_memory import MemoryRecords

logger = logging.getLogger("ferry.engine_process")


def engine_process_main(
    engine_config: Any,
    socket_path: str,
    ready: Connection,
    responses: MemoryRecords | None = None,
    lora_modules: tuple[Any, ...] = (),
    max_queued_requests: int | None = None,
    model_name: str | None = None,
) -> None:
    """Entry point of the engine process (spawned by ``server/api_servers.py``).

    Sends ``("ready",)`` on ``ready`` once the model is loaded and the socket listens, or
    ``("error", message)`` if the engine refused its configuration. Stops on SIGTERM; ignores
    SIGINT (the supervisor decides when the engine stops: after the API servers drained).
    ``model_name``: the served model's, for the requests of a dead API server counted here.
    """
    from server.main import loop_factory

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(
            _serve_engine(
                engine_config, socket_path, ready, responses, lora_modules, max_queued_requests, model_name
            )
        )


async def _serve_engine(
    engine_config: Any,
    socket_path: str,
    ready: Connection,
    responses: MemoryRecords | None,
    lora_modules: tuple[Any, ...],
    max_queued_requests: int | None,
    model_name: str | None,
) -> None:
    from engine import AsyncEngine
    from server.lora import preload

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, lambda: None)
    try:
        engine = AsyncEngine(engine_config)
        await preload(engine, lora_modules)
    except (ValueError, OSError) as e:  # the model directory, flags the model cannot meet, an adapter
        logger.debug("engine start failed", exc_info=e)
        ready.send(("error", str(e)))
        return
    # The aborts of an API server that died, in the replica's metrics (its multiprocess directory).
    metrics = ServerMetrics(model_name) if model_name is not None else None
    host = EngineHost(engine, responses, max_queued_requests, metrics)
    server = await asyncio.start_unix_server(host.handle, path=socket_path)
    os.chmod(socket_path, 0o600)
    publisher = asyncio.ensure_future(host.publish_stats())
    settle_heap()  # the loaded model and torch live as long as the process
    ready.send(("ready",))
    ready.close()
    try:
        await stop.wait()
    finally:
        publisher.cancel()
        server.close()
        with contextlib.suppress(Exception):
            await engine.shutdown()
