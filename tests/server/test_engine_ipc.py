"""EngineHost and EngineClient over a real Unix socket, in one event loop: what an API server process
sees of the engine process (``--api-server-count``) must be what ``AsyncEngine`` gives in process.

Two clients stand for two API server processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.sampling_params import StructuredOutputsParams
from server.engine_client import EngineClient
from server.engine_fanout import BROADCAST_DELAY_S
from server.engine_host import EngineHost
from server.engine_ipc import Channel
from server.responses_memory import MemoryRecords
from server.responses_memory_stores import RemoteResponseStore
from server.responses_store import StoreUnavailable

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23], [40, 41, 42, 43, 44, 45]]
# A wait that must not end the test's request (an hour: a hang), and the bound that tells it from a
# request ended by what the test checks, however loaded the machine.
HANG_S = 3600.0
WAIT_S = 120.0


@pytest.fixture
async def engine(tiny_llama) -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=128, enable_prompt_embeds=True))
    yield eng
    await eng.shutdown()


# In the test's own event loop (this project's async fixtures default to the session's): the host
# and its clients run on the loop they were made on.
@contextlib.asynccontextmanager
async def _hosted(host: EngineHost, publish: bool = True) -> AsyncIterator[str]:
    """``host`` served on a Unix socket (its path), publishing stats as the engine process does."""
    directory = tempfile.mkdtemp(prefix="ferry-ipc-")  # short: Unix socket paths are limited
    server = await asyncio.start_unix_server(host.handle, path=f"{directory}/engine.sock")
    publisher = asyncio.ensure_future(host.publish_stats()) if publish else None
    try:
        yield f"{directory}/engine.sock"
    finally:
        if publisher is not None:
            publisher.cancel()
        server.close()
        shutil.rmtree(directory, ignore_errors=True)


@pytest_asyncio.fixture(loop_scope="function")
async def path(engine) -> AsyncIterator[str]:
    async with _hosted(EngineHost(engine, MemoryRecords(max_bytes=1 << 20, ttl_s=60.0))) as where:
        yield where


@pytest_asyncio.fixture(loop_scope="function")
async def clients(path) -> AsyncIterator[tuple[EngineClient, EngineClient]]:
    a, b = await EngineClient.connect(path), await EngineClient.connect(path)
    yield a, b
    await a.shutdown()
    await b.shutdown()


async def _collect(eng, rid: str, prompt, params=GREEDY, **kw):
    tokens: list[int] = []
    last = None
    async for out in eng.generate(rid, prompt, params, **kw):
        tokens += out.outputs[0].token_ids
        last = out
    return tokens, last


async def _until(condition, what: str, timeout: float = 60.0) -> None:
    """Wait for ``condition``; the bound only guards against a hang (a loaded machine is slow)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def test_streams_equal_the_engine_in_process(engine, clients) -> None:
    a, b = clients
    assert a.model_info == engine.model_info and a.config == engine.config
    assert a.tokenizer.encode("hello world") == engine.tokenizer.encode("hello world")
    alone = [await _collect(engine, f"alone-{i}", p) for i, p in enumerate(PROMPTS)]
    # The same request id from both API servers at once: namespaced in the engine, not refused.
    got = await asyncio.gather(
        *(
            _collect(c, "same-id" if i < 2 else f"r{i}", p)
            for i, (c, p) in enumerate(zip((a, b, a), PROMPTS, strict=True))
        )
    )
    for (tokens, last), (want, want_last) in zip(got, alone, strict=True):
        assert tokens == want and len(tokens) == 8
        assert last.finished and last.outputs[0].finish_reason == "length"
        assert last.prompt_token_ids == want_last.prompt_token_ids  # restored by the client
    assert got[0][1].request_id == got[1][1].request_id == "same-id"
    assert a.stats().generation_tokens == engine.stats().generation_tokens  # pushed with outputs


async def test_refusals_arrive_as_value_errors_before_any_output(clients) -> None:
    a, _ = clients
    with pytest.raises(ValueError, match="too long|exceeds|context"):
        await _collect(a, "long", [5] * 5000)
    with pytest.raises(ValueError):
        await a.compile_structured(StructuredOutputsParams(json="{not a schema"))
    await a.compile_structured(StructuredOutputsParams(choice=["yes", "no"]))
    tokens, _ = await _collect(a, "after", PROMPTS[0])  # and the connection still serves
    assert len(tokens) == 8


