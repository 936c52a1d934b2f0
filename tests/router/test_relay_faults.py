"""Faults of a replica's answers, through a real `ferry router` process: a half-open circuit's
trial that ends without a verdict, an answer that breaks off mid-body, and the metrics of a
replica removed while a request to it is in flight (and the trial's bookkeeping on a fake clock).

The upstreams are fake replicas (raw HTTP/1.1 on loopback, answering POSTs from a script) because
a real replica cannot be made to answer 500, then 429, or to cut a body short, on demand.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from router_harness import Proc, free_port, metric, replicas_view, wait_until

from router.replica import Circuit, HealthPolicy, Replica

EMBED = {"model": "fake", "input": "hello"}  # /v1/embeddings: relayed byte for byte (Relay.forward)
OK_BODY = json.dumps({"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.5]}]})
MODELS = json.dumps({"object": "list", "data": [{"id": "fake", "object": "model"}]}).encode()
# What a cut answer's replica sends before it closes the connection (of 100000 bytes promised, or
# of a chunked body without its last chunk).
CUT_SENT = {"cut_length": b"[" + b"1," * 25_000, "cut_chunked": b"x" * 4096}
HELD = (b'{"object": "list", "data": [', b'{"index": 0}]}')  # a held answer: first part, then the rest


class FakeReplica:
    """Answers /health and /v1/models as a replica does; each POST takes the next step of
    ``script`` (then "ok" once it is used up):

    * ``ok``: 200 with OK_BODY; ``500`` / ``429``: that status with an error body;
    * ``stall``: no answer until the router closes the connection;
    * ``stall_body``: the head and part of the body, then nothing until the router closes;
    * ``cut_length``: a head promising 100000 bytes, CUT_SENT's 50001, then the connection closes;
    * ``cut_chunked``: a chunked head, one 4096-byte chunk, then the connection closes (no last chunk);
    * ``held``: the head and HELD[0], the rest (HELD[1]) once ``let_go()`` is called.
    """

    def __init__(self, script: list[str]) -> None:
        self.script = list(script)
        self.posts = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._go = asyncio.Event()
        self._server = self._call(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def let_go(self) -> None:
        self._loop.call_soon_threadsafe(self._go.set)

    def close(self) -> None:
        self._server.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._answer(reader, writer):
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """One exchange; False when the connection is done."""
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        method, path = head[0].split(" ")[:2]
        length = next((int(h.split(":", 1)[1]) for h in head if h.lower().startswith("content-length:")), 0)
        await reader.readexactly(length)
        step = "ok"
        if method == "POST":
            self.posts += 1
            step = self.script.pop(0) if self.script else "ok"
        if path == "/health":
            writer.write(_answer(200, b'{"status": "ok"}'))
        elif path == "/v1/models":
            writer.write(_answer(200, MODELS))
        elif step in ("500", "429"):
            error = {"error": {"message": "scripted", "type": "x", "param": None, "code": int(step)}}
            writer.write(_answer(int(step), json.dumps(error).encode()))
        elif step == "stall":
            await reader.read()  # until the router hangs up
            return False
        elif step == "stall_body":
            writer.write(_head(200, b"content-length: 100") + b'{"object"')
            await writer.drain()
            await reader.read()
            return False
        elif step == "cut_length":
            writer.write(_head(200, b"content-length: 100000") + CUT_SENT[step])
            await writer.drain()
            return False
        elif step == "cut_chunked":
            writer.write(_head(200, b"transfer-encoding: chunked") + b"1000\r\n" + CUT_SENT[step] + b"\r\n")
            await writer.drain()
            return False
        elif step == "held":
            whole = b"".join(HELD)
            writer.write(_head(200, b"content-length: %d" % len(whole)) + HELD[0])
            await writer.drain()
            await self._go.wait()
            writer.write(HELD[1])
        else:
            writer.write(_answer(200, OK_BODY.encode()))
        await writer.drain()
        return True


def _head(status: int, framing: bytes) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n%s\r\n\r\n" % (status, framing)


def _answer(status: int, body: bytes) -> bytes:
    return _head(status, b"content-length: %d" % len(body)) + body


@pytest.fixture
def fakes() -> Iterator[Callable[..., FakeReplica]]:
    made: list[FakeReplica] = []

    def make(*script: str) -> FakeReplica:
        made.append(FakeReplica(list(script)))
        return made[-1]

    yield make
    for f in made:
        f.close()


@pytest.fixture
def router(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """Starts a router over the given fake replicas and waits until every one is routable."""
    procs: list[Proc] = []

    def start(replicas: list[FakeReplica], *args: str) -> Proc:
        port = free_port()
        flags = [f for r in replicas for f in ("--replica", r.url)]
        argv = ["router", "--port", str(port), "--health-interval", "0.2", *flags, *args]
        p = Proc(argv, port, tmp_path / f"router-{port}.log").start()
        procs.append(p)
        p.wait_http(30.0, ok=(200, 503))
        assert wait_until(lambda: all(v["routable"] for v in replicas_view(p).values()), 60)
        return p

    yield start
    for p in procs:
        p.stop()


def _embed(router: Proc, timeout: float = 10.0) -> httpx.Response:
    return httpx.post(router.url + "/v1/embeddings", json=EMBED, timeout=timeout)


def _circuit(router: Proc, fake: FakeReplica) -> tuple[str, bool, int]:
    view = replicas_view(router)[fake.url]
    return view["circuit"], view["routable"], view["inflight"]


def _assert_cooling_down(router: Proc, fake: FakeReplica, sent: float, cooldown: float) -> None:
    """The circuit opened by the answer to a request sent at ``sent`` is open, and not routable
    while its cool-down lasts (when this thread reads it later than that, on a loaded machine, the
    cool-down may be over: routable is then no verdict)."""
    state, routable, _ = _circuit(router, fake)
    assert state == "open"
    assert not routable or time.monotonic() - sent >= cooldown


def test_only_the_current_trial_ending_without_a_verdict_frees_the_slot() -> None:
    r = Replica(
        "http://x", policy=HealthPolicy(circuit_failures=1, circuit_cooldown=1.0, circuit_cooldown_max=8)
    )
    r.on_probe_ok(0.0)
    assert (r.acquire(1, 0.0), r.acquire(1, 0.0)) == (0, 0)  # closed: no trials
    r.on_request_failure(0.1)
    r.release(1, True, 0)
    assert r.circuit.state is Circuit.OPEN
    assert r.acquire(1, 1.2) == 1 and not r.routable(1.2)  # the first trial
    r.on_request_failure(1.3)  # the other request, sent while closed, fails: open again, 2 s
    r.release(1, True, 0)
    assert r.circuit.state is Circuit.OPEN and not r.routable(3.2)
    assert r.acquire(1, 3.4) == 2 and not r.routable(3.4)  # the second trial
    r.release(1, True, 1)  # the first one's client leaves: not the trial in flight, no slot freed
    assert r.circuit.state is Circuit.HALF_OPEN and not r.routable(3.5)
    r.release(1, True, 2)  # the second one's client leaves: the slot is free
    assert r.circuit.state is Circuit.HALF_OPEN and r.routable(3.5)
    assert r.acquire(1, 3.6) == 3
    r.on_request_failure(3.7)  # a verdict first, then the release: it stays open
    r.release(1, True, 3)
    assert r.circuit.state is Circuit.OPEN and r.circuit.cooldown == 4.0 and not r.routable(7.6)
    assert r.acquire(1, 7.7) == 4
    r.on_request_success()
    r.release(1, True, 4)
    assert r.circuit.state is Circuit.CLOSED and r.circuit.cooldown == 1.0 and r.routable(7.8)
    assert (r.inflight, r.prefilling, r.inflight_tokens) == (0, 0, 0)


@pytest.mark.parametrize("stall", ["stall", "stall_body"])
def test_a_trial_whose_client_leaves_frees_the_half_open_slot(fakes, router, stall: str) -> None:
    """Before the head (Relay.open is cancelled) or after it (Relay.forward is): either way the
    trial ends without a verdict, and the next request must be let through as the trial."""
    fake = fakes("500", stall, "ok")
    r = router([fake], "--circuit-failures", "1", "--circuit-cooldown", "0.5")
    sent = time.monotonic()
    assert _embed(r).status_code == 500  # one failure opens the circuit
    _assert_cooling_down(r, fake, sent, 0.5)
    assert wait_until(lambda: _circuit(r, fake)[1], 60)  # cooled down: a trial may go
    with pytest.raises(httpx.ReadTimeout):  # the trial's client gives up
        _embed(r, timeout=0.5)
    assert wait_until(lambda: _circuit(r, fake)[2] == 0, 60)  # the trial is over (client gone)
    assert _circuit(r, fake) == ("half_open", True, 0)  # no verdict: the slot is free again
    answer = _embed(r)
    assert (answer.status_code, answer.text) == (200, OK_BODY)
    assert _circuit(r, fake) == ("closed", True, 0)
    assert fake.posts == 3
    assert metric(r.url, "ferry:router_requests_total", {"replica": fake.url, "status": "499"}) == 1


def test_a_trial_answered_429_and_sent_elsewhere_frees_the_half_open_slot(fakes, router) -> None:
    flaky, steady = fakes("500", "429", "ok"), fakes()
    r = router(
        [flaky, steady], "--policy", "round_robin", "--circuit-failures", "1", "--circuit-cooldown", "0.5"
    )

    def until_flaky_has(posts: int) -> list[int]:
        """Statuses of requests sent until ``flaky`` got its ``posts``-th (four at most)."""
        statuses = []
        while flaky.posts < posts and len(statuses) < 4:
            statuses.append(_embed(r).status_code)
        return statuses

    sent = time.monotonic()
    assert until_flaky_has(1) == [500]  # round robin starts with the first replica
    _assert_cooling_down(r, flaky, sent, 0.5)
    assert wait_until(lambda: _circuit(r, flaky)[1], 60)
    # Round robin's turn is the steady replica's, then the flaky one's: its trial, answered 429
    # and re-sent to the steady replica.
    assert until_flaky_has(2) == [200, 200]
    assert (flaky.posts, steady.posts) == (2, 2)
    assert _circuit(r, flaky) == ("half_open", True, 0)  # 429 is no verdict: the slot is free again
    assert until_flaky_has(3) == [200]  # the next trial, answered
    assert (flaky.posts, steady.posts) == (3, 2)
    assert _circuit(r, flaky) == ("closed", True, 0)
    assert metric(r.url, "ferry:router_requests_total", {"replica": flaky.url, "status": "429"}) == 1


@pytest.mark.parametrize("cut", ["cut_length", "cut_chunked"])
def test_an_answer_broken_mid_body_is_cut_off_not_ended(fakes, router, cut: str) -> None:
    fake = fakes(cut, "ok")
    r = router([fake])
    received = bytearray()
    with pytest.raises(httpx.RemoteProtocolError):  # no last chunk: the client knows it is cut short
        with httpx.stream("POST", r.url + "/v1/embeddings", json=EMBED, timeout=10) as resp:
            assert resp.status_code == 200
            for chunk in resp.iter_raw():
                received += chunk
    assert bytes(received) == CUT_SENT[cut]  # everything the replica sent, nothing more
    assert wait_until(lambda: _circuit(r, fake)[2] == 0, 60)
    assert metric(r.url, "ferry:router_requests_total", {"replica": fake.url, "status": "broken"}) == 1
    assert replicas_view(r)[fake.url]["failures"] == 1
    answer = _embed(r)  # the router serves on
    assert (answer.status_code, answer.text) == (200, OK_BODY)


def _inflight_series(router: Proc) -> list[str]:
    text = httpx.get(router.url + "/metrics", timeout=5).text
    return re.findall(r'^ferry:router_inflight\{replica="([^"]*)"\}', text, re.M)


def test_a_removed_replica_s_inflight_series_stays_gone(fakes, router) -> None:
    holder, other = fakes("held"), fakes()
    r = router([holder, other], "--policy", "round_robin")
    result: list[httpx.Response] = []
    client = threading.Thread(target=lambda: result.append(_embed(r)))
    client.start()
    try:
        assert wait_until(lambda: replicas_view(r)[holder.url]["inflight"] == 1, 60)
        assert _embed(r).status_code == 200  # round robin: the next request is the other's
        assert (holder.posts, other.posts) == (1, 1)
        assert _inflight_series(r) == [holder.url, other.url]
        removed = httpx.request("DELETE", r.url + "/admin/replicas", json={"url": holder.url}, timeout=5)
        assert removed.status_code == 200
        assert _inflight_series(r) == [other.url]
    finally:
        holder.let_go()
        client.join(10)
    assert (result[0].status_code, result[0].content) == (200, b"".join(HELD))  # the request finished
    done = {"replica": holder.url, "status": "200"}
    assert wait_until(lambda: metric(r.url, "ferry:router_requests_total", done) == 1, 60)
    assert _inflight_series(r) == [other.url]  # not re-created by the request's release
    assert list(replicas_view(r)) == [other.url]
