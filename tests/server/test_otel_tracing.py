"""OpenTelemetry tracing (``--otlp-traces-endpoint``): a real `ferry serve` (two API server
processes) exports over gRPC to a real OTLP receiver in this process (``otlp_receiver.py``), the
official openai SDK sends requests with W3C ``traceparent``/``tracestate`` headers, and each
request's ``llm_request`` span is checked against what the answer reports; a router (in this
process) in front of it exports over OTLP/HTTP its own span, the replica's parent."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk.trace", reason="tracing needs ferry-serve[tracing]")

from server.tracing import FinishedRequest, Phases, Tracing, request_span  # noqa: E402
from tests.server.otlp_receiver import Receiver  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
FAST = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # spans leave 50 ms after they end (default 5 s)


def traceparent(span_id: str, trace_id: str = TRACE_ID) -> str:
    return f"00-{trace_id}-{span_id}-01"


@pytest.fixture(scope="module")
def receiver():
    both = Receiver()
    yield both
    both.close()


@pytest.fixture(scope="module")
def traced(tiny_llama: Path, serve_logs: Path, server_process, receiver):
    """A replica of two API server processes (each with its own exporter) exporting over gRPC (the
    default protocol), named by OTEL_SERVICE_NAME."""
    args = ["--otlp-traces-endpoint", receiver.grpc.endpoint, "--api-server-count", "2"]
    srv = server_process(tiny_llama, args, serve_logs).start(env={**FAST, "OTEL_SERVICE_NAME": "replica-a"})
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def traced_client(traced):
    import openai

    return openai.OpenAI(base_url=traced.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _of(request_id: str):
    return lambda s: s.name == "llm_request" and s.attributes.get("gen_ai.request.id") == request_id


def _check_latencies(span, e2e_upper: float) -> None:
    a = span.attributes
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"] <= e2e_upper
    for phase in ("time_in_queue", "time_in_model_prefill", "time_in_model_decode"):
        assert 0 <= a[f"gen_ai.latency.{phase}"] <= a["gen_ai.latency.e2e"], phase
    inference = a["gen_ai.latency.time_in_model_inference"]
    prefill, decode = a["gen_ai.latency.time_in_model_prefill"], a["gen_ai.latency.time_in_model_decode"]
    assert abs(inference - (prefill + decode)) < 1e-6
    # The span runs from the request's arrival to its end: its e2e, on the wall clock.
    assert abs((span.end_ns - span.start_ns) / 1e9 - a["gen_ai.latency.e2e"]) < 1e-3


def test_chat_span_is_the_child_of_traceparent_and_says_the_usage(traced, traced_client, receiver) -> None:
    started = time.monotonic()
    raw = traced_client.chat.completions.with_raw_response.create(
        model=traced.model_name,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=5,
        temperature=0.5,
        top_p=0.9,
        extra_body={"ignore_eos": True},
        extra_headers={
            "traceparent": traceparent("00f067aa0ba902b7"),
            "tracestate": "vendor=1",
            "X-Request-Id": "otel-chat-1",
        },
    )
    elapsed = time.monotonic() - started
    answer = raw.parse()
    assert raw.headers["x-request-id"] == "otel-chat-1"
    [span] = receiver.wait(_of("otel-chat-1"))
    assert (span.service, span.name, span.kind) == ("replica-a", "llm_request", 2)  # SERVER
    assert (span.trace_id, span.parent_span_id, span.trace_state) == (
        TRACE_ID,
        "00f067aa0ba902b7",
        "vendor=1",
    )
    a = span.attributes
    assert a["gen_ai.usage.prompt_tokens"] == answer.usage.prompt_tokens
    assert a["gen_ai.usage.completion_tokens"] == answer.usage.completion_tokens == 5
    assert a["gen_ai.response.model"] == traced.model_name == answer.model
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.n"]) == (5, 1)
    assert a["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert span.status_code == 0
    _check_latencies(span, elapsed)


def test_each_choice_of_a_stream_is_a_span(traced, traced_client, receiver) -> None:
    chunks = list(
        traced_client.completions.create(
            model=traced.model_name,
            prompt="one two three",
            max_tokens=4,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            extra_headers={"traceparent": traceparent("00000000000000aa"), "X-Request-Id": "otel-n2"},
        )
    )
    usage = chunks[-1].usage
    spans = receiver.wait(_of("otel-n2"), count=2)
    assert len(spans) == 2
    assert {(s.trace_id, s.parent_span_id) for s in spans} == {(TRACE_ID, "00000000000000aa")}
    assert len({s.span_id for s in spans}) == 2
    assert [s.attributes["gen_ai.usage.prompt_tokens"] for s in spans] == [usage.prompt_tokens] * 2
    assert sum(s.attributes["gen_ai.usage.completion_tokens"] for s in spans) == usage.completion_tokens == 8
    assert [s.attributes["gen_ai.request.n"] for s in spans] == [2, 2]


def test_each_answer_of_a_beam_search_is_a_span(traced, traced_client, receiver) -> None:
    """A beam search request: one llm_request span per answer (as its metrics count them), each a
    child of the request's traceparent, with the answer's own token count."""
    answer = traced_client.completions.create(
        model=traced.model_name,
        prompt="one two three",
        max_tokens=3,
        n=2,
        extra_body={"use_beam_search": True, "ignore_eos": True},
        extra_headers={"traceparent": traceparent("00000000000000b2"), "X-Request-Id": "otel-beam"},
    )
    assert [c.finish_reason for c in answer.choices] == ["length", "length"]
    spans = receiver.wait(_of("otel-beam"), count=2)
    assert len(spans) == 2 and len({s.span_id for s in spans}) == 2
    assert {(s.service, s.trace_id, s.parent_span_id, s.status_code) for s in spans} == {
        ("replica-a", TRACE_ID, "00000000000000b2", 0)
    }
    assert [
        (
            s.attributes["gen_ai.usage.prompt_tokens"],
            s.attributes["gen_ai.usage.completion_tokens"],
            s.attributes["gen_ai.response.finish_reasons"],
            s.attributes["gen_ai.request.n"],
        )
        for s in spans
    ] == [(answer.usage.prompt_tokens, 3, ["length"], 2)] * 2
    assert answer.usage.completion_tokens == 6
    for s in spans:
        a = s.attributes
        assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
        # Its steps are engine requests of their own: no one request's queue or model phases.
        assert "gen_ai.latency.time_in_queue" not in a


def test_a_request_without_trace_headers_starts_a_trace(traced_client, traced, receiver) -> None:
    traced_client.completions.create(
        model=traced.model_name, prompt="hi", max_tokens=2, extra_headers={"X-Request-Id": "otel-root"}
    )
    [span] = receiver.wait(_of("otel-root"))
    assert span.parent_span_id == "" and span.trace_id not in ("", "0" * 32, TRACE_ID)


def test_a_stream_the_client_leaves_ends_its_span_as_an_abort(traced, traced_client, receiver) -> None:
    stream = traced_client.completions.create(
        model=traced.model_name,
        prompt="count with me",
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"traceparent": traceparent("00000000000000bb"), "X-Request-Id": "otel-gone"},
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    [span] = receiver.wait(_of("otel-gone"))
    a = span.attributes
    assert a["gen_ai.response.finish_reasons"] == ["abort"]
    assert 3 <= a["gen_ai.usage.completion_tokens"] < 400
    assert span.parent_span_id == "00000000000000bb"
    # The replica serves on.
    assert traced_client.completions.create(model=traced.model_name, prompt="a", max_tokens=1).usage


def test_every_api_server_process_exports(traced, receiver) -> None:
    """Requests over both API server processes: each one's span arrives, from its own exporter."""
    ids = [f"otel-procs-{i}" for i in range(6)]
    # Four connections held open at once: the supervisor hands each to the API server holding the
    # fewest (server/conn_balance.py), so both get some, whatever the SDK client keeps open.
    clients = [httpx.Client(base_url=traced.url, timeout=60) for _ in range(4)]
    try:
        for i, rid in enumerate(ids):
            r = clients[i % 4].post(
                "/v1/completions",
                json={"model": traced.model_name, "prompt": "x", "max_tokens": 2},
                headers={"traceparent": traceparent(f"{i + 1:016x}"), "X-Request-Id": rid},
            )
            assert r.status_code == 200, r.text
    finally:
        for c in clients:
            c.close()
    spans = [receiver.wait(_of(rid))[0] for rid in ids]
    assert [(s.service, s.parent_span_id, s.attributes["gen_ai.usage.completion_tokens"]) for s in spans] == [
        ("replica-a", f"{i + 1:016x}", 2) for i in range(6)
    ]
    assert len({s.instance for s in spans}) == 2


