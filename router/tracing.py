"""The router's OpenTelemetry spans (``ferry router --otlp-traces-endpoint``; ``server/tracing.py``
exports them).

A routed request has one SERVER span, ``{method} {path}``, from its arrival to its end, a child of
the client's ``traceparent``; its requests to replicas carry the span's own context instead of the
client's, so a replica's ``llm_request`` span is its child. A disaggregated request has a CLIENT
span per leg (``prefill``, ``decode``), children of that span, and each leg's requests carry the
leg's context. Attributes: the replica that answered, the policy that chose it, the retries, the
status and the outcome (``ferry:router_request_latency_seconds``' label). A request the router
refuses itself (413, invalid JSON, 429 at its own limit) has its span too: outcome ``refused`` or
``rejected``, with the status and ``ferry.router.refusal``, the message the client got. Without tracing the
client's ``traceparent``/``tracestate`` reach the replicas unchanged (``router/http.py``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import Any

from router.relay import ProxyCall
from server.tracing import TRACE_HEADERS, Tracing


def _start_ns(started: float) -> int:
    """``time.perf_counter()`` reading ``started`` in wall-clock nanoseconds."""
    return time.time_ns() - int((time.perf_counter() - started) * 1e9)


def _carry(call: ProxyCall, context: dict[str, str]) -> None:
    """The trace headers ``call``'s replicas get: ``context``'s, in place of the client's."""
    call.headers = [(k, v) for k, v in call.headers if k not in TRACE_HEADERS]
    call.headers += [(k.encode(), v.encode("latin-1")) for k, v in context.items()]


def client_context(call: ProxyCall) -> dict[str, str]:
    return {k.decode(): v.decode("latin-1") for k, v in call.headers if k in TRACE_HEADERS}


def start_request(tracing: Tracing, call: ProxyCall, policy: str) -> None:
    """Open ``call``'s SERVER span (``call.trace``) and make its replicas' requests its children."""
    span = tracing.tracer.start_span(
        f"{call.method} {call.path}",
        context=tracing.context_of(client_context(call)),
        kind=tracing.SERVER,
        start_time=_start_ns(call.started),
        attributes={
            "http.request.method": call.method,
            "url.path": call.path,
            "ferry.request.id": call.request_id,
            "ferry.router.policy": policy,
        },
    )
    call.trace = span
    _carry(call, tracing.headers_of(span))


def refused(
    tracing: Tracing,
    method: str,
    path: str,
    headers: Iterable[tuple[bytes, bytes]],
    request_id: str,
    started: float,
    status: int,
    reason: str,
    policy: str,
) -> None:
    """The span of a request the router answered itself before admitting it (a 413 body, invalid
    JSON, an unsupported encoding): outcome ``refused``, its status and why, so a trace shows where
    it died. A child of the client's ``traceparent``, as a routed request's span."""
    client = {k.decode(): v.decode("latin-1") for k, v in headers if k in TRACE_HEADERS}
    span = tracing.tracer.start_span(
        f"{method} {path}",
        context=tracing.context_of(client),
        kind=tracing.SERVER,
        start_time=_start_ns(started),
        attributes={
            "http.request.method": method,
            "url.path": path,
            "ferry.request.id": request_id,
            "ferry.router.policy": policy,
            "ferry.router.outcome": "refused",
            "ferry.router.refusal": reason,
            "http.response.status_code": status,
        },
    )
    if status >= 500:
        tracing.set_error(span, f"status {status}")
    span.end()


def end_request(
    tracing: Tracing, call: ProxyCall, status: int, outcome: str, reason: str | None = None
) -> None:
    """End ``call``'s span (``reason``: why the router itself refused it, a 429 at its limit)."""
    span = call.trace
    if span is None:
        return
    call.trace = None
    if reason is not None:
        span.set_attribute("ferry.router.refusal", reason)
    if call.replica is not None:
        span.set_attribute("ferry.router.replica", call.replica)
    span.set_attribute("ferry.router.retries", call.retries)
    span.set_attribute("ferry.router.outcome", outcome)
    if status:
        span.set_attribute("http.response.status_code", status)
    if outcome == "error" or status >= 500:
        tracing.set_error(span, f"status {status}" if status else outcome)
    span.end()


@contextlib.contextmanager
def leg(tracing: Tracing | None, call: ProxyCall, name: str, policy: str) -> Iterator[Any]:
    """A CLIENT span for one leg of a disaggregated request (``prefill``, ``decode``): its requests
    carry the leg's context, the request's own again after it. Nothing without tracing."""
    parent = call.trace
    if tracing is None or parent is None:
        yield None
        return
    from opentelemetry.trace import set_span_in_context

    before, call.replica = call.replica, None
    span = tracing.tracer.start_span(
        name,
        context=set_span_in_context(parent),
        kind=tracing.CLIENT,
        attributes={"ferry.router.leg": name, "ferry.router.policy": policy},
    )
    own = call.headers
    _carry(call, tracing.headers_of(span))
    try:
        yield span
    except BaseException as e:
        tracing.set_error(span, type(e).__name__)
        raise
    finally:
        if call.replica is not None:
            span.set_attribute("ferry.router.replica", call.replica)
        call.headers = own
        call.replica = call.replica or before
        span.end()