async def test_prompt_embeds_cross_to_the_engine(engine, clients) -> None:
    """A tensor prompt is pickled to the engine process and prepared there off its loop: the
    embedding rows of a prompt answer as its ids, a repeat hits the prefix cache, a bad tensor is
    a ValueError before any output; outputs carry the placeholder ids."""
    import torch

    a, b = clients
    ids = list(range(40, 60))
    rows = engine.engine.model_runner.model.embed.detach().cpu()[ids].clone()
    want, _ = await _collect(engine, "ids", ids)
    tokens, last = await _collect(a, "embeds", rows)
    assert tokens == want and last.prompt_token_ids == [0] * 20 and last.num_cached_tokens == 0
    tokens, last = await _collect(b, "again", rows.clone())
    assert tokens == want and last.num_cached_tokens == 16
    with pytest.raises(ValueError, match="hidden size 3"):
        await _collect(a, "bad", torch.zeros(4, 3))


async def test_abort_and_a_closed_connection_free_the_blocks(engine, path, clients) -> None:
    a, _ = clients
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    stream = a.generate("long", PROMPTS[0], params)
    await stream.__anext__()
    assert engine.stats().num_running == 1
    await a.abort("long")  # returns once the engine freed the blocks
    assert engine.stats().kv_cache_usage == 0.0
    last = None
    async for out in stream:  # the stream ends with the engine's "abort"
        last = out
    assert last.finished and last.outputs[0].finish_reason == "abort"
    # An API server that goes away: its requests are aborted at once.
    c = await EngineClient.connect(path)
    generated = engine.stats().generation_tokens
    started = [c.generate(f"gone-{i}", p, params) for i, p in enumerate(PROMPTS)]
    for s in started:
        await s.__anext__()
    assert engine.stats().num_running == 3
    await c.shutdown()
    await _until(
        lambda: engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0.0, "still running"
    )
    assert engine.stats().generation_tokens - generated < 3 * 1000  # cut short, not run to their length
    with pytest.raises(EngineDeadError):  # its own streams end too, after what had arrived
        async for _ in started[0]:
            pass


async def test_abort_of_a_request_still_compiling_its_constraint_ends_it(engine, clients) -> None:
    """The engine process compiles a new constraint before the request reaches the engine; an
    abort that arrives meanwhile must still end it (not let it run once compiled)."""
    a, _ = clients
    params = SamplingParams(
        temperature=0.0, max_tokens=1000, structured_outputs=StructuredOutputsParams(regex="[a-z ]+")
    )
    stream = a.generate("so", PROMPTS[0], params)
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)  # the add is on its way...
    await a.abort("so")  # ...and the abort leaves in the same frame, before the compile is done
    assert engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0.0
    outs = [await first]
    async for out in stream:
        outs.append(out)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in outs) < 1000


async def test_stored_responses_are_shared_by_every_api_server(path, clients) -> None:
    a, b = (RemoteResponseStore(c) for c in clients)
    record = {"response": {"id": "resp_1", "output": []}, "input": [{"type": "message", "text": "é"}]}
    assert await a.put("resp_1", record)
    assert await b.get("resp_1") == record
    assert await b.delete("resp_1") and not await a.delete("resp_1")
    assert await a.get("resp_1") is None
    # A background response's lease, taken and renewed by one API server, seen by the other.
    running = {"response": {"id": "resp_2", "status": "in_progress"}, "input": []}
    failed = {"response": {"id": "resp_2", "status": "failed"}, "input": []}
    await a.claim("resp_2", 60.0)
    assert await a.put("resp_2", running)
    assert await b.lease_held("resp_2") and not await b.replace_orphan("resp_2", failed)
    await a.renew_leases(["resp_2"], 0.0)  # lapses at once
    assert not await b.lease_held("resp_2") and await b.replace_orphan("resp_2", failed)
    assert await a.get("resp_2") == failed and await a.events_end("resp_2") == 0
    gone = await EngineClient.connect(path)
    await gone.shutdown()
    with pytest.raises(StoreUnavailable):  # a 503 for the request, not a 500
        await RemoteResponseStore(gone).get("resp_1")


async def test_each_api_server_hears_of_the_others_sequences(engine, clients) -> None:
    a, b = clients
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    streams = [a.generate(f"s{i}", p, params) for i, p in enumerate(PROMPTS)]
    for s in streams:
        await s.__anext__()
    await _until(lambda: b.sequences_elsewhere == 3, "B does not count A's sequences")
    assert a.sequences_elsewhere == 0
    for i in range(3):
        await a.abort(f"s{i}")
    await _until(lambda: b.sequences_elsewhere == 0, "B still counts them")
    for s in streams:
        await s.aclose()