def test_a_dead_collector_costs_nothing_but_the_spans(monkeypatch, free_tcp_port) -> None:
    """Spans to a port nobody listens on: ending one only queues it (the export and its retries
    run on the processor's thread), and shutting down waits a bounded time."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    tracing = Tracing(f"http://127.0.0.1:{free_tcp_port()}", "ferry-serve", "test")
    from engine.sampling_params import SamplingParams

    finished = FinishedRequest(
        "r", "m", 0.5, 0.1, Phases(0.1, 0.1, 0.3, 0.4), 3, 4, "stop", SamplingParams(), 1
    )
    time.sleep(0.2)  # its first export is failing by now
    started = time.perf_counter()
    for _ in range(500):
        request_span(tracing, {"traceparent": traceparent("00000000000000cc")}, finished)
    assert time.perf_counter() - started < 0.5  # ~0.1 ms a span
    started = time.perf_counter()
    tracing.shutdown(timeout=1.0)
    assert time.perf_counter() - started < 1.5


def test_trace_headers_with_tracing_off_warn_once(server) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for _ in range(2):
            r = http.post(
                "/v1/completions",
                json={"model": server.model_name, "prompt": "x", "max_tokens": 1},
                headers={"traceparent": traceparent("00000000000000dd")},
            )
            assert r.status_code == 200
    assert server.log_path.read_text().count("received a request with trace context") == 1


# ---- the router ----------------------------------------------------------------------------------


async def _routed(
    serve_app, replica, endpoint: str | None, headers: dict[str, str], timings: list[float] | None = None
) -> httpx.Response:
    """One chat request through a router in this process (``endpoint``: its --otlp-traces-endpoint);
    ``timings`` gets the request's seconds and the router's shutdown's."""
    from router.app import RouterApp
    from router.config import RouterConfig

    app = RouterApp(
        RouterConfig(replicas=(replica.url,), policy="round_robin", otlp_traces_endpoint=endpoint)
    )
    await app.startup()
    timings = [] if timings is None else timings
    try:
        async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            started = time.perf_counter()
            r = await http.post(
                "/v1/chat/completions",
                json={
                    "model": replica.model_name,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                },
                headers=headers,
            )
            timings.append(time.perf_counter() - started)
            return r
    finally:
        started = time.perf_counter()
        await app.shutdown()
        timings.append(time.perf_counter() - started)


