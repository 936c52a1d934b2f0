"""What the router re-sends to another replica when one fails before answering: a request whose
repetition is harmless (a generation, a ``GET``) is re-sent; a ``POST`` that changes what a replica
keeps (a file uploaded, a batch created or cancelled) is not once the replica got it and may have
acted (it closed the connection without an answer, or timed out), as nginx does not pass a
non-idempotent request on, nor on a kept-alive connection that may turn out closed; and a Files/Batches request re-sent goes to the next batch home (the
lowest URL left), where the client's next request will look for what it made."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from router_harness import Cluster, Proc
from scripted_replica import ScriptedReplica


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[ScriptedReplica], Proc]]:
    replicas = sorted((ScriptedReplica() for _ in range(3)), key=lambda r: r.url)
    tmp = tmp_path_factory.mktemp("retry-safety")
    cluster = Cluster(tmp, tmp)
    # Highest URL first: round_robin's first pick among the replicas left is the highest.
    args = [a for r in reversed(replicas) for a in ("--replica", r.url)]
    router = cluster.router(*args, "--policy", "round_robin", "--circuit-failures", "20", all_routable=True)
    yield replicas, router
    cluster.close()
    for r in replicas:
        r.close()


def _hits(replicas: list[ScriptedReplica], method: str, path: str) -> list[int]:
    return [r.requests.count((method, path)) for r in replicas]


def test_a_batch_the_replica_may_have_created_is_not_created_again(setup) -> None:
    replicas, router = setup
    # A kept-alive connection to its home first: one the replica closes after reading the request
    # is not taken for an idle one the replica closed, and the request is not sent on a second.
    assert httpx.get(router.url + "/v1/batches", timeout=30).status_code == 404  # the scripted "no route"
    for r in replicas:
        r.broken_paths = {"/v1/batches"}
    try:
        body = {"input_file_id": "file-1", "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        r = httpx.post(router.url + "/v1/batches", json=body, timeout=30)
        assert r.status_code == 502 and r.json()["error"]["code"] == "bad_gateway"
        assert _hits(replicas, "POST", "/v1/batches") == [1, 0, 0]  # its home only, once
    finally:
        for r in replicas:
            r.broken_paths = set()


def test_a_files_request_re_sent_goes_to_the_next_batch_home(setup) -> None:
    (home, second, third), router = setup
    home.broken_paths = {"/v1/files"}  # a GET: harmless to send again
    try:
        for _ in range(2):
            assert (
                httpx.get(router.url + "/v1/files", timeout=30).status_code == 404
            )  # the scripted "no route"
        # (home: twice or more: a GET found its kept-alive connection closed is sent again on a new one)
        assert _hits([second, third], "GET", "/v1/files") == [2, 0]
        assert _hits([home], "GET", "/v1/files") >= [2]
    finally:
        home.broken_paths = set()
