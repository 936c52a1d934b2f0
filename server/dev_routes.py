"""vLLM's routes that ``vllm serve`` adds only when asked to: the generation pause of RL weight
syncs (with ``VLLM_SERVER_DEV_MODE=1``, as vLLM's) and the torch profiler (with
``VLLM_TORCH_PROFILER_DIR``). Without them the routes do not exist (404), as in vLLM.

* ``POST /pause?mode=abort|wait|keep&clear_cache=true`` -> ``{"status": "paused"}``: new generation
  requests wait (held, not refused) until ``POST /resume`` -> ``{"status": "resumed"}``; requests in
  flight are aborted (``abort``, the default: their streams end with finish reason ``abort``), run
  to their end before the answer (``wait``), or frozen with their KV and continued after the resume
  (``keep``). ``clear_cache`` (default true) empties the prefix cache once they are settled (not for
  ``keep``); vLLM's deprecated ``wait_for_inflight_requests=true`` means ``mode=wait``. A ``wait``
  pause still waiting when a ``/resume`` comes is answered 409 (``pause_cancelled``). ``GET
  /is_paused`` -> ``{"is_paused": bool}``: true while paused, and while asleep (vLLM's). ``/health``
  stays 200 while paused. A full ``/wake_up`` resumes too (vLLM's); a ``/sleep`` or
  ``/update_weights_from_disk`` while paused runs (frozen requests are preempted first, to recompute
  with the new weights) and the pause goes on. The engine does the work (engine/async_sleep.py).
* Also in dev mode: ``GET /get_world_size`` -> ``{"world_size": 1}`` (vLLM's, for RL trainers
  sizing a weight-sync group: ferry runs one process per replica, no tensor or data parallelism;
  ``include_dp`` is accepted), and ``POST /reset_mm_cache`` / ``POST /reset_encoder_cache`` -> 200,
  empty (vLLM's; ferry keeps no multimodal or encoder cache across requests: nothing to drop).
* ``POST /start_profile``, ``POST /stop_profile`` -> 200, empty: a ``torch.profiler`` over the
  engine loop; stopping writes a Chrome trace into the directory (engine/profiler.py).

Behind ``--api-server-count`` every API server has the routes; the one engine process acts once.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from engine.sleep_mode import SLEEP_MODES
from server.errors import APIError, ErrorResponse, bad_request
from server.sleep_mode import engine_call

logger = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 409, 503)}


def dev_mode() -> bool:
    """``VLLM_SERVER_DEV_MODE``, read as vLLM reads it (an integer; not 0: on)."""
    value = os.environ.get("VLLM_SERVER_DEV_MODE", "0").strip() or "0"
    try:
        return int(value) != 0
    except ValueError:
        logger.warning("VLLM_SERVER_DEV_MODE=%r is not an integer: the dev-mode routes stay off", value)
        return False


def profiler_dir() -> str | None:
    """``VLLM_TORCH_PROFILER_DIR``, made absolute (vLLM's); None when unset or empty."""
    value = os.environ.get("VLLM_TORCH_PROFILER_DIR", "").strip()
    return os.path.abspath(os.path.expanduser(value)) if value else None


def add_dev_routes(app: FastAPI, engine: Any) -> None:
    if dev_mode():
        logger.warning("VLLM_SERVER_DEV_MODE is on: /pause, /resume, /is_paused and the like are served")
        _add_dev_mode_routes(app, engine)
    directory = profiler_dir()
    if directory is not None:
        logger.warning("the torch profiler is enabled (traces to %s): for development only", directory)
        _add_profile_routes(app, engine, directory)


def _add_dev_mode_routes(app: FastAPI, engine: Any) -> None:
    @app.post("/pause", responses=_ERRORS)
    async def pause_route(
        mode: str | None = None, wait_for_inflight_requests: bool = False, clear_cache: bool = True
    ) -> Response:
        mode = mode or ("wait" if wait_for_inflight_requests else "abort")
        if mode not in SLEEP_MODES:
            raise bad_request(f"mode must be one of {', '.join(SLEEP_MODES)}, got {mode!r}", param="mode")
        try:
            await engine_call(engine.pause_generation(mode, clear_cache))
        except APIError as e:
            if e.code == "sleep_cancelled":  # a /resume sent while it waited for running requests
                raise APIError(
                    409, "Not paused: a resume cancelled the pause.", code="pause_cancelled"
                ) from None
            raise
        return JSONResponse({"status": "paused"})

    @app.post("/resume", responses=_ERRORS)
    async def resume_route() -> Response:
        await engine_call(engine.resume_generation())
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused_route() -> Response:
        return JSONResponse({"is_paused": engine.is_paused()})

    @app.get("/get_world_size")
    async def world_size_route(include_dp: bool = True) -> Response:
        return JSONResponse({"world_size": 1})

    @app.post("/reset_mm_cache")
    @app.post("/reset_encoder_cache")
    async def reset_caches_route() -> Response:
        return Response(status_code=200)


def _add_profile_routes(app: FastAPI, engine: Any, directory: str) -> None:
    @app.post("/start_profile", responses=_ERRORS)
    async def start_profile_route() -> Response:
        await engine_call(engine.start_profile(directory))
        return Response(status_code=200)

    @app.post("/stop_profile", responses=_ERRORS)
    async def stop_profile_route() -> Response:
        await engine_call(engine.stop_profile())
        return Response(status_code=200)
