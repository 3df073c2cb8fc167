"""In-test OTLP trace receivers (gRPC and HTTP): what a collector would see, kept in a list."""

from __future__ import annotations

import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def spans_of(request: trace_service_pb2.ExportTraceServiceRequest) -> list[dict[str, Any]]:
    """Each span as {name, trace_id, parent_span_id, start, end, attributes, status}."""
    found = []
    for resource_spans in request.resource_spans:
        for scope in resource_spans.scope_spans:
            for span in scope.spans:
                attrs = {}
                for kv in span.attributes:
                    value = kv.value
                    attrs[kv.key] = getattr(value, value.WhichOneof("value"))
                found.append({"name": span.name, "trace_id": span.trace_id.hex(),
                              "parent_span_id": span.parent_span_id.hex(),
                              "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                              "attributes": attrs, "status": span.status.code})
    return found


class GrpcReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC TraceService on 127.0.0.1 (endpoint `http://127.0.0.1:PORT`)."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):  # noqa: N802 (the gRPC method's name)
        self.spans.extend(spans_of(request))
        return trace_service_pb2.ExportTraceServiceResponse()

    def stop(self) -> None:
        self._server.stop(grace=None)


class HttpReceiver:
    """An OTLP/HTTP (protobuf) receiver on 127.0.0.1 (endpoint `http://127.0.0.1:PORT`)."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["content-length"]))
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.paths.append(self.path)
                receiver.spans.extend(spans_of(request))
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(trace_service_pb2.ExportTraceServiceResponse()
                                 .SerializeToString())

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
