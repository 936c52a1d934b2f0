"""`ferry serve --api-server-count 2`: one engine process behind two API server processes.

The replica must be the same service as with one process: the tests of the OpenAI API, of load,
of scoring and of bad input that run against the one-process replica run here too (imported
below; this module's ``server`` and ``tight`` fixtures replace theirs). The rest is what only this
mode has: both API servers take connections, one that dies is replaced and its requests are
aborted in the engine, a dead engine process stops the replica, SIGTERM drains, startup errors are
clean.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from server.engine_fanout import BROADCAST_DELAY_S
from tests.server.conftest import REPO, metric_value
from tests.server.test_cache_salt import (  # noqa: F401 - collected here, against this module's server
    test_blocks_are_reused_only_under_the_same_salt,
)
from tests.server.test_errors import (  # noqa: F401 - collected here, against this module's server
    http,
    test_embeddings_fuzz_never_5xx,
    test_known_mistakes,
    test_server_still_serves_after_the_fuzz,
)
from tests.server.test_load import (  # noqa: F401
    _aborted,
    _wait_idle,
    test_64_concurrent_streams_get_what_they_get_alone,
    test_api_key_guards_v1_but_not_health_or_metrics,
    test_disconnect_mid_responses_stream_frees_blocks,
    test_disconnect_mid_stream_frees_blocks,
    test_disconnect_non_streaming_frees_blocks,
    test_kv_tier_metrics_share_the_endpoint,
    test_request_timeout_aborts_cleanly,
)
from tests.server.test_openai_api import (  # noqa: F401
    aclient,
    llm,
    test_async_client_completion,
    test_async_client_streams_n_choices,
    test_chat_greedy_equals_offline_llm,
    test_chat_stream_role_first_usage_last,
    test_completion_greedy_equals_offline_llm,
    test_completion_many_prompts_and_n,
    test_completion_stream_equals_non_stream,
    test_kv_transfer_producer_answer_and_resume,
    test_metrics_use_vllm_names,
    test_per_request_histograms_of_vllms_dashboard,
    test_prefix_cache_hits_reported_as_cached_tokens,
    test_request_id_is_echoed_and_prefixes_the_response_id,
    test_tokenize_detokenize_match_tokenizer,
)
from tests.server.test_responses_store import (  # noqa: F401
    test_a_chain_continues_the_stored_conversation,
    test_retrieve_delete_and_input_items,
    test_the_memory_stores_size_is_in_metrics,
)
from tests.server.test_score import (  # noqa: F401
    test_rerank_sorts_by_score_keeps_top_n_and_documents,
    test_score_is_the_dot_product_of_the_embeddings,
)
from tests.server.test_structured_outputs import (  # noqa: F401
    no_whitespace,
    test_a_constraint_that_does_not_compile_is_a_400_before_the_stream,
    test_greedy_json_schema_over_http_equals_the_engine,
)
from tests.server.test_token_metrics import (  # noqa: F401
    test_a_stream_the_client_leaves_is_counted_with_its_tokens,
    test_finished_requests_count_every_token,
)

API_SERVERS = ["--api-server-count", "2"]


@pytest.fixture(scope="module")
def server(tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    srv = server_process(
        tiny_llama, [*API_SERVERS, "--num-kv-blocks", "1024", "--max-num-seqs", "64"], serve_logs
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def tight(tiny_llama: Path, serve_logs: Path, server_process) -> Iterator:
    flags = ["--max-num-seqs", "2", "--max-queued-requests", "2", "--request-timeout", "1"]
    flags += ["--api-key", "sekrit", "--num-kv-blocks", "512", "--kv-tier", "memory://"]
    srv = server_process(tiny_llama, [*API_SERVERS, *flags], serve_logs).start()
    yield srv
    srv.stop()


# -- the processes -----------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (multiprocessing's resource tracker left out)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if parent == pid and b"resource_tracker" not in cmdline:
            found.append(int(entry))
    return sorted(found)


def _is_engine(pid: int) -> bool | None:
    """Whether ``pid`` runs the engine (torch loaded); None when it has exited since it was listed."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None


