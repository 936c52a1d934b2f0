"""``POST /wake_up`` while a ``POST /sleep?mode=wait`` still waits for a running request: the sleep is
cancelled and answers 409 (OpenAI's error shape, code ``sleep_cancelled``), ``/wake_up`` answers 200
and the replica stays awake. Real HTTP (uvicorn on loopback) over the engine in this process, and
over an engine process's relay (``EngineHost`` and an ``EngineClient`` over a real Unix socket), the
interleaving forced by the hooks of tests/engine/test_sleep_wake_order.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest

from engine.async_engine import AsyncEngine
from server.app import build_app
from server.config import ServerConfig
from server.engine_client import EngineClient
from server.engine_host import EngineHost
from tests.engine.test_sleep_wake_order import LONG, PROMPT, hold_until_wake
from tests.server.test_engine_ipc import _hosted

CONFIG = ServerConfig(served_model_name="m")


@contextlib.asynccontextmanager
async def _front(engine: AsyncEngine, how: str) -> AsyncIterator[object]:
    """What the app serves: the engine itself, or a client of it through an engine process's relay."""
    if how == "in process":
        yield engine
        return
    async with _hosted(EngineHost(engine)) as where:
        client = await EngineClient.connect(where)
        try:
            yield client
        finally:
            await client.shutdown()


@pytest.mark.parametrize("how", ["in process", "engine process"])
async def test_a_wake_up_cancels_a_waiting_sleep_with_409(tiny_llama, serve_app, how) -> None:
    engine = AsyncEngine(model=str(tiny_llama), enable_sleep_mode=True, num_kv_blocks=64)
    gates = hold_until_wake(engine)
    try:
        async with (
            _front(engine, how) as front,
            serve_app(build_app(front, CONFIG)) as url,
            httpx.AsyncClient(base_url=url, timeout=60) as http,
        ):
            body = {"model": "m", "prompt": PROMPT, "max_tokens": LONG.max_tokens, "temperature": 0.0}
            busy = asyncio.ensure_future(http.post("/v1/completions", json={**body, "ignore_eos": True}))
            while engine.stats().num_running == 0:
                await asyncio.sleep(0.005)
            sleep = asyncio.ensure_future(http.post("/sleep", params={"level": 2, "mode": "wait"}))
            assert await asyncio.to_thread(gates.barrier_queued.wait, 30)
            woke = await http.post("/wake_up")
            assert woke.status_code == 200
            answer = await asyncio.wait_for(sleep, 30)
            assert answer.status_code == 409
            error = answer.json()["error"]
            assert error["code"] == "sleep_cancelled"
            assert "cancelled by a wake_up" in error["message"]
            assert (await http.get("/is_sleeping")).json() == {"is_sleeping": False}
            done = await asyncio.wait_for(busy, 60)
            assert done.status_code == 200
            assert done.json()["usage"]["completion_tokens"] == LONG.max_tokens
            assert done.json()["choices"][0]["finish_reason"] == "length"
    finally:
        gates.release.set()
        await engine.shutdown()
