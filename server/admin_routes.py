"""A replica's operational routes, outside the OpenAI API: ``/health`` (and ``/ping``), ``/load``,
``/metrics``, ``/version``, ``/reset_prefix_cache``, sleep mode (``/sleep``, ``/wake_up``,
``/is_sleeping``) with SGLang's ``/update_weights_from_disk``, and the dev-mode routes
(``server/dev_routes.py``). ``build_app`` (``server/app.py``) adds them; nothing here generates.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from ferry import __version__
from server import sleep_mode
from server.dev_routes import add_dev_routes
from server.errors import APIError
from server.metrics_exposition import content_encoding
from server.middleware import ReplicaLoad, ServerLoad
from server.prefix_cache import reset_engine_prefix_cache
from server.protocol import ErrorResponse, VersionResponse
from server.state import ServerState

# As the API routes declare them (server/app.py): the same OpenAPI schema as before the split.
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 409, 413, 429, 503)
}


def add_admin_routes(app: FastAPI, engine: Any, state: ServerState) -> ReplicaLoad | ServerLoad:
    """Add the routes to ``app``; returns the load count ``/load`` reads (``EdgeMiddleware`` keeps it)."""
    config = state.config

    @app.get("/health")
    @app.head("/health")  # load balancers that probe with HEAD (the router answers it too)
    @app.get("/ping")
    @app.post("/ping")
    async def health() -> Response:
        if state.generation.draining:
            return APIError(503, "Server is draining.", code="draining").to_response()
        if not engine.is_healthy():
            return APIError(503, "Engine is not healthy.", code="engine_unhealthy").to_response()
        # "sleeping": a router keeps sending to awake replicas while others sleep (server/sleep_mode.py).
        # "instance_id" (new when the engine starts) and "prefix_cache_resets": when either changes,
        # the prefix cache was emptied, and a router's cache_aware index forgets what it held.
        # "paused": generation paused (/pause, server/dev_routes.py): new requests held as while asleep.
        body = {
            "status": "ok",
            "role": config.role,
            "sleeping": engine.is_sleeping(),
            "paused": engine.stats().paused,
        }
        if state.lora_resolver is not None:  # a router sends it names no replica lists (router/pool.py)
            body["lora_resolver"] = True
        cache = {"instance_id": engine.instance_id, "prefix_cache_resets": engine.stats().prefix_cache_resets}
        return JSONResponse({**body, **cache})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False) -> Response:
        # vLLM's admin route (benchmarks call it between runs): drops cached, unused KV blocks.
        dropped = await reset_engine_prefix_cache(engine, state.generation, reset_running_requests)
        return JSONResponse({"status": "ok", "num_blocks_dropped": dropped})

    # Sleep mode (vLLM's routes, with --enable-sleep-mode) and weight updates (SGLang's route).
    @app.post("/sleep", responses=_ERRORS)
    async def sleep_route(level: str | None = None, mode: str | None = None) -> Response:
        await sleep_mode.sleep(engine, level, mode)
        return Response(status_code=200)

    @app.post("/wake_up", responses=_ERRORS)
    async def wake_up_route(tags: list[str] = Query(default=[])) -> Response:  # noqa: B008
        await sleep_mode.wake_up(engine, tags)
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping_route() -> Response:
        return JSONResponse({"is_sleeping": engine.is_sleeping()})

    @app.post("/update_weights_from_disk", responses=_ERRORS)
    async def update_weights_route(body: sleep_mode.UpdateWeightsFromDiskRequest) -> Response:
        return JSONResponse(await sleep_mode.update_weights_from_disk(engine, body))

    add_dev_routes(app, engine)  # /pause, /resume, /is_paused; /start_profile, /stop_profile (when asked)

    # Behind --api-server-count, the engine process adds up every API server's count.
    load = ReplicaLoad(engine) if hasattr(engine, "report_load") else ServerLoad()

    @app.get("/load")
    async def server_load() -> Response:
        """vLLM's: the requests on the engine's routes now (queued, running or streaming)."""
        return JSONResponse({"server_load": load.total()})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, content_type = state.metrics.exposition(request.headers.get("accept"))
        body, headers = content_encoding(body, request.headers.get("accept-encoding"))
        return Response(body, headers={"content-type": content_type, **dict(headers)})

    @app.get("/version", response_model=VersionResponse)
    async def version() -> Any:
        return VersionResponse(version=__version__, role=config.role)

    return load
