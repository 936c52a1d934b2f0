"""An API server whose own event loop is late to read is not told its engine went silent: silence is
the engine process sending nothing (``EngineClient._silent``), not this side reading nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

import server.engine_client as engine_client
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from server.engine_client import EngineClient
from server.engine_host import EngineHost
from tests.server.test_engine_ipc import _hosted, _until

SILENCE_S = 0.5


@pytest.fixture
async def engine(tiny_llama) -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64))
    yield eng
    await eng.shutdown()


async def test_unread_heartbeats_are_not_silence_and_no_heartbeats_are(engine, monkeypatch) -> None:
    monkeypatch.setattr(engine_client, "ENGINE_SILENCE_S", SILENCE_S)
    host = EngineHost(engine)
    async with _hosted(host, publish=False) as where:
        client = await EngineClient.connect(where)
        publisher = asyncio.ensure_future(host.publish_stats())  # heartbeats every HEARTBEAT_S
        read = client._channel.receive
        unblocked = asyncio.Event()

        async def blocked():  # the reading this API server's lagging loop has not got to
            await unblocked.wait()
            return await read()

        client._channel.receive = blocked
        try:
            # Heartbeats arrive and wait unread, for several silence spans.
            await _until(
                lambda: client._channel.pending() and time.monotonic() - client._heard > 3 * SILENCE_S,
                "no heartbeat waited unread",
            )
            assert client.is_healthy()
            # Read again, and the engine process sends nothing more: that is silence.
            publisher.cancel()
            unblocked.set()
            await _until(lambda: not client.is_healthy(), "a silent engine process still reads healthy")
            assert not client._channel.closed
        finally:
            publisher.cancel()
            unblocked.set()
            await client.shutdown()