def _processes(srv) -> tuple[int, list[int]]:
    """(engine pid, API server pids) of a replica; a child that exits meanwhile (one the supervisor
    is replacing) is left out."""
    kinds = {pid: _is_engine(pid) for pid in _children(srv.proc.pid)}
    engines = [p for p, engine in kinds.items() if engine]
    assert len(engines) == 1, kinds
    return engines[0], [p for p, engine in kinds.items() if engine is False]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _established(pid: int, port: int) -> int:
    """TCP connections to ``port`` that process ``pid`` holds open (from /proc, no tools needed)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == "01" and fields[9] in inodes:
                count += 1
    return count


async def test_flood_gets_429_counting_every_api_server(tight) -> None:
    # 2 running slots + 2 queued. Each API server counts the other's sequences as the engine
    # process reports them (within BROADCAST_DELAY_S of a change), and the engine process admits
    # them again over both: requests that reach both within that window cannot both pass. More
    # than 4 served only as a served one finishes during the flood (200 tokens each).
    body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True}
    auth = {"Authorization": "Bearer sekrit"}
    async with httpx.AsyncClient(timeout=60, headers=auth) as sender:
        responses = await asyncio.gather(
            *(sender.post(tight.url + "/v1/completions", json=body) for _ in range(16))
        )
        codes = [r.status_code for r in responses]
        served = [r for r in responses if r.status_code in (200, 408)]
        rejected = [r for r in responses if r.status_code == 429]
        assert len(served) + len(rejected) == 16 and 4 <= len(served) <= 8, codes
        assert all(r.headers["retry-after"].isdigit() for r in rejected)
        # Arriving after the others were admitted (and the engine process's count of them went out,
        # within BROADCAST_DELAY_S), each request knows the other API server's load: with 2 running
        # and 2 waiting (for up to the 1 s request timeout), every further one is refused. The late
        # ones go out soon after the engine runs 2, all at once: the 1 s window must not be spent
        # waiting (a busy 2-core machine can stretch a fixed sleep and a scrape).
        # The window is the 1 s the held ones wait: a machine too loaded to send the late ones
        # within it (a CI box under other work) tries again; the assertions hold for every try
        # that did, and one must.
        long = {**body, "max_tokens": 1000}
        tries = []
        for _ in range(3):
            sent = time.monotonic()
            held = [
                asyncio.ensure_future(sender.post(tight.url + "/v1/completions", json=long)) for _ in range(4)
            ]
            running = None
            for _ in range(200):
                text = (await sender.get(tight.url + "/metrics")).text
                running = metric_value(text, "vllm:num_requests_running", model_name=tight.model_name)
                if running == 2:
                    break
                await asyncio.sleep(0.005)
            assert running == 2
            await asyncio.sleep(5 * BROADCAST_DELAY_S)
            late_after = time.monotonic() - sent
            late = await asyncio.gather(
                *(sender.post(tight.url + "/v1/completions", json=body) for _ in range(6))
            )
            # The held ones end by the 1 s timeout (those still queued surely; a fast machine may
            # finish a running one's 1000 tokens first).
            held_codes = {r.status_code for r in await asyncio.gather(*held)}
            assert 408 in held_codes and held_codes <= {200, 408}, held_codes
            tries.append(round(late_after, 2))
            if late_after < 0.6:
                assert [r.status_code for r in late] == [429] * 6, [r.status_code for r in late]
                break
        else:
            raise AssertionError(f"the late requests never went out within the 1 s window: {tries} s")


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


class _Stream:
    """A streaming completion read by a thread: ``state`` is "running" from its first chunk, then
    "done" (``reason``: its finish reason; ``error``: an error event's body, if one came) or
    "broken" (the connection failed or was closed)."""

    def __init__(self, url: str, body: dict) -> None:
        self.state, self.reason, self.error = "starting", None, None
        self._client = httpx.Client(timeout=60)
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()
        assert self._first.wait(30) and self.state == "running", self.state

    def _run(self, url: str, body: dict) -> None:
        try:
            with self._client.stream("POST", url + "/v1/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.state = "running"
                        self._first.set()
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.error = event["error"]
                        else:
                            self.reason = event["choices"][0]["finish_reason"] or self.reason
            self.state = "done"
        except (httpx.HTTPError, RuntimeError, AssertionError):
            self.state = "broken"
        finally:
            self._first.set()

    def close(self) -> None:
        self._client.close()
        self._thread.join(10)


async def test_both_api_servers_take_connections(server) -> None:
    _, api = _processes(server)
    assert len(api) == 2
    before = _client_ports(server.port)  # other tests' keep-alive connections
    body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=32)) as http_client:
        started = asyncio.Event()
        count = 0

        async def hold() -> None:
            nonlocal count
            async with http_client.stream("POST", server.url + "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    count += 1
                    if count == 16:
                        started.set()
                    await started.wait()  # all 16 connections open at once
                    await asyncio.sleep(0.5)
                    break  # then hang up

        tasks = [asyncio.ensure_future(hold()) for _ in range(16)]
        await asyncio.wait_for(started.wait(), 30)
        inodes = {pid: _socket_inodes(pid) for pid in api}
        now = _client_ports(server.port)
        owners = [_owner(inodes, server.port, port) for port in now - before]
        earlier = [_owner(inodes, server.port, port) for port in now & before]
        held = [owners.count(pid) for pid in api]
        total = [held[i] + earlier.count(pid) for i, pid in enumerate(api)]
        await asyncio.gather(*tasks)
    # The supervisor hands each new connection to the API server holding the fewest: with the
    # connections other tests left open, they hold as many as each other, give or take one (the
    # kernel's SO_REUSEPORT, which this replaced, chose by a hash of the connection's addresses).
    assert sum(held) == 16 and max(total) - min(total) <= 1, (held, total)


def _owner(pid_inodes: dict[int, set[str]], server_port: int, client_port: int) -> int | None:
    """Which API server holds the server side of the connection from ``client_port``."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local = int(fields[1].rsplit(":", 1)[1], 16)
            remote = int(fields[2].rsplit(":", 1)[1], 16)
            if (local, remote) == (server_port, client_port):
                return next((pid for pid, inodes in pid_inodes.items() if fields[9] in inodes), None)
    return None


def _client_ports(server_port: int) -> set[int]:
    """The local ports of this process's open connections to ``server_port``."""
    mine = _socket_inodes(os.getpid())
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if (
                int(fields[2].rsplit(":", 1)[1], 16) == server_port
                and fields[3] == "01"
                and fields[9] in mine
            ):
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def connection_per_api_server(srv) -> list[HTTPConnection]:
    """A keep-alive connection to each of a replica's two API servers, in the order of their pids."""
    _, api = _processes(srv)
    pinned: dict[int, HTTPConnection] = {}
    # New connections until each API server holds one. An API server that was just started (a
    # test before replaced one) may take a few seconds to listen: until then the other gets all.
    deadline = time.monotonic() + 30
    tries = 0
    while len(pinned) < 2 and time.monotonic() < deadline:
        conn = HTTPConnection("127.0.0.1", srv.port, timeout=60)
        conn.request("GET", "/health")
        conn.getresponse().read()
        owner = _owner({pid: _socket_inodes(pid) for pid in api}, srv.port, conn.sock.getsockname()[1])
        if owner is not None and owner not in pinned:
            pinned[owner] = conn
        else:
            conn.close()
            tries += 1
            if tries % 64 == 0:
                time.sleep(0.5)
    assert len(pinned) == 2
    return [pinned[pid] for pid in api]


def call(
    conn: HTTPConnection, path: str, body: dict | None = None, method: str | None = None
) -> tuple[int, Any]:
    """A GET (or with ``body``, a POST): its status and JSON answer, an SSE answer's events, or the
    text of another answer."""
    conn.request(
        method or ("GET" if body is None else "POST"),
        path,
        body=json.dumps(body) if body is not None else None,
        headers={"content-type": "application/json"},
    )
    r = conn.getresponse()
    data = r.read()
    kind = r.getheader("content-type") or ""
    if kind.startswith("text/event-stream"):
        return r.status, [
            json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: ")
        ]
    return r.status, json.loads(data) if kind.startswith("application/json") else data.decode()


def test_render_and_generate_through_each_api_server(server) -> None:
    """vLLM's render and tokens-in/tokens-out generate answer alike through either API server."""
    body = {"prompt": "The sky is", "max_tokens": 4, "temperature": 0}
    answers = []
    for conn in connection_per_api_server(server):
        status, rendered = call(conn, "/v1/completions/render", body)
        assert status == 200
        status, out = call(conn, "/inference/v1/generate", rendered[0])
        assert status == 200
        status, real = call(conn, "/v1/completions", {**body, "return_token_ids": True})
        assert out["choices"][0]["token_ids"] == real["choices"][0]["token_ids"]
        answers.append((rendered[0]["token_ids"], out["choices"]))
        conn.close()
    assert answers[0] == answers[1]


def test_a_response_stored_through_one_api_server_continues_through_the_other(server) -> None:
    """--responses-store memory: the engine process keeps the records for every API server."""
    first_conn, second_conn = connection_per_api_server(server)
    greedy = {"max_output_tokens": 4, "temperature": 0}
    status, first = call(first_conn, "/v1/responses", {"input": "My name is Ada.", **greedy})
    assert status == 200 and first["store"] is True
    status, second = call(
        second_conn, "/v1/responses", {"input": "And?", "previous_response_id": first["id"], **greedy}
    )
    assert status == 200 and second["previous_response_id"] == first["id"]
    status, got = call(second_conn, f"/v1/responses/{first['id']}")
    assert status == 200 and got["output"] == first["output"]
    for conn in (first_conn, second_conn):
        conn.close()


def test_a_background_response_is_read_streamed_and_cancelled_through_the_other(server, scrape) -> None:
    """The API server running a background response is not the one asked about it: its record,
    its events and its cancel flag go through the engine process's store."""
    first_conn, second_conn = connection_per_api_server(server)
    body = {"input": "Hello there", "max_output_tokens": 16, "temperature": 0, "background": True}
    status, events = call(first_conn, "/v1/responses", {**body, "stream": True})
    assert status == 200 and events[-1]["type"] in ("response.completed", "response.incomplete")
    response_id = events[0]["response"]["id"]
    status, resumed = call(second_conn, f"/v1/responses/{response_id}?stream=true&starting_after=3")
    assert status == 200 and resumed == events[4:]
    long = {"input": "x", "max_output_tokens": 900, "ignore_eos": True, "background": True}
    status, queued = call(first_conn, "/v1/responses", long)
    assert status == 200 and queued["status"] == "queued"
    path = f"/v1/responses/{queued['id']}"
    _wait(lambda: call(second_conn, path)[1]["status"] == "in_progress", 60, "no first output")
    assert scrape(server.url, "ferry:responses_background_running") == 1
    aborted = _aborted(server.url, scrape, server.model_name)
    status, cancelled = call(second_conn, path + "/cancel", method="POST")
    assert status == 200 and cancelled["status"] == "cancelled", cancelled
    assert 0 < cancelled["usage"]["output_tokens"] < 900
    assert call(first_conn, path) == (200, cancelled)
    # The engine aborts it (counted so: left to run, it would end at its length).
    _wait(lambda: scrape(server.url, "vllm:num_requests_running") == 0, 60, "the engine still runs it")
    assert _aborted(server.url, scrape, server.model_name) == aborted + 1
    assert scrape(server.url, "ferry:responses_background_running") == 0
    for conn in (first_conn, second_conn):
        conn.close()


def test_a_killed_api_server_is_replaced_and_its_requests_aborted(server, scrape) -> None:
    engine, api = _processes(server)
    name = server.model_name
    body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    before = _client_ports(server.port)  # other tests' keep-alive connections
    generated = scrape(server.url, "vllm:generation_tokens_total", model_name=name)
    streams = [_Stream(server.url, body) for _ in range(6)]
    # Each stream sits in one API server; kill the one holding the most of them.
    inodes = {pid: _socket_inodes(pid) for pid in api}
    owners = [_owner(inodes, server.port, port) for port in _client_ports(server.port) - before]
    held = {pid: owners.count(pid) for pid in api}
    assert sum(held.values()) == 6, held
    victim = max(held, key=held.__getitem__)
    os.kill(victim, signal.SIGKILL)
    # Its streams break at once, and the engine aborts their requests (their API server's
    # connection closed); the other API server's streams keep running.
    _wait(lambda: sum(s.state == "broken" for s in streams) == held[victim], 60, "streams did not break")
    survivors = 6 - held[victim]
    _wait(
        lambda: scrape(server.url, "vllm:num_requests_running", model_name=name) == survivors,
        60,
        "the dead API server's requests still run",
    )
    # Cut short, not run to their length (the six, started together, would all end at 1000 tokens
    # together: the survivors, still running, have fewer). The dead API server never counted them
    # as aborted: the engine's own token count tells.
    assert scrape(server.url, "vllm:generation_tokens_total", model_name=name) - generated < 6 * 1000
    assert sum(s.state == "running" for s in streams) == survivors
    # The supervisor starts a new API server over the same engine, and it serves.
    _wait(
        lambda: victim not in _children(server.proc.pid) and len(_children(server.proc.pid)) == 3,
        30,
        "none new",
    )
    new_engine, new_api = _processes(server)
    assert new_engine == engine and len(new_api) == 2
    fresh = next(p for p in new_api if p not in api)
    ticks = _cpu_ticks(fresh)

    def fresh_serves() -> bool:
        for _ in range(8):  # new connections each: the kernel picks the process
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "y", "max_tokens": 2}, timeout=30)
            assert r.status_code == 200
        return _established(fresh, server.port) > 0 or _cpu_ticks(fresh) > ticks + 2

    _wait(fresh_serves, 30, "the new API server never served")
    for stream in streams:
        stream.close()
    _wait_idle(server.url, scrape, name)


