"""The router's own 502 and 504 answers name no replica: a client is told "a replica timed out",
never the replica's internal address (as production proxies answer); the address, with what went
wrong, is in the router's log. And the router's ``/metrics`` answers in the format the scraper
asks for, as prometheus-client's exposition app does: the text format by default, OpenMetrics
when asked."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from router_harness import Cluster, Proc
from scripted_replica import ScriptedReplica

BODY = {"model": "m", "prompt": "x", "max_tokens": 1}


class _Silent(ScriptedReplica):
    """A scripted replica that, while ``silent``, reads each request and never answers it."""

    silent = False

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if not self.silent:
            return await super()._exchange(reader, writer)
        await reader.readuntil(b"\r\n\r\n")
        await reader.read()  # silent until the router drops the connection
        return False


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[_Silent, Proc]]:
    replica = _Silent()
    tmp = tmp_path_factory.mktemp("error-privacy")
    cluster = Cluster(tmp, tmp)
    # Probes at start only (the replica's failures are met by requests); never a circuit opened.
    router = cluster.router(
        "--replica", replica.url, "--request-timeout", "1", "--health-interval", "60",
        "--circuit-failures", "50", all_routable=True,
    )  # fmt: skip
    yield replica, router
    cluster.close()
    replica.close()


def _no_address(replica: ScriptedReplica, r: httpx.Response) -> str:
    """The error's message, checked to name neither the replica's URL nor its host:port."""
    netloc = urlsplit(replica.url).netloc
    assert replica.url not in r.text and netloc not in r.text and str(replica.port) not in r.text
    return r.json()["error"]["message"]


def _logged(router: Proc, replica: ScriptedReplica, why: str) -> bool:
    return any(replica.url in line and why in line for line in router.log.read_text().splitlines())


def test_a_timeout_is_a_504_naming_no_replica(setup) -> None:
    replica, router = setup
    replica.silent = True
    try:
        r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)
    finally:
        replica.silent = False
    assert r.status_code == 504
    assert _no_address(replica, r) == "a replica timed out"
    assert _logged(router, replica, "timed out")


def test_a_broken_answer_is_a_502_naming_no_replica(setup) -> None:
    replica, router = setup
    replica.broken_paths = {"/v1/completions"}
    try:
        r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)
    finally:
        replica.broken_paths = set()
    assert r.status_code == 502
    message = _no_address(replica, r)  # what broke depends on the connection it was sent on
    assert message.startswith("a replica failed: ") and "the replica" in message, message
    assert _logged(router, replica, f"failed ({message.removeprefix('a replica failed: ')})")


def test_router_metrics_negotiate_their_format(setup) -> None:
    _, router = setup
    r = httpx.get(router.url + "/metrics", timeout=10)
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "# TYPE ferry:router_requests_total counter" in r.text
    r = httpx.get(
        router.url + "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"}, timeout=10
    )
    assert r.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0; charset=utf-8")
    assert r.text.endswith("# EOF\n")
    names = {family.name for family in text_string_to_metric_families(r.text)}  # a valid exposition
    assert "ferry:router_requests" in names


def test_router_metrics_are_gzipped_when_the_scrape_takes_gzip(setup) -> None:
    _, router = setup
    for accept_encoding, gzipped in (("gzip", True), ("identity", False), ("gzip;q=0, identity", False)):
        with httpx.stream(
            "GET", router.url + "/metrics", headers={"accept-encoding": accept_encoding}, timeout=10
        ) as r:
            raw = b"".join(r.iter_raw())
        assert r.headers.get("content-encoding") == ("gzip" if gzipped else None), accept_encoding
        assert "accept-encoding" in r.headers["vary"].lower() and int(r.headers["content-length"]) == len(raw)
        text = (gzip.decompress(raw) if gzipped else raw).decode()
        assert "# TYPE ferry:router_requests_total counter" in text


def test_an_unreachable_replica_is_a_502_naming_no_replica(setup) -> None:
    """Last: the replica stops listening for good."""
    replica, router = setup
    replica.stop_listening()
    r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)
    assert r.status_code == 502
    assert _no_address(replica, r) == "a replica could not be reached"
    assert _logged(router, replica, "unreachable (connect to ")
