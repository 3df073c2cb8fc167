"""Every route of ours on KServe's app, registered in one place (KServe's own v1/v2 routes are
ModelServer's): Prometheus' /metrics, the v2 liveness probe, the OpenAI routes under /openai/v1
and vLLM's /v1, Anthropic's Messages, vLLM's extra routes, and LoRA adapters' routes. The
packages that hold the handlers (openai/, anthropic/) register nothing themselves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from kserve_paged.anthropic.messages import register_messages_routes
from kserve_paged.lora_routes import register_lora_routes
from kserve_paged.metric_families import render
from kserve_paged.model import PagedLLMModel
from kserve_paged.openai.handlers import VLLM_PREFIX, register_openai_routes
from kserve_paged.vllm_routes import register_vllm_routes


def register_routes(app: FastAPI, model: PagedLLMModel, *, names: list[str],
                    lora_runtime_updates: bool, lora_roots: Sequence[str]) -> None:
    """The model under each of `names`; adapters loaded at run time only from `lora_roots`."""
    app.add_api_route("/metrics", metrics_route, methods=["GET"], include_in_schema=False)
    app.add_api_route("/v2/health/live", _live_route([model]), methods=["GET"],
                      include_in_schema=False)
    register_lora_routes(app, model, runtime_updates=lora_runtime_updates, roots=lora_roots)
    routes = register_openai_routes(app, {name: model for name in names})
    register_messages_routes(app, routes.model_named, VLLM_PREFIX)
    register_vllm_routes(app, model, routes)


async def metrics_route(request: Request) -> Response:
    body, content_type = render(request.headers.get("accept"))
    return Response(content=body, headers={"content-type": content_type})


def _live_route(models: list[PagedLLMModel]) -> Any:
    """``/v2/health/live``, registered before KServe's (which is always 200): 503 once an
    engine thread died, so a liveness probe on it restarts the pod. Loading and draining are
    alive (a restart would not help them)."""
    async def live() -> Response:
        dead = [m.name for m in models if m.llm.error is not None]
        if dead:
            return JSONResponse(status_code=503,
                                content={"error": f"engine of model(s) {dead} died"})
        return JSONResponse({"live": True})  # the v2 protocol's ServerLiveResponse
    return live