async def test_the_replica_span_is_the_child_of_the_router_span(
    traced, receiver, serve_app, monkeypatch
) -> None:
    for name, value in {**FAST, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    assert os.environ.get("OTEL_RESOURCE_ATTRIBUTES") is None
    headers = {
        "traceparent": traceparent("00000000000000ee"),
        "tracestate": "k=v",
        "X-Request-Id": "otel-routed",
    }
    r = await _routed(serve_app, traced, receiver.http.endpoint, headers)
    assert r.status_code == 200, r.text
    [replica_span] = receiver.wait(_of("otel-routed"))
    [router_span] = receiver.wait(lambda s: s.attributes.get("ferry.request.id") == "otel-routed")
    assert (router_span.service, router_span.name, router_span.kind) == (
        "ferry-router",
        "POST /v1/chat/completions",
        2,
    )
    assert (router_span.trace_id, router_span.parent_span_id) == (TRACE_ID, "00000000000000ee")
    assert router_span.attributes["ferry.router.replica"] == traced.url
    assert router_span.attributes["ferry.router.policy"] == "round_robin"
    assert router_span.attributes["ferry.router.retries"] == 0
    assert router_span.attributes["http.response.status_code"] == 200
    assert router_span.attributes["ferry.router.outcome"] == "ok"
    assert (replica_span.trace_id, replica_span.parent_span_id) == (TRACE_ID, router_span.span_id)
    assert replica_span.trace_state == router_span.trace_state == "k=v"
    assert router_span.start_ns <= replica_span.start_ns <= replica_span.end_ns <= router_span.end_ns
    assert replica_span.attributes["gen_ai.usage.completion_tokens"] == r.json()["usage"]["completion_tokens"]


async def test_requests_the_router_refuses_have_a_span_that_says_why(
    traced, receiver, serve_app, monkeypatch
) -> None:
    """A body over --max-request-bytes (413), a body that is not JSON (400), a missing API key (401)
    and a request over the router's concurrency and queue limits (429): each has its router span,
    a child of the client's traceparent, with the status and the message the client got; none
    reaches the replica."""
    from router.app import RouterApp
    from router.config import RouterConfig

    for name, value in {**FAST, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}.items():
        monkeypatch.setenv(name, value)
    config = RouterConfig(
        replicas=(traced.url,),
        policy="round_robin",
        otlp_traces_endpoint=receiver.http.endpoint,
        max_request_bytes=1000,
        api_key="router-key",
        max_concurrency=1,
        max_queue=0,
    )
    app = RouterApp(config)
    await app.startup()
    key = {"Authorization": "Bearer router-key"}
    try:
        async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:

            async def post(rid: str, span_id: str, extra: dict, **kw) -> httpx.Response:
                headers = {"traceparent": traceparent(span_id), "X-Request-Id": rid, **extra}
                return await http.post("/v1/completions", headers=headers, **kw)

            big = await post("otel-413", "0000000000000413", key, content=b"{" + b" " * 2000 + b"}")
            bad = await post("otel-400", "0000000000000400", key, content=b"{not json")
            keyless = await post("otel-401", "0000000000000401", {}, json={"prompt": "x"})
            # The one slot held (app.admission: what a request in flight holds), the next is refused.
            assert await app.admission.try_acquire()
            try:
                busy = await post("otel-429", "0000000000000429", key, json={"prompt": "x"})
            finally:
                app.admission.release()
    finally:
        await app.shutdown()
    answers = {"otel-413": big, "otel-400": bad, "otel-401": keyless, "otel-429": busy}
    assert {rid: r.status_code for rid, r in answers.items()} == {
        "otel-413": 413,
        "otel-400": 400,
        "otel-401": 401,
        "otel-429": 429,
    }
    for rid, r in answers.items():
        status = r.status_code
        [span] = receiver.wait(lambda s, rid=rid: s.attributes.get("ferry.request.id") == rid)
        assert (span.service, span.name, span.kind, span.status_code) == (
            "ferry-router",
            "POST /v1/completions",
            2,
            0,  # a client error: not the router's
        )
        assert (span.trace_id, span.parent_span_id) == (TRACE_ID, f"{status:016d}")
        a = span.attributes
        assert a["http.response.status_code"] == status
        assert a["ferry.router.refusal"] == r.json()["error"]["message"]
        assert a["ferry.router.outcome"] == ("rejected" if status == 429 else "refused")
        assert "ferry.router.replica" not in a
        assert span.start_ns <= span.end_ns
    assert not [s for s in receiver.spans if s.attributes.get("gen_ai.request.id") in answers]


async def test_a_router_without_tracing_passes_trace_headers_on(traced, receiver, serve_app) -> None:
    headers = {
        "traceparent": traceparent("00000000000000ff"),
        "tracestate": "k=w",
        "X-Request-Id": "otel-plain",
    }
    r = await _routed(serve_app, traced, None, headers)
    assert r.status_code == 200, r.text
    [span] = receiver.wait(_of("otel-plain"))
    assert (span.trace_id, span.parent_span_id, span.trace_state) == (TRACE_ID, "00000000000000ff", "k=w")
    assert not [s for s in receiver.spans if s.attributes.get("ferry.request.id") == "otel-plain"]


async def test_a_router_whose_collector_is_down_routes_as_ever(
    traced, serve_app, free_tcp_port, monkeypatch
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    monkeypatch.setattr("server.tracing.SHUTDOWN_TIMEOUT", 0.5)
    timings: list[float] = []
    r = await _routed(
        serve_app, traced, f"http://127.0.0.1:{free_tcp_port()}", {"X-Request-Id": "otel-dead"}, timings
    )
    assert r.status_code == 200, r.text
    assert timings[0] < 1.0  # the request; then a shutdown bounded at 0.5 s
    assert timings[1] < 1.5


def test_each_leg_of_a_disaggregated_request_is_a_child_span(receiver, monkeypatch) -> None:
    """router/tracing.py's spans as router/pd.py opens them: the request's, then a CLIENT span per
    leg whose context the leg's requests carry, the request's own again after it."""
    from router.policies.base import RouteRequest
    from router.relay import ProxyCall
    from router.tracing import end_request, leg, start_request

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    tracing = Tracing(receiver.http.endpoint, "ferry-router", "test")
    client = [(b"traceparent", traceparent("0000000000000abc").encode()), (b"x-request-id", b"otel-pd")]
    call = ProxyCall("POST", "/v1/completions", b"", client, b"{}", "otel-pd", RouteRequest("otel-pd"))
    start_request(tracing, call, "cache_aware")
    own = dict(call.headers)[b"traceparent"]
    carried = {}
    for name, url in (("prefill", "http://p:1"), ("decode", "http://d:1")):
        with leg(tracing, call, name, "least_load"):
            carried[name] = dict(call.headers)[b"traceparent"]
            call.replica = url
        assert dict(call.headers)[b"traceparent"] == own and call.replica == url
    end_request(tracing, call, 200, "ok")
    tracing.shutdown()
    [request] = receiver.wait(lambda s: s.attributes.get("ferry.request.id") == "otel-pd")
    assert (request.trace_id, request.parent_span_id) == (TRACE_ID, "0000000000000abc")
    assert own.decode() == traceparent(request.span_id)
    legs = receiver.wait(lambda s: s.trace_id == TRACE_ID and s.name in ("prefill", "decode"), count=2)
    assert sorted((s.name, s.kind, s.parent_span_id, s.attributes["ferry.router.replica"]) for s in legs) == [
        ("decode", 3, request.span_id, "http://d:1"),
        ("prefill", 3, request.span_id, "http://p:1"),
    ]
    for s in legs:
        assert carried[s.name].decode() == traceparent(s.span_id)
    assert request.attributes["ferry.router.replica"] == "http://d:1"
