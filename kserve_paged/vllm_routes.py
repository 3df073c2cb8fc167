"""vLLM's routes at the root, where clients and KServe's LLMInferenceService presets call them.

- ``GET /health``, ``GET|POST /ping``: 200 while the engine serves (loaded and alive, and while
  draining: a liveness probe must not restart a pod that is finishing its requests), 503
  while it loads and once its thread died, with the reason.
- ``GET /version``: ``{"version": ...}``, this package's version (and the vLLM command line
  it follows).
- ``GET /v1/models``: vLLM's and OpenAI's model list (``object``, ``data``) and, in the same
  body, KServe v1's ``models`` (the names), since both protocols own this path: an OpenAI
  client and a KServe v1 client each find their keys. Registered before KServe's own route,
  which it shadows.
- ``POST /tokenize``, ``POST /detokenize``: openai/tokenize.py.
- ``POST /rerank``, ``/score``, ``/classify``: a pooling model's routes (openai/pooling.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kserve_paged.model import PagedLLMModel
from kserve_paged.openai.handlers import OpenAIRoutes, in_openai_shape
from kserve_paged.openai.openapi import pooling_operation_schema
from kserve_paged.openai.pooling_schemas import ClassifyBody, RerankBody, ScoreBody
from kserve_paged.openai.schemas import parse_body
from kserve_paged.openai.tokenize import DetokenizeBody, TokenizeBody, detokenize, tokenize
from kserve_paged.vllm_flags import VLLM_CLI_VERSION, package_version


def health_status(model: PagedLLMModel) -> tuple[int, dict[str, Any]]:
    """(status, body) of /health: 200 while the engine serves, 503 loading or dead."""
    if model.llm.error is not None or model.load_error is not None:
        return 503, {"error": f"the engine of model {model.name} died: "
                              f"{model.llm.error or model.load_error}"}
    if not model.llm.is_healthy():
        return 503, {"error": f"the engine of model {model.name} has stopped"}
    if not (model.started and model.llm.is_ready):
        return 503, {"error": f"model {model.name} is loading"}
    return 200, {}


def register_vllm_routes(app: FastAPI, model: PagedLLMModel, routes: OpenAIRoutes) -> None:
    """The routes above, answered for `model` (and the names `routes` serves)."""

    async def health() -> Response:
        status, body = health_status(model)
        if status == 200:
            return Response(status_code=200)  # vLLM's: an empty 200
        return JSONResponse(status_code=status, content=body)

    async def show_version() -> dict[str, str]:
        return {"version": package_version(), "vllm_api_version": VLLM_CLI_VERSION}

    async def list_models() -> dict[str, Any]:
        listing = await routes.list_models()
        return {**listing, "models": [entry["id"] for entry in listing["data"]]}

    async def tokenize_route(request: Request) -> Response:
        body: TokenizeBody = await parse_body(request, TokenizeBody)
        return await tokenize(routes.model(body.model), body)

    async def detokenize_route(request: Request) -> Response:
        body: DetokenizeBody = await parse_body(request, DetokenizeBody)
        return await detokenize(routes.model(body.model), body)

    app.add_api_route("/health", health, methods=["GET"], include_in_schema=False)
    app.add_api_route("/ping", health, methods=["GET", "POST"], include_in_schema=False)
    app.add_api_route("/version", show_version, methods=["GET"], include_in_schema=False)
    app.add_api_route("/v1/models", list_models, methods=["GET"], tags=["OpenAI"])
    app.add_api_route("/tokenize", in_openai_shape(tokenize_route), methods=["POST"],
                      response_model=None, tags=["OpenAI"])
    app.add_api_route("/detokenize", in_openai_shape(detokenize_route), methods=["POST"],
                      response_model=None, tags=["OpenAI"])
    names = list(routes.models)
    for path, handler, body, what in (
            ("/rerank", routes.rerank, RerankBody, "Ranked documents"),
            ("/score", routes.score, ScoreBody, "One score per pair"),
            ("/classify", routes.classify, ClassifyBody, "Each input's label and probabilities")):
        app.add_api_route(path, in_openai_shape(handler), methods=["POST"], response_model=None,
                          tags=["OpenAI"], openapi_extra=pooling_operation_schema(body, names,
                                                                                  what))
