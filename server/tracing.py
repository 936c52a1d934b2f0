"""OpenTelemetry request tracing (``--otlp-traces-endpoint``), as vLLM exports it; torch-free (the
router uses it too).

``Tracing`` is one process's exporter: a ``TracerProvider`` of its own (never the process-wide one,
which would make FastAPI trace every route) whose ``BatchSpanProcessor`` exports over OTLP from
its own thread, by the protocol ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` names (``grpc``, the default,
or ``http/protobuf``); the exporters read the other ``OTEL_*`` variables (headers, TLS,
compression, timeout), the resource ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``. Ending
a span only appends it to the processor's queue: exporting never blocks a request, and a collector
that is down costs the spans the queue drops, nothing else. Each API server process
(``--api-server-count``) and the router open their own.

A replica's ``llm_request`` span (``request_span``) is one engine request (one choice), ended when
it ends, from the numbers its Prometheus histograms get (``server/generation.py``): parent = the
W3C trace context of the HTTP request's ``traceparent``/``tracestate`` headers, which
``EdgeMiddleware`` keeps for the request's task (``set_request_trace``). This module must never
make exporting a request's cost, nor import the SDK when tracing is off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("ferry.tracing")

TRACE_HEADERS = (b"traceparent", b"tracestate")
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
PROTOCOLS = ("grpc", "http/protobuf")
INSTALL_HINT = "pip install 'ferry-serve[tracing]'"
# How long a shutdown waits for the last spans to leave (a collector that is down would hold it
# for the exporter's whole retry timeout).
SHUTDOWN_TIMEOUT = 5.0

# The trace headers of the HTTP request a task serves (None: it sent none). Set by EdgeMiddleware
# for every request, so a task it starts (a stream, a background response) sees its request's.
_REQUEST_TRACE: ContextVar[dict[str, str] | None] = ContextVar("ferry_request_trace", default=None)


def trace_headers(headers: Iterable[tuple[bytes, bytes]]) -> dict[str, str] | None:
    """The W3C trace context headers among raw ASGI ``headers`` (lower-case names), or None."""
    found = None
    for name, value in headers:
        if name in TRACE_HEADERS:
            if found is None:
                found = {}
            found[name.decode()] = value.decode("latin-1")
    return found


def set_request_trace(headers: dict[str, str] | None) -> None:
    _REQUEST_TRACE.set(headers)


def request_trace() -> dict[str, str] | None:
    return _REQUEST_TRACE.get()


_warned = threading.Event()


def warn_tracing_off() -> None:
    """A request carried trace context while tracing is off: said once per process (as vLLM does)."""
    if not _warned.is_set():
        _warned.set()
        logger.warning(
            "received a request with trace context (traceparent) but tracing is off "
            "(--otlp-traces-endpoint turns it on)"
        )


def tracing_problem(endpoint: str | None) -> str | None:
    """Why ``--otlp-traces-endpoint endpoint`` cannot be had here (packages missing, an unknown
    protocol), or None. Checked at start, before a model loads."""
    if endpoint is None:
        return None
    if not endpoint.strip():
        return "--otlp-traces-endpoint must not be empty"
    protocol = os.environ.get(PROTOCOL_ENV, "grpc")
    if protocol not in PROTOCOLS:
        return f"{PROTOCOL_ENV}={protocol!r} is not one of {', '.join(PROTOCOLS)}"
    module = (
        "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"
        if protocol == "grpc"
        else "opentelemetry.exporter.otlp.proto.http.trace_exporter"
    )
    try:
        __import__("opentelemetry.sdk.trace")
        __import__(module)
    except ImportError as e:
        return f"--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporters ({e}): {INSTALL_HINT}"
    return None


class Tracing:
    """One process's span exporter to ``endpoint`` (module docstring). ``service``: the
    ``service.name`` used when ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` name none."""

    def __init__(self, endpoint: str, service: str, scope: str) -> None:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        problem = tracing_problem(endpoint)
        if problem is not None:
            raise ValueError(problem)
        resource = Resource.create()
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: service}))
        # Shut down by ``shutdown`` (bounded), not at interpreter exit (unbounded).
        self._provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self._exporter = _exporter(endpoint)
        self._provider.add_span_processor(BatchSpanProcessor(self._exporter))
        self.tracer = self._provider.get_tracer(scope)
        self.endpoint = endpoint
        self._propagator = TraceContextTextMapPropagator()
        self.SERVER, self.CLIENT = SpanKind.SERVER, SpanKind.CLIENT
        self._error = lambda text: Status(StatusCode.ERROR, text)
        self._closed = False

    def context_of(self, headers: Mapping[str, str] | None) -> Any:
        """The parent context a request's trace headers name (an empty one when they name none)."""
        return self._propagator.extract(headers or {})

    def headers_of(self, span: Any) -> dict[str, str]:
        """``traceparent`` (and ``tracestate``) naming ``span``: what a request it makes carries."""
        from opentelemetry.trace import set_span_in_context

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=set_span_in_context(span))
        return carrier

    def set_error(self, span: Any, text: str) -> None:
        span.set_status(self._error(text))

    def shutdown(self, timeout: float | None = None) -> None:
        """Export what is queued and stop, waiting ``timeout`` seconds (``SHUTDOWN_TIMEOUT``) at most;
        past that, the exporter's retries are cut short and what is left is dropped."""
        if self._closed:
            return
        self._closed = True
        timeout = SHUTDOWN_TIMEOUT if timeout is None else timeout
        worker = threading.Thread(target=self._provider.shutdown, name="ferry-otel-shutdown", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            logger.warning("tracing: spans not exported within %.1f s of shutdown were dropped", timeout)
            with contextlib.suppress(Exception):
                self._exporter.shutdown(timeout_millis=0)  # ends a retry's backoff wait at once


def _exporter(endpoint: str) -> Any:
    if os.environ.get(PROTOCOL_ENV, "grpc") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(endpoint=endpoint)


def open_tracing(endpoint: str | None, service: str, scope: str) -> Tracing | None:
    return None if endpoint is None else Tracing(endpoint, service, scope)


# -- a replica's llm_request span (vLLM's attribute names) ----------------------------------------


@dataclass(frozen=True)
class Phases:
    """A finished engine request's phase times in seconds (None: it did not go through that phase),
    from the engine's stamps; what ``vllm:request_{queue,prefill,decode,inference}_time_seconds``
    observe."""

    queue: float | None = None
    prefill: float | None = None
    decode: float | None = None
    inference: float | None = None


def phases_of(engine_metrics: Mapping[str, float | None] | None) -> Phases:
    if not engine_metrics:
        return Phases()
    stamps = {k: float(v) for k, v in engine_metrics.items() if v is not None}
    arrived, scheduled = stamps.get("arrival_time"), stamps.get("first_scheduled_time")
    first, done = stamps.get("first_token_time"), stamps.get("finished_time")

    def gap(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else max(0.0, b - a)

    return Phases(gap(arrived, scheduled), gap(scheduled, first), gap(first, done), gap(scheduled, done))


@dataclass(frozen=True)
class FinishedRequest:
    """What a replica's ``llm_request`` span says of one engine request (one choice)."""

    request_id: str  # the HTTP request's (X-Request-Id)
    model: str
    e2e: float  # seconds from the HTTP request's arrival to this request's end
    ttft: float | None  # seconds to its first token (None: none came)
    phases: Phases
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    params: Any  # engine.sampling_params.SamplingParams (None: a pooling request samples nothing)
    n: int
    error: str | None = None  # it ended by an error (a timeout, the engine failing)


def request_span(tracing: Tracing, trace: dict[str, str] | None, r: FinishedRequest) -> None:
    """Emit ``r``'s ``llm_request`` span, SERVER kind, from its arrival (``r.e2e`` ago) to now."""
    end_ns = time.time_ns()
    attributes: dict[str, Any] = {
        "gen_ai.request.id": r.request_id,
        "gen_ai.response.model": r.model,
        "gen_ai.usage.prompt_tokens": r.prompt_tokens,
        "gen_ai.usage.completion_tokens": r.completion_tokens,
        "gen_ai.response.finish_reasons": [r.finish_reason],
        "gen_ai.request.n": r.n,
        "gen_ai.latency.e2e": r.e2e,
    }
    p = r.params
    if p is not None:
        for name, value in (
            ("gen_ai.request.temperature", p.temperature),
            ("gen_ai.request.top_p", p.top_p),
            ("gen_ai.request.max_tokens", p.max_tokens),
        ):
            if value is not None:
                attributes[name] = value
    if r.ttft is not None:
        attributes["gen_ai.latency.time_to_first_token"] = r.ttft
    for name, value in (
        ("gen_ai.latency.time_in_queue", r.phases.queue),
        ("gen_ai.latency.time_in_model_prefill", r.phases.prefill),
        ("gen_ai.latency.time_in_model_decode", r.phases.decode),
        ("gen_ai.latency.time_in_model_inference", r.phases.inference),
    ):
        if value is not None:
            attributes[name] = value
    span = tracing.tracer.start_span(
        "llm_request",
        context=tracing.context_of(trace),
        kind=tracing.SERVER,
        attributes=attributes,
        start_time=end_ns - int(r.e2e * 1e9),
    )
    if r.error is not None:
        tracing.set_error(span, r.error)
    span.end(end_time=end_ns)


# -- flags ------------------------------------------------------------------------------------------

DETAILED_TRACE_MODULES = ("model", "worker", "all")


def add_tracing_args(p: Any) -> None:
    """vLLM's tracing flags (``ferry serve``; the router takes ``--otlp-traces-endpoint`` too)."""
    g = p.add_argument_group("tracing (vLLM's flags)")
    g.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export an OpenTelemetry span per request (llm_request, with vLLM's gen_ai.* attributes, "
        "a child of the request's traceparent) to this OTLP collector: grpc (http://host:4317) or, "
        f"with {PROTOCOL_ENV}=http/protobuf, http://host:4318/v1/traces; the other OTEL_* variables "
        f"apply (OTEL_SERVICE_NAME, OTEL_EXPORTER_OTLP_HEADERS …). Needs {INSTALL_HINT}",
    )
    g.add_argument(
        "--collect-detailed-traces",
        default=None,
        metavar="MODULES",
        help="vLLM's model,worker,all: accepted with --otlp-traces-endpoint; ferry's spans carry no "
        "per-step forward or execute times (as vLLM v1's carry none)",
    )


def tracing_args_problem(args: Any) -> str | None:
    """What is wrong with the tracing flags, or None."""
    endpoint = getattr(args, "otlp_traces_endpoint", None)
    detailed = getattr(args, "collect_detailed_traces", None)
    if detailed is not None:
        modules = [m.strip() for m in detailed.split(",")]
        unknown = [m for m in modules if m not in DETAILED_TRACE_MODULES]
        if unknown:
            return (
                f"--collect-detailed-traces: {', '.join(map(repr, unknown))} is not one of "
                f"{', '.join(DETAILED_TRACE_MODULES)}"
            )
        if endpoint is None:
            return "--collect-detailed-traces needs --otlp-traces-endpoint (as vLLM's)"
    return tracing_problem(endpoint)


def tracing_notes(args: Any) -> list[str]:
    if getattr(args, "collect_detailed_traces", None) is None:
        return []
    return [
        f"--collect-detailed-traces {args.collect_detailed_traces} is accepted for vLLM compatibility: "
        "llm_request spans carry queue, prefill, decode and inference times, but no per-step model "
        "forward or execute times (as vLLM v1's)"
    ]
