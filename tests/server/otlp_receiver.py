"""Real OTLP trace receivers in the test process: ``Receiver`` runs ``HttpReceiver`` (OTLP/HTTP
protobuf, POST /v1/traces) and ``GrpcReceiver`` (the collector's TraceService over gRPC); both
decode each ``ExportTraceServiceRequest`` with opentelemetry-proto's classes into one list of
``Span``s."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class Span:
    """One exported span, as a test reads it."""

    service: str
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind: 2 SERVER, 3 CLIENT
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    trace_state: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    instance: str = ""  # the resource's service.instance.id: one per exporting process


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


class _Spans:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.exports = 0
        self._cond = threading.Condition()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        got = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            service, instance = resource.get("service.name", ""), resource.get("service.instance.id", "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Span(
                            service,
                            s.name,
                            s.kind,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            s.trace_state,
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                            {a.key: _value(a.value) for a in s.attributes},
                            s.status.code,
                            instance,
                        )
                    )
        with self._cond:
            self.spans += got
            self.exports += 1
            self._cond.notify_all()

    def wait(self, match, count: int = 1, timeout: float = 15.0) -> list[Span]:
        """The spans ``match(span)`` accepts, once there are ``count`` of them (AssertionError after
        ``timeout``); then a short while more, so that a span too many would be seen."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(found := [s for s in self.spans if match(s)]) < count:
                left = deadline - time.monotonic()
                assert left > 0, f"{len(found)} of {count} spans arrived: {self.spans}"
                self._cond.wait(left)
        time.sleep(0.3)
        with self._cond:
            return [s for s in self.spans if match(s)]


class HttpReceiver:
    """OTLP/HTTP (protobuf) on a free loopback port: ``endpoint`` is its /v1/traces URL."""

    def __init__(self, receiver: _Spans) -> None:

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                status = 404
                if self.path == "/v1/traces":
                    request = trace_service_pb2.ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    receiver.add(request)
                    status = 200
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class GrpcReceiver:
    """The OTLP collector's gRPC TraceService on a free loopback port: ``endpoint`` is http://…:port."""

    def __init__(self, receiver: _Spans) -> None:
        import grpc

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the service's name
                receiver.add(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self._server.stop(0)


class Receiver(_Spans):
    """Both receivers, into one list of spans: ``http.endpoint``, ``grpc.endpoint``."""

    def __init__(self) -> None:
        super().__init__()
        self.http = HttpReceiver(self)
        self.grpc = GrpcReceiver(self)

    def close(self) -> None:
        self.http.close()
        self.grpc.close()
