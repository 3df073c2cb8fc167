"""Assemble the server: KServe's ModelServer + our model, OpenAI routes, /metrics, middleware.

Everything here is added to ``kserve.model_server.app`` before ``ModelServer.start`` registers
KServe's own routes. Starlette matches routes in order, so our ``/metrics`` comes first and
shadows KServe's (whose OpenMetrics answer would mangle the ``vllm:`` names, see metrics.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import struct
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kserve import ModelServer
from kserve.errors import InvalidInput, ModelNotFound, ModelNotReady
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from kserve_paged.args import DEFAULT_MODEL_DIR, engine_kwargs
from kserve_paged.fault_inject import engine_factory_from_env
from kserve_paged.metrics import render
from kserve_paged.model import PagedLLMModel
from kserve_paged.openai_api import register_openai_routes

logger = logging.getLogger("kserve.paged")

INFERENCE_HEADER = b"inference-header-content-length"
FORM = b"application/x-www-form-urlencoded"


class V2ContentTypeMiddleware:
    """tritonclient.http posts v2 requests without Content-Type, which FastAPI >= 0.132 refuses
    (kserve.md). Supply it when absent: binary requests announce their JSON part with
    ``Inference-Header-Content-Length``, everything else is JSON. Pure ASGI, so streaming
    responses pass through untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            headers = list(scope.get("headers") or [])
            types = [value for name, value in headers if name.lower() == b"content-type"]
            # curl -d sends form encoding, which no v2 body ever is: treat it as missing.
            form = (bool(types) and types[0].startswith(FORM)
                    and scope.get("path", "").endswith("/infer"))
            if not types or form:
                names = {name.lower() for name, _ in headers}
                kind = (b"application/octet-stream" if INFERENCE_HEADER in names
                        else b"application/json")
                headers = [(n, v) for n, v in headers if n.lower() != b"content-type"]
                scope = {**scope, "headers": [*headers, (b"content-type", kind)]}
        await self.app(scope, receive, send)


class DisconnectAbortMiddleware:
    """Cancels a v1/v2 inference handler when its client goes away.

    Starlette does not cancel a running handler on disconnect, and KServe's ``predict`` never
    sees the request, so without this an abandoned v2 call would keep generating (and holding KV
    blocks) up to its ``max_tokens``. The middleware reads the body first, replays it to the
    app, and meanwhile listens for ``http.disconnect``; on one it cancels the handler, which
    aborts the engine requests it awaits (freed within one engine step).
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if scope.get("method") != "POST" or not (path.endswith("/infer")
                                                  or path.endswith(":predict")):
            await self.app(scope, receive, send)
            return
        messages: list[dict[str, Any]] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            messages.append(message)
            if not message.get("more_body", False):
                break

        async def replay() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await disconnected.wait()  # the app asks again only to watch for a disconnect
            return {"type": "http.disconnect"}

        disconnected = asyncio.Event()
        handler = asyncio.ensure_future(self.app(scope, replay, send))

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected.set()
                    handler.cancel()
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            await handler
        except asyncio.CancelledError:
            if not disconnected.is_set():
                raise  # cancelled from outside (shutdown), not by a client leaving
        finally:
            watcher.cancel()


MAX_BINARY_BODY = 256 << 20  # a v2 binary request larger than this is refused (413)


class V2BinaryGuardMiddleware:
    """Checks binary v2 bodies (``Inference-Header-Content-Length``) before KServe parses them.

    KServe 0.21 answers a malformed binary body with a 500 (``struct.error`` for a truncated
    tensor, which also resets the next request on that connection; ``InferenceError`` for BYTES
    that are not UTF-8). Those are the client's errors: answer 400 with a message instead."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or scope.get("method") != "POST"
                or not scope.get("path", "").endswith("/infer")):
            await self.app(scope, receive, send)
            return
        header = next((v for n, v in scope.get("headers") or [] if n.lower() == INFERENCE_HEADER),
                      None)
        if header is None:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BINARY_BODY:
                await _send_json(send, 413, {"error": "the request body is too large"})
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = binary_v2_problem(body, header)
        if problem is not None:
            await _send_json(send, 400, {"error": problem})
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def binary_v2_problem(body: bytes, header_length: bytes) -> str | None:
    """Why a binary v2 body is malformed, or None if KServe can parse it."""
    try:
        json_length = int(header_length)
    except ValueError:
        return f"Inference-Header-Content-Length must be an integer (got {header_length!r})"
    if not 0 < json_length <= len(body):
        return (f"Inference-Header-Content-Length {json_length} does not fit the body "
                f"({len(body)} bytes)")
    try:
        request = json.loads(body[:json_length])
    except (ValueError, RecursionError) as exc:
        return f"the JSON header of the binary request is not valid JSON: {exc}"
    inputs = request.get("inputs") if isinstance(request, dict) else None
    if not isinstance(inputs, list):
        return 'the JSON header needs an "inputs" list'
    offset = json_length
    for tensor in inputs:
        if not isinstance(tensor, dict):
            return "each input must be an object"
        params = tensor.get("parameters")
        size = params.get("binary_data_size") if isinstance(params, dict) else None
        if size is None:
            continue
        name = tensor.get("name")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"input {name!r}: binary_data_size must be a non-negative integer"
        if offset + size > len(body):
            return (f"input {name!r}: binary_data_size {size} runs past the end of the body "
                    f"({len(body) - offset} bytes left)")
        if tensor.get("datatype") == "BYTES":
            data, pos = body[offset:offset + size], 0
            while pos < size:
                if pos + 4 > size:
                    return f"input {name!r}: truncated BYTES element length"
                length = struct.unpack_from("<I", data, pos)[0]
                pos += 4
                if pos + length > size:
                    return f"input {name!r}: a BYTES element runs past binary_data_size"
                try:
                    data[pos:pos + length].decode("utf-8")
                except UnicodeDecodeError as exc:
                    return f"input {name!r} is not valid UTF-8 text: {exc}"
                pos += length
        offset += size
    return None