async def test_counts_that_cannot_change_an_admission_wait_for_the_stats_interval(tiny_llama) -> None:
    """Requests one API server adds while the idle engine gathers a burst change no stats; the
    other API servers hear of them at once (``BROADCAST_DELAY_S``) only once the queue is at least
    half of ``--max-queued-requests``, else with the next ``publish_stats`` (not run here, so only
    a broadcast can deliver). A step's stats go out at once as before."""
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=128, max_num_seqs=2))
    engine.arrival_wait_s = 30.0  # B's announcement keeps the engine gathering
    host = EngineHost(engine, max_queued_requests=4)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        async with _hosted(host, publish=False) as where:
            a, b = await EngineClient.connect(where), await EngineClient.connect(where)
            submitted = b.announce()
            firsts = [
                asyncio.ensure_future(_collect(a, f"s{i}", p, params)) for i, p in enumerate(PROMPTS[:2])
            ]
            await _until(lambda: host._in_flight() == 2, "A's requests do not arrive")
            # 2 sequences on 2 slots: nothing queued, under half of 4.
            await asyncio.sleep(20 * BROADCAST_DELAY_S)
            assert b.sequences_elsewhere == 0 and engine.stats().num_running == 0
            host._send_all()  # what publish_stats does every STATS_INTERVAL_S
            await _until(lambda: b.sequences_elsewhere == 2, "B never hears of A's sequences")
            # Two more: 2 beyond the slots, half of 4: B hears at once.
            firsts += [
                asyncio.ensure_future(_collect(a, f"t{i}", p, params)) for i, p in enumerate(PROMPTS[1:])
            ]
            await _until(lambda: b.sequences_elsewhere == 4, "B does not hear of a busy queue")
            submitted()  # the burst is in: the engine steps, and every step's stats go out
            got = await asyncio.wait_for(asyncio.gather(*firsts), 30)
            assert [len(tokens) for tokens, _ in got] == [4] * 4
            await _until(lambda: b.sequences_elsewhere == 0, "B still counts A's ended sequences")
            await a.shutdown()
            await b.shutdown()
    finally:
        await engine.shutdown()


async def test_an_idle_engine_waits_for_what_another_api_server_announced(engine, clients) -> None:
    engine.arrival_wait_s = HANG_S  # the announcement, not the cap, must end the wait
    a, b = clients
    submitted = b.announce()  # B has a request's body in and is parsing it
    first = asyncio.ensure_future(_collect(a, "a0", PROMPTS[0]))
    await asyncio.sleep(0.1)
    assert not first.done() and engine.stats().num_running == 0
    second = asyncio.ensure_future(_collect(b, "b0", PROMPTS[1]))
    await asyncio.sleep(0)  # B's add is sent...
    submitted()  # ...with its announcement withdrawn, in the same frame
    (_, x), (_, y) = await asyncio.wait_for(asyncio.gather(first, second), WAIT_S)
    assert y.metrics["first_scheduled_time"] <= x.metrics["first_token_time"]  # one first step


async def test_an_announcement_submitted_before_it_left_is_never_sent(engine, clients) -> None:
    """A request announced and submitted in one event-loop pass (its body parsed as it came in)
    sends neither message: the pair would cancel out in the engine process, which sees the add.
    Once the announcement has left, its "submitted" follows it. Neither way holds the engine."""
    engine.arrival_wait_s = HANG_S  # an announcement left pending would show as a hang
    a, _ = clients
    channel = a._channel
    left: list[str] = []
    real_flush = channel._flush

    def flush() -> None:
        left.extend(message[0] for message in channel._outbox)
        real_flush()

    channel._flush = flush
    submitted = a.announce()
    submitted()  # in the same pass, right before the add (as ``Ticket.start_one`` calls it)
    tokens, _ = await asyncio.wait_for(_collect(a, "same-pass", PROMPTS[0]), WAIT_S)
    assert len(tokens) == GREEDY.max_tokens
    assert "announce" not in left and "submitted" not in left and "add" in left
    left.clear()
    submitted = a.announce()
    await asyncio.sleep(0)  # the pass ends: the announcement leaves
    assert left == ["announce"]
    submitted()
    tokens, _ = await asyncio.wait_for(_collect(a, "later-pass", PROMPTS[1]), WAIT_S)
    assert len(tokens) == GREEDY.max_tokens and left[:3] == ["announce", "submitted", "add"]


