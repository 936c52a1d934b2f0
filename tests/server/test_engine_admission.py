"""The engine process's admission over every API server (``EngineHost`` and ``EngineClient`` over a
real Unix socket, in one event loop; two clients stand for two API server processes): a request is
checked as a whole at its first sequence, places are held for the rest until they come or the
request ends, and a refused request's other sequences are refused with it. The engine sleeps, so
it holds every request and nothing ends on its own (``tests/server/test_admission.py`` runs the
same over HTTP)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from server.admission import Admission, AdmissionRefused
from server.engine_client import EngineClient
from server.engine_host import EngineHost
from tests.server.test_engine_ipc import _hosted, _until

PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


async def _refused(client: EngineClient, rid: str, admission: tuple[int, int]) -> str:
    """The refusal's message of one sequence (it must be refused before any output)."""
    with pytest.raises(AdmissionRefused) as refused:
        async for _ in client.generate(rid, [5, 6, 7], PARAMS, admission=admission):
            raise AssertionError("an output of a refused sequence")
    return str(refused.value)


async def test_places_are_held_for_a_requests_sequences_until_it_ends(tiny_llama) -> None:
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=128, max_num_seqs=2, enable_sleep_mode=True)
    engine = AsyncEngine(config)
    await engine.sleep(1)  # every sequence waits: the limit of 3 is the whole capacity
    host = EngineHost(engine, max_queued_requests=3)
    held: list[asyncio.Future] = []
    try:
        async with _hosted(host) as where:
            a, b = await EngineClient.connect(where), await EngineClient.connect(where)
            # The first of A's 3 sequences: places are held for the two still to come.
            streams = [a.generate("a-0", [5, 6, 7], PARAMS, admission=(1, 3))]
            held.append(asyncio.ensure_future(streams[0].__anext__()))
            await _until(lambda: b.sequences_elsewhere == 3, "B does not count the held places")
            # B's one sequence (under its own key 1: keys are per API server) finds the queue full.
            assert "3 sequences are waiting (limit 3)" in await _refused(b, "b-0", (1, 1))
            # A's request ended before its other two sequences were sent: their places are free.
            a.end_admission(1)
            await _until(lambda: b.sequences_elsewhere == 1, "the places outlive their request")
            # B's request of 3 does not fit beside A's one sequence: refused at its first sequence,
            # and its second with it, though one more sequence would fit now.
            assert "1 sequences are waiting and this request's 3 would make 4" in await _refused(
                b, "b-1", (2, 3)
            )
            assert "other sequences were refused" in await _refused(b, "b-2", (2, 3))
            b.end_admission(2)
            # No place was held for the refused request: B's 2 sequences fill the queue exactly.
            for i in range(2):
                streams.append(b.generate(f"b-ok-{i}", [8, 9], PARAMS, admission=(3, 2)))
                held.append(asyncio.ensure_future(streams[-1].__anext__()))
                await _until(lambda: a.sequences_elsewhere == 2, "B's second place is not held")
            assert "(limit 3)" in await _refused(a, "a-late", (4, 1))
            await engine.wake_up()  # the three held sequences run
            firsts = await asyncio.wait_for(asyncio.gather(*held), 30)
            assert all(out.outputs[0].token_ids for out in firsts)
            for stream in streams:
                await stream.aclose()
            await _until(lambda: a.sequences_elsewhere == 0 and host._in_flight() == 0, "sequences linger")
            await a.shutdown()
            await b.shutdown()
    finally:
        for future in held:
            future.cancel()
            with contextlib.suppress(BaseException):
                await future
        await engine.shutdown()


async def test_a_beam_search_leases_its_places_until_it_ends(tiny_llama) -> None:
    """A beam search of width 3 is checked at its first step as 3 sequences, and holds 3 places
    until its request ends, however many of its steps' engine requests (one per live beam) are in
    the engine: none between steps, one at the first, up to 3 later. Refused, its request's other
    first steps are refused with it."""
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=128, max_num_seqs=2, enable_sleep_mode=True)
    engine = AsyncEngine(config)
    await engine.sleep(1)
    host = EngineHost(engine, max_queued_requests=3)
    beam = Admission(1, 3, lease=True)
    held: list[asyncio.Future] = []
    try:
        async with _hosted(host) as where:
            a, b = await EngineClient.connect(where), await EngineClient.connect(where)
            # Its first step: one live beam, in the engine; three places counted.
            streams = [a.generate("a-s0-b0", [5, 6, 7], PARAMS, admission=beam)]
            held.append(asyncio.ensure_future(streams[0].__anext__()))
            await _until(lambda: b.sequences_elsewhere == 3, "the beam search counts as its first step")
            assert "3 sequences are waiting (limit 3)" in await _refused(b, "b-0", (1, 1))
            # B's own beam search (2 prompts, width 2) does not fit, nor its other prompt's first step.
            assert "3 sequences are waiting (limit 3)" in await _refused(
                b, "b-s0", Admission(2, 4, lease=True)
            )
            assert "other sequences were refused" in await _refused(b, "b-s0-p1", Admission(2, 4, lease=True))
            b.end_admission(2)
            # The next step's three beams run inside the lease: admitted, not counted again.
            for i in range(3):
                streams.append(a.generate(f"a-s1-b{i}", [5, 6, 7, 8], PARAMS, admission=beam))
                held.append(asyncio.ensure_future(streams[-1].__anext__()))
            await _until(lambda: engine.stats().num_waiting == 4, "the steps do not reach the engine")
            assert host._in_flight() == 3 and b.sequences_elsewhere == 3
            # Between steps (its engine requests ended), its places stay held.
            for future in held:  # the client gone mid-step: its steps are aborted
                future.cancel()
            await asyncio.gather(*held, return_exceptions=True)
            await _until(lambda: engine.stats().num_waiting == 0, "the aborted steps linger")
            assert host._in_flight() == 3 and b.sequences_elsewhere == 3
            # Its request ended: the places are free.
            a.end_admission(1)
            await _until(
                lambda: b.sequences_elsewhere == 0 and host._in_flight() == 0, "the lease outlives it"
            )
            await a.shutdown()
            await b.shutdown()
    finally:
        for future in held:
            future.cancel()
            with contextlib.suppress(BaseException):
                await future
        await engine.shutdown()