async def _send_json(send: Any, status: int, content: dict[str, Any]) -> None:
    payload = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


async def metrics_route(request: Request) -> Response:
    body, content_type = render(request.headers.get("accept"))
    return Response(content=body, headers={"content-type": content_type})


async def validation_error_route(request: Request, exc: RequestValidationError) -> Response:
    """A malformed v1/v2 body: 400 with v2's error shape instead of FastAPI's 422 detail list."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = f"invalid request body: {first.get('msg', 'malformed')}"
    return JSONResponse(status_code=400,
                        content={"error": f"{message} at {where}" if where else message})


async def http_error_route(request: Request, exc: StarletteHTTPException) -> Response:
    """FastAPI's own HTTP errors (e.g. a body it cannot decode) in v2's error shape
    ``{"error": message}``, like every other v1/v2 error, instead of ``{"detail": ...}``."""
    return JSONResponse(status_code=exc.status_code, content={"error": str(exc.detail)},
                        headers=getattr(exc, "headers", None))


class _QuietClientErrors(logging.Filter):
    """KServe logs a full traceback for every 4xx/503 it answers; readiness probes during a
    model load would flood the log. Keep the one-line message, drop the traceback."""

    QUIET = (ModelNotReady, ModelNotFound, InvalidInput)

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, self.QUIET):
            record.msg = f"{type(exc).__name__}: {exc}"
            record.args = ()
            record.exc_info = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def resolve_model_dir(model_dir: str, explicit: bool) -> str | None:
    """The folder to load, or None for the default model.

    ``/mnt/models`` is where KServe's storage initializer puts the model; when it is absent and
    no ``--model_dir`` was given, the default model is served (local runs). A folder given
    explicitly must exist. A folder holding exactly one model folder (no config.json at its
    top, as some storage layouts do) resolves to that subfolder."""
    path = Path(model_dir)
    if not path.exists():
        if explicit or model_dir != DEFAULT_MODEL_DIR:
            raise FileNotFoundError(f"--model_dir {model_dir} does not exist")
        return None
    if path.is_dir() and not (path / "config.json").exists() and not list(path.glob("*.gguf")):
        subdirs = [p for p in path.iterdir() if p.is_dir() and (p / "config.json").exists()]
        if len(subdirs) == 1:
            return str(subdirs[0])
        if not any(path.iterdir()):
            raise FileNotFoundError(f"--model_dir {model_dir} is empty")
    return str(path)


def model_dir_given(argv: list[str]) -> bool:
    return any(a == "--model_dir" or a.startswith("--model_dir=") for a in argv)


def build_model(args: argparse.Namespace, argv: list[str]) -> PagedLLMModel:
    model_path = resolve_model_dir(args.model_dir, model_dir_given(argv))
    config = EngineConfig(model=model_path, **engine_kwargs(args))
    factory = engine_factory_from_env(config)  # test-only fault injection, off unless set
    llm = AsyncLLM(config, engine_factory=factory) if factory is not None else None
    return PagedLLMModel(args.model_name, config, llm=llm)


def install(app: FastAPI, model: PagedLLMModel) -> None:
    """Our routes and middleware on KServe's app (before ModelServer.start adds its own)."""
    app.add_middleware(DisconnectAbortMiddleware)
    app.add_middleware(V2BinaryGuardMiddleware)
    app.add_middleware(V2ContentTypeMiddleware)
    app.add_exception_handler(RequestValidationError, validation_error_route)
    app.add_exception_handler(StarletteHTTPException, http_error_route)
    logging.getLogger("kserve").addFilter(_QuietClientErrors())
    app.add_api_route("/metrics", metrics_route, methods=["GET"], include_in_schema=False)
    app.add_api_route("/v2/health/live", _live_route([model]), methods=["GET"],
                      include_in_schema=False)
    register_openai_routes(app, {model.name: model})


