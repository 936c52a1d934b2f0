"""How the router ends a relayed generation stream whose replica stops answering, and what it asks
a replica for: driven against a scripted replica (an HTTP server in this process) that cuts a
stream where a test needs it, which a real replica does only when killed at the right token."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import httpx
import pytest
from router_harness import Cluster, free_port

MODELS = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _choice(index: int, text: str, finish: str | None = None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish, "token_ids": [7]}


class ScriptedReplica:
    """Answers health and models; a completions stream sends ``events`` and then, unless
    ``done``, drops the connection (a replica dying mid-stream), or with ``hang`` holds it open
    and answers health with 503 from then on (a replica that stopped answering). Keeps each
    request body."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.events: list[bytes] = []
        self.done = False
        self.hang = False
        self.hung = False
        self.bodies: list[dict] = []
        self._tasks: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port)
        )
        self._ready.set()
        self._loop.run_forever()

    async def _stop(self) -> None:
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._loop.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                path = head[0].split(" ")[1]
                headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if path == "/v1/completions" and not json.loads(body).get("stream"):
                    self.bodies.append(json.loads(body))
                    if self.hang:  # never answers
                        self.hung = True
                        await reader.read()
                        return
                    out = json.dumps({"id": "w", "choices": [_choice(0, "whole", "length")]}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
                    writer.write(b"content-length: %d\r\n\r\n%s" % (len(out), out))
                    await writer.drain()
                    continue
                if path == "/v1/completions":
                    self.bodies.append(json.loads(body))
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
                    writer.write(b"transfer-encoding: chunked\r\n\r\n")
                    for event in [*self.events, *([b"data: [DONE]\n\n"] if self.done else [])]:
                        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                        await writer.drain()
                    if self.done:
                        writer.write(b"0\r\n\r\n")
                        await writer.drain()
                        continue
                    if self.hang:
                        self.hung = True
                        await reader.read()  # until the router drops the connection
                    return  # mid-body: the connection just closes
                out = MODELS if path == "/v1/models" else b'{"status":"ok"}'
                status = b"503 Service Unavailable" if self.hung and path == "/health" else b"200 OK"
                writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n")
                writer.write(b"content-length: %d\r\n\r\n%s" % (len(out), out))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self._tasks.discard(task)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop)


@pytest.fixture(scope="module")
def scripted(cluster: Cluster) -> Iterator[tuple[ScriptedReplica, str]]:
    replica = ScriptedReplica()
    router = cluster.router("--replica", replica.url, "--policy", "round_robin")
    yield replica, router.url
    replica.close()


def _stream(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line]


def test_an_n_choice_stream_cut_after_one_choice_finished_ends_with_an_error(scripted) -> None:
    replica, url = scripted
    replica.done = False
    replica.events = [
        _event({"id": "c", "choices": [_choice(0, "a"), _choice(1, "b")]}),
        _event({"id": "c", "choices": [_choice(0, "", "stop")]}),
        _event({"id": "c", "choices": [_choice(1, "c")]}),
    ]
    lines = _stream(url, {"model": "m", "prompt": "x", "n": 2, "stream": True, "max_tokens": 50})
    # Choice 1 never finished: the client is told the stream failed, not handed a clean end.
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "bad_gateway"
    assert lines[-1] == "data: [DONE]"
    # Every choice finished (two prompts, one choice each): a cut before [DONE] loses nothing.
    replica.events = [
        _event({"id": "c", "choices": [_choice(0, "a", "stop")]}),
        _event({"id": "c", "choices": [_choice(1, "b", "length")]}),
    ]
    lines = _stream(url, {"model": "m", "prompt": ["x", "y"], "stream": True, "max_tokens": 1})
    assert [json.loads(line.removeprefix("data: ")).get("error") for line in lines[:-1]] == [None, None]
    assert lines[-1] == "data: [DONE]"


def test_a_clients_invalid_return_token_ids_reaches_the_replica_as_sent(scripted) -> None:
    # The router asks for token ids itself (to resume a stream elsewhere); it must not overwrite a
    # value the replica would refuse with a 400 (a real replica answers 400 to "x").
    replica, url = scripted
    replica.done = True
    replica.events = [_event({"id": "c", "choices": [_choice(0, "a", "stop")]})]
    replica.bodies.clear()
    for value, sent in (("x", "x"), (False, True), (None, True)):
        body = {"model": "m", "prompt": "x", "stream": True, "max_tokens": 1}
        if value is not None:
            body["return_token_ids"] = value
        _stream(url, body)
        assert replica.bodies[-1]["return_token_ids"] == sent


def test_a_stream_on_a_replica_that_stops_answering_resumes_once_it_is_ejected(cluster: Cluster) -> None:
    # The replica holds the stream's connection open and sends nothing more (a hung process); its
    # health probes fail, it is ejected, and the stream is cut then: the relay resumes it on the
    # other replica at once instead of waiting out the read timeout (--request-timeout, 600 s).
    hung, other = ScriptedReplica(), ScriptedReplica()
    try:
        hung.hang = True
        hung.events = [_event({"id": "c", "choices": [_choice(0, "a")]})] * 2
        other.done = True
        other.events = [_event({"id": "d", "choices": [_choice(0, "b", "length")]})]
        router = cluster.router("--replica", hung.url, "--replica", other.url, "--policy", "round_robin")
        lines = _stream(router.url, {"model": "m", "prompt": "x", "stream": True, "max_tokens": 3})
        texts = [json.loads(line.removeprefix("data: "))["choices"][0]["text"] for line in lines[:-1]]
        assert texts == ["a", "a", "b"] and lines[-1] == "data: [DONE]"
        assert [b.get("resume") for b in hung.bodies] == [None]
        assert [b["resume"] for b in other.bodies] == [{"token_ids": [7, 7]}]
    finally:
        hung.close()
        other.close()


def test_a_request_waiting_on_a_replica_that_stops_answering_is_retried_once_it_is_ejected(
    cluster: Cluster,
) -> None:
    # A whole answer (no head yet) from a replica that holds the connection and sends nothing: cut
    # when the replica is ejected, and retried on the other one at once.
    hung, other = ScriptedReplica(), ScriptedReplica()
    try:
        hung.hang = True
        router = cluster.router("--replica", hung.url, "--replica", other.url, "--policy", "round_robin")
        r = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "whole"
        assert (len(hung.bodies), len(other.bodies)) == (1, 1)
    finally:
        hung.close()
        other.close()
