"""Assemble the server: KServe's ModelServer + our model, OpenAI routes, /metrics, middleware
(middleware.py), graceful shutdown (shutdown.py).

Everything here is added to ``kserve.model_server.app`` before ``ModelServer.start`` registers
KServe's own routes. Starlette matches routes in order, so our ``/metrics`` comes first and
shadows KServe's (whose OpenMetrics answer would mangle the ``vllm:`` names, see metrics.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kserve.errors import InvalidInput, ModelNotFound, ModelNotReady
from starlette.exceptions import HTTPException as StarletteHTTPException

from kserve_paged.admission import DeadlineMiddleware, RequestRefused, refused_route
from kserve_paged.args import DEFAULT_MODEL_DIR, engine_kwargs
from kserve_paged.auth import APIKeyMiddleware
from kserve_paged.fault_inject import engine_factory_from_env
from kserve_paged.gateway import (
    RestOptions,
    api_key,
    check_gateway_args,
    make_tracer,
    model_control_key,
    served_names,
)
from kserve_paged.lora_paths import DEFAULT_LORA_ROOTS
from kserve_paged.middleware import (
    DisconnectAbortMiddleware,
    RequestSizeLimitMiddleware,
    V2BinaryGuardMiddleware,
    V2ContentTypeMiddleware,
    V2VersionGuardMiddleware,
)
from kserve_paged.model import PagedLLMModel
from kserve_paged.model_control import (
    ModelControl,
    ModelControlMiddleware,
    ModelControlOff,
    model_control_off_route,
)
from kserve_paged.multi_node_flags import data_parallel_size
from kserve_paged.openapi_doc import document_errors
from kserve_paged.request_caps import caps_from_args, set_request_caps
from kserve_paged.routes import register_routes
from kserve_paged.shutdown import PagedModelServer
from kserve_paged.tracing import RequestTracer, TraceContextMiddleware
from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.frontend.async_llm import AsyncLLM
from kserve_paged_engine.limits import DEFAULT_MAX_REQUEST_BYTES

logger = logging.getLogger("kserve.paged")


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
    if args.model_id is not None:  # parse_args refused it beside --model_dir
        model_path: str | None = args.model_id  # the engine provisions it (kserve_paged_engine.frontend.default_model)
    else:
        model_path = resolve_model_dir(args.model_dir, model_dir_given(argv))
    config = EngineConfig(model=model_path, **engine_kwargs(args))
    factory = engine_factory_from_env(config)  # test-only fault injection, off unless set
    llm = AsyncLLM(config, engine_factory=factory) if factory is not None else None
    if (replicas := data_parallel_size(args)) > 1:  # N engines, one endpoint (dp_router.py)
        from kserve_paged_engine.frontend.dp_router import DataParallelLLM

        llm = DataParallelLLM.from_config(config, replicas, engine_factory=factory)
    set_request_caps(caps_from_args(args))  # the flags every route checks requests against
    return PagedLLMModel(args.model_name, config, llm=llm, max_prompt_chars=args.max_prompt_chars,
                         tool_call_parser=args.tool_call_parser,
                         lora_modules=getattr(args, "lora_modules", None),
                         reasoning_parser=getattr(args, "reasoning_parser", None),
                         default_chat_template_kwargs=getattr(
                             args, "default_chat_template_kwargs", None),
                         generation_config=getattr(args, "generation_config", "auto"),
                         max_waiting_requests=args.max_waiting_requests)


def install(app: FastAPI, model: PagedLLMModel, *,
            max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
            lora_runtime_updates: bool = False, names: list[str] | None = None,
            api_key: str | None = None, tracer: RequestTracer | None = None,
            lora_roots: Sequence[str] = DEFAULT_LORA_ROOTS,
            request_timeout_s: float | None = None,
            model_control_key: str | None = None) -> None:
    """Our routes and middleware on KServe's app (before ModelServer.start adds its own):
    the model served under `names` (default: its own name), every route behind `api_key`
    when one is given, a span per request to `tracer` when one is given (gateway.py),
    adapters loaded at run time only from `lora_roots`, a default deadline per request, and
    KServe's model repository routes off unless `model_control_key` (model_control.py)."""
    model.served_names = tuple(names or [model.name])  # names no adapter may take
    app.add_middleware(DisconnectAbortMiddleware)
    app.add_middleware(DeadlineMiddleware, default_timeout_s=request_timeout_s)
    app.add_middleware(V2BinaryGuardMiddleware)
    app.add_middleware(V2ContentTypeMiddleware)
    app.add_middleware(V2VersionGuardMiddleware)
    app.add_middleware(RequestSizeLimitMiddleware, max_bytes=max_request_bytes)
    if tracer is not None:
        model.tracer = tracer
        model.llm.add_step_callback(tracer)
        app.add_middleware(TraceContextMiddleware)
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)  # deny by default
    # Outermost: the repository routes answer to their own key only, whatever else is set.
    app.add_middleware(ModelControlMiddleware, key=model_control_key)
    app.add_exception_handler(ModelControlOff, model_control_off_route)
    app.add_exception_handler(RequestValidationError, validation_error_route)
    app.add_exception_handler(StarletteHTTPException, http_error_route)
    app.add_exception_handler(RequestRefused, refused_route)
    logging.getLogger("kserve").addFilter(_QuietClientErrors())
    register_routes(app, model, names=names or [model.name],
                    lora_runtime_updates=lora_runtime_updates, lora_roots=lora_roots)
    document_errors(app)