async def test_a_queued_message_can_be_retracted() -> None:
    """``retract`` takes back exactly the message object given to ``send``, only while unsent."""
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    channel = Channel(reader, writer)
    try:
        token = len(PROMPTS)  # not a constant: two tuples of it are two objects
        first, twin = ("announce", token), ("announce", token)
        channel.send(first)
        channel.send(twin)
        assert channel.retract(first) and not channel.retract(first)
        channel.send(("add", "r"), now=True)
        data = theirs.recv(1 << 16)
        assert pickle.loads(data[4:]) == [("announce", token), ("add", "r")]  # the twin stayed
        assert not channel.retract(twin)  # it has left
    finally:
        channel.close()
        theirs.close()


async def test_probes_are_answered_by_every_api_server(engine, path, clients) -> None:
    engine.arrival_wait_s = HANG_S  # an unanswered probe would show as a hang
    a, b = clients
    await asyncio.wait_for(_collect(a, "lone", PROMPTS[0]), WAIT_S)
    # An API server that closes while a probe waits on it does not hold the engine either.
    c = await EngineClient.connect(path)
    c._channel.close()  # gone without a word (its reader still runs until EOF)
    await asyncio.wait_for(_collect(b, "after-close", PROMPTS[1]), WAIT_S)
    await c.shutdown()


async def test_a_dead_engine_loop_fails_streams_and_health(engine, clients) -> None:
    a, _ = clients
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    stream = a.generate("doomed", PROMPTS[0], params)
    await stream.__anext__()

    def boom(*_: object) -> None:
        raise RuntimeError("injected step failure")

    engine.engine.step = boom
    with pytest.raises(EngineDeadError):
        async for _ in stream:
            pass
    await _until(lambda: not a.is_healthy(), "still healthy")
    with pytest.raises(EngineDeadError):
        await _collect(a, "refused", PROMPTS[1])


async def test_a_request_leaves_for_the_engine_process_at_once() -> None:
    """An "add" is written to the socket when sent (with what was queued before it), not at the end
    of the event-loop pass: the engine process takes a burst's requests in one by one while the API
    server parses the rest. Other messages still leave together at the end of the pass."""
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    channel = Channel(reader, writer)
    try:
        channel.send(("announce", 1))
        with pytest.raises(BlockingIOError):
            theirs.recv(1 << 16)  # queued for the end of the pass
        channel.send(("add", "r1"), now=True)
        data = theirs.recv(1 << 16)
        (size,) = struct.unpack("!I", data[:4])
        assert pickle.loads(data[4 : 4 + size]) == [("announce", 1), ("add", "r1")]
        await asyncio.sleep(0)  # the pass's own flush finds nothing left to send
        with pytest.raises(BlockingIOError):
            theirs.recv(1 << 16)
    finally:
        channel.close()
        theirs.close()


async def test_one_receive_takes_every_whole_frame_that_arrived() -> None:
    """Frames that arrived together come out of one ``receive``, in order (the engine process
    takes a burst's requests, written a frame each, in one wake-up); a frame split across reads
    waits for its rest; a closed connection ends with None."""
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    channel = Channel(reader, writer)

    def frame(messages: list) -> bytes:
        data = pickle.dumps(messages)
        return struct.pack("!I", len(data)) + data

    try:
        big = ("add", "r3", list(range(50_000)))  # several reads' worth
        theirs.sendall(frame([("add", "r1")]) + frame([("add", "r2"), ("submitted", 7)]))
        assert await channel.receive() == [("add", "r1"), ("add", "r2"), ("submitted", 7)]
        data = frame([big])
        theirs.sendall(data[:3])
        pending = asyncio.ensure_future(channel.receive())
        await asyncio.sleep(0.05)
        assert not pending.done()  # not even a whole header yet
        theirs.sendall(data[3:100_000])
        await asyncio.sleep(0.05)
        assert not pending.done()
        theirs.sendall(data[100_000:] + frame([("probe_back", 1)])[:2])
        assert await asyncio.wait_for(pending, WAIT_S) == [big]
        theirs.sendall(frame([("probe_back", 1)])[2:])
        assert await channel.receive() == [("probe_back", 1)]
        theirs.close()
        assert await channel.receive() is None
    finally:
        channel.close()