def test_a_background_response_of_a_killed_api_server_fails_through_the_other(server, scrape) -> None:
    """--responses-store memory: the engine process holds the leases. The API server running a
    streamed background response is SIGKILLed; the other one reports it failed once its lease
    lapsed (the default 5 s TTL), and a stream following it there ends with response.failed."""
    _, api = _processes(server)
    owner, other = connection_per_api_server(server)
    body = {"input": "x", "max_output_tokens": 900, "ignore_eos": True, "background": True, "stream": True}
    generated = scrape(server.url, "vllm:generation_tokens_total")
    owner.request(
        "POST", "/v1/responses", body=json.dumps(body), headers={"content-type": "application/json"}
    )
    answer = owner.getresponse()
    events = []
    while len(events) < 4:  # the fourth comes with its first output: it runs
        line = answer.readline()
        if line.startswith(b"data: "):
            events.append(json.loads(line[6:]))
    os.kill(api[0], signal.SIGKILL)
    killed = time.monotonic()
    path = f"/v1/responses/{events[0]['response']['id']}"
    status, followed = call(other, path + "?stream=true")  # follows the store's log until its end
    took = time.monotonic() - killed
    # The events its process kept (maybe none: killed before its first batch), then the failure.
    assert status == 200 and followed[-1]["type"] == "response.failed"
    assert [e["sequence_number"] for e in followed] == list(range(len(followed)))
    kept = min(len(followed) - 1, len(events))
    assert followed[:kept] == events[:kept]
    failed = followed[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "the process running it stopped" in failed["error"]["message"]
    # No sooner: its lease (the upper bound only tells "at the lease's lapse" from a hang).
    assert 4 < took < 5 + 30, f"reported failed {took:.1f} s after the kill"
    assert call(other, path) == (200, failed)
    assert scrape(server.url, "ferry:responses_background_orphaned_total") == 1
    _wait(lambda: scrape(server.url, "vllm:num_requests_running") == 0, 60, "the engine still runs it")
    # Cut short, not run to its length (the dead API server never counted it as aborted: the
    # engine's own token count tells).
    assert scrape(server.url, "vllm:generation_tokens_total") - generated < 900
    for conn in (owner, other):
        conn.close()
    # The supervisor replaces the killed API server (for the tests after this one).
    _wait(
        lambda: api[0] not in _children(server.proc.pid) and len(_children(server.proc.pid)) == 3,
        30,
        "none new",
    )


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


# -- lifecycle (replicas of their own) -------------------------------------------------------------


def _gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_sigterm_deregisters_drains_then_stops_every_process(
    tiny_llama: Path, serve_logs: Path, server_process, redis_url
) -> None:
    srv = server_process(tiny_llama, [*API_SERVERS, "--register", redis_url], serve_logs).start()
    try:
        engine, api = _processes(srv)
        r = redis.Redis.from_url(redis_url)
        key = f"ferry:replica:{srv.url}"
        _wait(lambda: r.get(key) is not None, 60, "never registered")
        assert json.loads(r.get(key))["url"] == srv.url  # once for the replica, by the supervisor
        assert len(r.keys("ferry:replica:*")) == 1
        stream = _Stream(srv.url, {"prompt": "x", "max_tokens": 600, "ignore_eos": True, "stream": True})
        srv.proc.send_signal(signal.SIGTERM)
        _wait(lambda: r.get(key) is None, 60, "still registered while draining")
        health = httpx.get(srv.url + "/health")  # whichever API server answers: both drain
        assert health.status_code == 503 and health.json()["error"]["code"] == "draining"
        refused = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert refused.status_code == 503
        _wait(lambda: stream.state != "running", 60, "the stream never ended")
        assert stream.state == "done" and stream.reason == "length"  # the in-flight stream completed
        assert srv.proc.wait(30) == 0
        assert _gone([engine, *api], 60)
    finally:
        srv.stop()


def test_a_dead_engine_process_stops_the_replica(tiny_llama: Path, serve_logs: Path, server_process) -> None:
    srv = server_process(tiny_llama, API_SERVERS, serve_logs).start()
    try:
        engine, api = _processes(srv)
        stream = _Stream(srv.url, {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True})
        os.kill(engine, signal.SIGKILL)
        _wait(lambda: stream.state != "running", 60, "the stream hung on a dead engine")
        # Its API server ended it with an error event (the engine cannot serve), not a hang.
        assert stream.state == "done" and stream.reason is None
        assert "engine" in stream.error["message"], stream.error
        assert srv.proc.wait(60) == 1  # the orchestrator restarts the replica
        assert _gone(api, 60)
        assert "the engine process exited" in srv.log()
    finally:
        srv.stop()


def test_a_stopped_engine_process_is_reported_unhealthy(
    tiny_llama: Path, serve_logs: Path, server_process
) -> None:
    """A wedged engine process keeps its sockets open: its silence (no heartbeat) makes /health a
    503 and new requests 503s, so a router ejects the replica; heard from again, it serves."""
    srv = server_process(tiny_llama, API_SERVERS, serve_logs).start()
    try:
        engine, _ = _processes(srv)
        conns = connection_per_api_server(srv)
        body = {"prompt": "x", "max_tokens": 2}
        assert [call(conn, "/v1/completions", body)[0] for conn in conns] == [200, 200]
        os.kill(engine, signal.SIGSTOP)
        try:
            for conn in conns:  # each API server on its own
                _wait(lambda conn=conn: call(conn, "/health")[0] == 503, 60, "never unhealthy")
                assert call(conn, "/v1/completions", body)[0] == 503
        finally:
            os.kill(engine, signal.SIGCONT)
        # Each API server logs the recovery when the engine's next bytes arrive, asked or not.
        again = "the engine process is heard from again"
        _wait(lambda: srv.log().count(again) == len(conns), 60, "the recovery was never logged")
        for conn in conns:
            _wait(lambda conn=conn: call(conn, "/health")[0] == 200, 60, "never healthy again")
            assert call(conn, "/v1/completions", body)[0] == 200
        assert "the engine process sent nothing for 5 s" in srv.log()
    finally:
        srv.stop()


def test_a_stopped_api_server_is_killed_and_started_again(
    tiny_llama: Path, serve_logs: Path, server_process
) -> None:
    """An API server whose event loop stops (SIGSTOP here; a loop blocked for good alike) holds its
    connections forever and goes on taking new ones: silent for API_SERVER_SILENCE_S, it is killed
    and started again, and the replica serves on both."""
    srv = server_process(tiny_llama, API_SERVERS, serve_logs).start()
    try:
        _, (victim, other) = _processes(srv)
        os.kill(victim, signal.SIGSTOP)
        _wait(lambda: not _alive(victim), 60, "the stopped API server was never killed")
        _wait(
            lambda: victim not in (api := _processes(srv)[1]) and len(api) == 2,
            30,
            "no API server was started in its place",
        )
        assert other in _processes(srv)[1]
        conns = connection_per_api_server(srv)
        body = {"prompt": "x", "max_tokens": 2}
        assert [call(conn, "/v1/completions", body)[0] for conn in conns] == [200, 200]
        assert f"(pid {victim}) sent nothing for 10 s: killing it" in srv.log()
    finally:
        srv.stop()


def test_children_die_with_a_killed_supervisor(tiny_llama: Path, serve_logs: Path, server_process) -> None:
    srv = server_process(tiny_llama, API_SERVERS, serve_logs).start()
    try:
        engine, api = _processes(srv)
        srv.proc.kill()
        assert _gone([engine, *api], 60)
    finally:
        srv.stop()


def _serve(args: list[str], timeout: float = 90) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "ferry", "serve", "--num-threads", "1", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_startup_errors_are_clean(tiny_llama: Path) -> None:
    done = _serve(["--model", str(tiny_llama), "--api-server-count", "0"])
    assert done.returncode == 2 and "--api-server-count must be at least 1" in done.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _serve(["--model", str(tiny_llama), "--port", str(port), *API_SERVERS])
    assert done.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
    # The engine process refuses its flags: the operator reads its reason, as from one process.
    done = _serve(["--model", str(tiny_llama), "--port", "0", "--max-model-len", "99999", *API_SERVERS])
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().endswith(
        "max_model_len=99999 is more than the 1024 positions of the model (max_position_embeddings=1024)"
    )


def test_a_batch_is_uploaded_run_and_cancelled_through_either_api_server(server) -> None:
    """The Batch API's directory is shared by the API servers (the supervisor's): a file uploaded
    through one is a batch's input through the other, which runs it; the first reads its progress
    and cancels it (a marker the running process polls)."""
    first_conn, second_conn = connection_per_api_server(server)
    # Up to 8 run at once (--max-batch-concurrency): the cancel lands while the second 8 run, long
    # enough (1000 tokens) that the running process sees it (it polls every 0.2 s) before they end.
    body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True}
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body} for i in range(16)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines)
    form = (
        '--b0undary\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        '--b0undary\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        f"Content-Type: application/jsonl\r\n\r\n{data}\r\n--b0undary--\r\n"
    )
    first_conn.request(
        "POST",
        "/v1/files",
        body=form.encode(),
        headers={"content-type": "multipart/form-data; boundary=b0undary"},
    )
    upload = json.loads(first_conn.getresponse().read())
    assert upload["bytes"] == len(data.encode()) and upload["purpose"] == "batch"
    assert call(second_conn, f"/v1/files/{upload['id']}") == (200, upload)
    create = {"input_file_id": upload["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    status, batch = call(second_conn, "/v1/batches", create)
    assert status == 200 and batch["status"] == "validating"
    path = f"/v1/batches/{batch['id']}"
    # Generous deadlines: a loaded 2-core machine runs the first 8 requests slowly.
    _wait(lambda: call(first_conn, path)[1]["request_counts"]["completed"] >= 1, 120, "no request done")
    status, cancelling = call(first_conn, path + "/cancel", method="POST")
    assert status == 200 and cancelling["status"] == "cancelling", cancelling
    _wait(lambda: call(first_conn, path)[1]["status"] == "cancelled", 120, "not cancelled")
    status, done = call(first_conn, path)
    assert 1 <= done["request_counts"]["completed"] < 16 and done["cancelled_at"] >= done["cancelling_at"]
    assert call(second_conn, path) == (200, done)
    assert batch["id"] in [b["id"] for b in call(first_conn, "/v1/batches")[1]["data"]]
    for conn in (first_conn, second_conn):
        conn.close()