def serve(args: argparse.Namespace, argv: list[str]) -> None:
    """Run until signalled. Loading happens after the HTTP server is up (readiness says when)."""
    from kserve.model_server import app

    if args.workers != 1:
        raise SystemExit("--workers must be 1: each worker would load its own copy of the model "
                         "and KV cache (scale with replicas instead)")
    if (problem := check_gateway_args(args)) is not None:
        raise SystemExit(f"error: {problem}")
    model = build_model(args, argv)
    names = served_names(args)
    tracer = make_tracer(args)
    control_key = model_control_key(args)
    install(app, model, max_request_bytes=args.max_request_bytes,
            lora_runtime_updates=args.enable_lora_runtime_updates, names=names,
            api_key=api_key(args), tracer=tracer, lora_roots=args.lora_roots,
            request_timeout_s=args.request_timeout_s, model_control_key=control_key)
    server = PagedModelServer(
        http_host=args.http_host, shutdown_grace_s=args.shutdown_grace_s, models=[model],
        rest_options=RestOptions.from_args(args),
        ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
        # uvicorn's own wait, after the drain: responses still flushing their last bytes.
        grace_period=5,
        http_port=args.http_port, grpc_port=args.grpc_port, workers=1,
        max_threads=args.max_threads, max_asyncio_workers=args.max_asyncio_workers,
        enable_grpc=args.enable_grpc, enable_docs_url=args.enable_docs_url,
        enable_latency_logging=args.enable_latency_logging,
        access_log_format=args.access_log_format, event_loop=args.event_loop,
        timeout_keep_alive=args.timeout_keep_alive)
    model.repository = server.registered_models  # adapters become v2 models there
    # HTTP and gRPC reach the repository through this extension: off without the key.
    server.model_repository_extension = ModelControl(
        server.registered_models, model, enabled=control_key is not None)
    for alias in names[1:]:  # v1/v2 under every served name (KServe's own model aliases)
        server.register_model(model, name=alias)
    _share_kserve_logging("kserve_paged_engine")  # load progress, KV sizing, engine-thread failures
    logger.info("serving model %r from %s on :%d (gRPC %s)", model.name,
                model.config.model or "the default model", args.http_port,
                f":{args.grpc_port}" if args.enable_grpc else "off")
    model.load()
    try:
        server.start([model])
    finally:
        if tracer is not None:
            tracer.shutdown()  # the spans still queued


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
    from kserve_paged.multi_node_flags import run_if_worker_node

    if (code := run_if_worker_node(args)) is not None:  # a worker pod: its ranks, no HTTP
        return code
    try:
        serve(args, argv)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