def _live_route(models: list[PagedLLMModel]) -> Any:
    """``/v2/health/live``, registered before KServe's (which is always 200): 503 once an
    engine thread died, so a liveness probe on it restarts the pod. Loading and draining are
    alive (a restart would not help them)."""
    async def live() -> Response:
        dead = [m.name for m in models if m.llm.error is not None]
        if dead:
            return JSONResponse(status_code=503,
                                content={"error": f"engine of model(s) {dead} died"})
        return JSONResponse({"status": "alive"})
    return live


class PagedModelServer(ModelServer):
    """KServe's ModelServer with a bind address and a graceful drain on SIGTERM.

    What KServe 0.21 does alone: uvicorn's own signal handler (installed while it serves)
    closes the listening socket at once, waits up to ``grace_period`` for open requests, then
    re-raises the signal to KServe's handler, which stops gRPC and unloads the models. So new
    requests meet a refused connection while readiness never turned false, and Kubernetes may
    still route to the pod. Here the first SIGTERM/SIGINT starts a drain instead: readiness
    turns false and new requests get 503 while the socket stays open; in-flight requests get
    ``shutdown_grace_s`` to finish (then they are aborted); only then does uvicorn's shutdown
    (and KServe's after it) run, and the process exits 0. A second signal skips the drain."""

    def __init__(self, *, http_host: str, shutdown_grace_s: float,
                 models: list[PagedLLMModel], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.http_host = http_host
        self.shutdown_grace_s = shutdown_grace_s
        self._models = models
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        rest = self._rest_server
        if rest is not None:
            rest.config.host = self.http_host
            uvicorn_server = rest._server
            exit_now = uvicorn_server.handle_exit
            # uvicorn installs ``self.handle_exit`` as its signal handler when it starts serving;
            # the instance attribute takes precedence over the method.
            uvicorn_server.handle_exit = lambda sig, frame: self._on_signal(sig, frame, exit_now)
        await super()._serve()

    def _on_signal(self, sig: int, frame: FrameType | None, exit_now: Any) -> None:
        if self._draining or self._loop is None:
            exit_now(sig, frame)
            return
        self._draining = True
        logger.info("received %s: draining (readiness false, new requests 503, up to %.0fs for "
                    "%d request(s) in flight)", signal.Signals(sig).name, self.shutdown_grace_s,
                    sum(m.llm.num_unfinished for m in self._models))
        for model in self._models:
            model.begin_drain()
        self._loop.call_soon_threadsafe(
            lambda: asyncio.ensure_future(self._drain_then_exit(sig, frame, exit_now)))

    async def _drain_then_exit(self, sig: int, frame: FrameType | None, exit_now: Any) -> None:
        deadline = time.monotonic() + self.shutdown_grace_s
        while (any(m.llm.num_unfinished for m in self._models)
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        left = sum(m.llm.num_unfinished for m in self._models)
        if left:
            logger.warning("grace period over: aborting %d request(s) still in flight", left)
            for model in self._models:
                await asyncio.to_thread(model.llm.shutdown, 5.0)
        else:
            logger.info("drained: no request in flight")
        exit_now(sig, frame)


def serve(args: argparse.Namespace, argv: list[str]) -> None:
    """Run until signalled. Loading happens after the HTTP server is up (readiness says when)."""
    from kserve.model_server import app

    if args.workers != 1:
        raise SystemExit("--workers must be 1: each worker would load its own copy of the model "
                         "and KV cache (scale with replicas instead)")
    model = build_model(args, argv)
    install(app, model)
    server = PagedModelServer(
        http_host=args.http_host, shutdown_grace_s=args.shutdown_grace_s, models=[model],
        # uvicorn's own wait, after the drain: responses still flushing their last bytes.
        grace_period=5,
        http_port=args.http_port, grpc_port=args.grpc_port, workers=1,
        max_threads=args.max_threads, max_asyncio_workers=args.max_asyncio_workers,
        enable_grpc=args.enable_grpc, enable_docs_url=args.enable_docs_url,
        enable_latency_logging=args.enable_latency_logging,
        access_log_format=args.access_log_format, event_loop=args.event_loop,
        timeout_keep_alive=args.timeout_keep_alive)
    _share_kserve_logging("engine")  # load progress, KV sizing, engine-thread failures
    logger.info("serving model %r from %s on :%d (gRPC %s)", model.name,
                model.config.model or "the default model", args.http_port,
                f":{args.grpc_port}" if args.enable_grpc else "off")
    model.load()
    server.start([model])


def _share_kserve_logging(name: str) -> None:
    """Route another logger tree through the handlers KServe configured (same format/stream)."""
    source = logging.getLogger("kserve")
    target = logging.getLogger(name)
    if target.handlers or not source.handlers:
        return
    for handler in source.handlers:
        target.addHandler(handler)
    target.setLevel(source.getEffectiveLevel())
    target.propagate = False


def main(argv: list[str] | None = None) -> int:
    from kserve_paged.args import parse_args

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights are local; never reach for the hub
    try:
        serve(args, argv)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
