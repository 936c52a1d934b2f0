"""The children of ``ferry serve --api-server-count N`` (``server/api_servers.py``): the entry points
the supervisor spawns, ``engine_main`` (the engine process) and ``api_server_main`` (an API server
process), and what an API server does before and while it serves (prepare while the model loads,
wait for "go", then beat to the supervisor from its event loop).

Split from the supervisor so that each reads on its own: this is what runs in the children, that
what runs in the parent. Nothing here imports torch at import time (an API server process never
does; the engine process loads it in ``engine_process_main``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from multiprocessing.connection import Connection
from typing import Any

from server.config import ServerConfig

LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
# A serving API server's event loop tells the supervisor it runs this often (the supervisor kills
# one silent for ``api_servers.API_SERVER_SILENCE_S``).
API_SERVER_BEAT_S = 1.0


def _become_child(supervisor: int) -> None:
    """Leave the terminal's process group (Ctrl-C reaches the supervisor only, which decides the
    order of shutdown) and die with the supervisor."""
    from ferry.cluster.child import parent_death_hook

    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    hook = parent_death_hook(supervisor)
    if hook is not None:
        hook()


def engine_main(
    engine_config: Any, path: str, config: ServerConfig, ready: Connection, supervisor: int
) -> None:
    _become_child(supervisor)
    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
    from server.engine_process import engine_process_main
    from server.responses_memory import MemoryRecords

    responses = None
    if config.responses_store == "memory":  # every API server's responses, in one place
        responses = MemoryRecords(config.responses_store_max_bytes, config.responses_store_ttl)
    engine_process_main(
        engine_config,
        path,
        ready,
        responses,
        config.lora_modules,
        config.max_queued_requests,
        config.served_model_name,
    )


def api_server_main(
    index: int,
    config: ServerConfig,
    engine_path: str,
    ready: Connection,
    supervisor: int,
    channel: socket.socket,
) -> None:
    _become_child(supervisor)
    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
    _prepare()  # most of an API server's start, while the engine process loads the model
    if not _engine_serves(ready):
        return
    from server.main import loop_factory

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(_serve_api(config, engine_path, ready, channel))


def _prepare() -> None:
    """Import what serving needs, warm FastAPI's route building, and put what that left out of the
    cyclic GC's view (``settle_heap``), so the collection once the app is built scans only what
    came after. Nothing here needs the engine, and nothing imports torch."""
    import server.app  # noqa: F401
    import server.engine_client  # noqa: F401
    import server.main  # noqa: F401
    from server.heap import settle_heap

    _warm_fastapi()
    settle_heap()


def _warm_fastapi() -> None:
    """A throwaway route with a response model: FastAPI imports and sets up more on its first one
    (a third of ``build_app``'s time)."""
    from fastapi import FastAPI
    from pydantic import BaseModel

    class Warm(BaseModel):
        ok: bool = True

    async def warm() -> Any:
        return Warm()

    FastAPI().get("/", response_model=Warm)(warm)


def _engine_serves(supervisor: Connection) -> bool:
    """Wait for the supervisor's "go" (the engine process serves); False if it went away first
    (this process dies with it, or is killed: the engine could not start)."""
    try:
        return supervisor.recv() == ("go",)
    except (EOFError, OSError):
        return False


async def _serve_api(
    config: ServerConfig, engine_path: str, ready: Connection, channel: socket.socket
) -> None:
    from server.engine_client import EngineClient
    from server.main import serve

    engine = await EngineClient.connect(engine_path)

    beats: list[asyncio.Task] = []

    def started() -> None:
        with contextlib.suppress(OSError):
            ready.send(("ready",))
        beats.append(asyncio.ensure_future(_beat(ready)))

    try:
        await serve(engine, config, sockets=[], on_started=started, passed=channel)
    finally:
        for task in beats:
            task.cancel()
        ready.close()


async def _beat(supervisor: Connection) -> None:
    """Tell the supervisor, from the event loop, that it runs (``API_SERVER_SILENCE_S``)."""
    while True:
        await asyncio.sleep(API_SERVER_BEAT_S)
        try:
            supervisor.send(("beat",))
        except OSError:  # the supervisor is gone: this process dies with it
            return
