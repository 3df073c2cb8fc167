"""The OpenAI routes: which served model a request names, the model list, and the routes'
registration; completions and chat are completions.py and chat.py.

Sampling options follow vLLM's OpenAI server: n, penalties, logit_bias, seed, logprobs (legacy
object on completions, ``content`` list on chat), echo, prompt_logprobs,
include_stop_str_in_output, skip_special_tokens. Options the engine cannot honour are refused
(see schemas.py). Prompts are checked for length before they are tokenized, and tokenized off
the event loop (PagedLLMModel.encode).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from kserve.errors import InferenceError, ModelNotReady
from openai.types import Model as OpenAIModel

from kserve_paged.admission import RequestRefused, route_deadline
from kserve_paged.lora import AdapterView
from kserve_paged.openai import pooling
from kserve_paged.openai.chat import chat_completions
from kserve_paged.openai.completions import check_raw_prompt_ids, completions
from kserve_paged.openai.errors import APIError
from kserve_paged.openai.openapi import (
    operation_schema,
    pooling_operation_schema,
    sdk_operation_schema,
)
from kserve_paged.openai.pooling_schemas import ClassifyBody, EmbeddingBody, RerankBody, ScoreBody
from kserve_paged.openai.responses import create_response, parse_responses
from kserve_paged.openai.responses_body import ResponsesBody
from kserve_paged.openai.schemas import (
    ChatBody,
    ChatCompletionOut,
    CompletionBody,
    CompletionOut,
    parse_body,
    read_json,
)
from kserve_paged.served import ServedModel
from kserve_paged_engine.frontend.async_llm import EngineDeadError

logger = logging.getLogger("kserve.paged.openai")

PREFIX = "/openai/v1"
VLLM_PREFIX = "/v1"  # not /v1/models: see register_openai_routes


class OpenAIRoutes:
    """The handlers, bound to the served models (by name)."""

    def __init__(self, models: dict[str, ServedModel]) -> None:
        self.models = models

    def model_named(self, name: str | None) -> ServedModel:
        """The served model (or adapter) a request names; an APIError (400, 404, 503) when
        there is none to use."""
        if name is None:  # one model (under one or more names) needs no name
            if len({id(m) for m in self.models.values()}) != 1:
                raise APIError(400, "model is required", param="model")
            name, model = next(iter(self.models.items()))
        else:
            model = self.models.get(name) or self._adapter(name)
        if model is None:
            raise APIError(404, f"The model `{name}` does not exist.", param="model",
                           type_="invalid_request_error", code="model_not_found")
        if not model.accepting:
            raise APIError(503, f"The model `{name}` is not ready. {model.not_ready_reason()}",
                           type_="service_unavailable_error", code="model_not_ready")
        return model

    def _adapter(self, name: str) -> AdapterView | None:
        """A LoRA adapter served under `name` by one of the models (kserve_paged/lora.py)."""
        for model in self.models.values():
            lora = model.loras.get(name)
            if lora is not None:
                return AdapterView(model, lora, name)
        return None

    async def list_models(self) -> dict[str, Any]:
        data = []
        for name, model in self.models.items():
            entry = OpenAIModel(id=name, created=int(model.created), object="model",
                                owned_by="kserve-paged")
            info = model.loaded_info
            data.append({**entry.model_dump(exclude_unset=True),
                         "root": info.model_path if info else None,
                         "max_model_len": info.max_model_len if info else None,
                         "ready": model.accepting})
            data.extend({"id": served, "object": "model", "created": int(model.created),
                         "owned_by": "kserve-paged", "root": lora.lora_path, "parent": name,
                         "max_model_len": info.max_model_len if info else None,
                         "ready": model.accepting} for served, lora in model.loras.items())
        return {"object": "list", "data": data}

    def generator(self, name: str | None, route: str) -> ServedModel:
        """The named model, or a 400 naming its job when it does not generate (the check
        here: a generating model never enters pooling.py)."""
        model = self.model_named(name)
        if model.info.job != "generate":
            pooling.require_job(model, ("generate",), route)
        return model

    async def completions(self, request: Request) -> Response:
        def precheck(data: dict[str, Any]) -> None:
            try:
                model = self.generator(data.get("model"), "/completions")
            except APIError:
                return  # validation and the route say what is wrong with the name
            check_raw_prompt_ids(data.get("prompt"), model.info.max_model_len)

        body: CompletionBody = await parse_body(request, CompletionBody, precheck)
        return await completions(self.generator(body.model, "/completions"), request, body,
                                 deadline(request, body.timeout))

    async def chat_completions(self, request: Request) -> Response:
        body: ChatBody = await parse_body(request, ChatBody)
        return await chat_completions(self.generator(body.model, "/chat/completions"),
                                      request, body, deadline(request, body.timeout))

    async def responses(self, request: Request) -> Response:
        body, chat = parse_responses(await read_json(request))
        return await create_response(self.generator(body.model, "/responses"), request, body,
                                     chat, deadline(request))

    async def embeddings(self, request: Request) -> Response:
        body: EmbeddingBody = await parse_body(request, EmbeddingBody)
        return await pooling.embeddings(self.model_named(body.model), body, deadline(request))

    async def rerank(self, request: Request) -> Response:
        body: RerankBody = await parse_body(request, RerankBody)
        return await pooling.rerank(self.model_named(body.model), body, deadline(request))

    async def score(self, request: Request) -> Response:
        body: ScoreBody = await parse_body(request, ScoreBody)
        return await pooling.score(self.model_named(body.model), body, deadline(request))

    async def classify(self, request: Request) -> Response:
        body: ClassifyBody = await parse_body(request, ClassifyBody)
        return await pooling.classify(self.model_named(body.model), body, deadline(request))

    model = model_named  # the root routes' name for it (vllm_routes.py)


def deadline(request: Request, timeout: float | None = None) -> float | None:
    """The request's deadline (admission.py), tightened by the body's ``timeout``: read once
    here and passed down to the engine; a bad ``timeout`` is a 400."""
    try:
        return route_deadline(request, timeout)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


def _in_openai_shape(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
    """Map every failure to OpenAI's error shape (KServe's handlers would answer its own)."""
    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as exc:
            return exc.response()
        except RequestRefused as exc:  # 429: the waiting queue is full (admission.py)
            return APIError(exc.status, str(exc), type_="rate_limit_error",
                            headers=exc.headers).response()
        except (ModelNotReady, EngineDeadError) as exc:
            return APIError(503, str(exc), type_="service_unavailable_error").response()
        except InferenceError as exc:
            return APIError(500, str(exc)).response()
        except Exception as exc:
            logger.exception("OpenAI route failed")
            return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()
    route.__name__ = getattr(handler, "__name__", "route")
    return route


in_openai_shape = _in_openai_shape  # for the routes registered elsewhere (vllm_routes.py)


def register_openai_routes(app: FastAPI, models: dict[str, ServedModel],
                           prefixes: tuple[str, ...] = (PREFIX,),
                           aliases: tuple[str, ...] = (VLLM_PREFIX,)) -> OpenAIRoutes:
    """Add ``models``, ``completions``, ``chat/completions`` and ``responses`` under each
    prefix, and all but ``models`` under each alias (vLLM's paths, where an
    LLMInferenceService's route sends them; ``/v1/models`` stays KServe's v1 protocol route).
    kserve_paged/routes.py calls this with the other routes."""
    routes = OpenAIRoutes(models)
    for prefix in (*prefixes, *aliases):
        alias = prefix not in prefixes
        router = APIRouter(prefix=prefix, tags=["OpenAI"], include_in_schema=not alias)
        if not alias:
            router.add_api_route("/models", routes.list_models, methods=["GET"])
        router.add_api_route("/completions", _in_openai_shape(routes.completions),
                             methods=["POST"], response_model=None,
                             openapi_extra=operation_schema(CompletionBody, CompletionOut,
                                                            list(models)))
        router.add_api_route("/chat/completions", _in_openai_shape(routes.chat_completions),
                             methods=["POST"], response_model=None,
                             openapi_extra=operation_schema(ChatBody, ChatCompletionOut,
                                                            list(models)))
        router.add_api_route("/responses", _in_openai_shape(routes.responses),
                             methods=["POST"], response_model=None,
                             openapi_extra=sdk_operation_schema(
                                 ResponsesBody,
                                 "A Responses API response, or with stream=true its events"))
        pooled = [("/embeddings", routes.embeddings, EmbeddingBody, "OpenAI's embeddings"),
                  ("/rerank", routes.rerank, RerankBody, "Ranked documents")]
        if alias:
            pooled.append(("/score", routes.score, ScoreBody, "One score per pair"))
        for path, handler, body_type, what in pooled:
            router.add_api_route(path, _in_openai_shape(handler), methods=["POST"],
                                 response_model=None, openapi_extra=pooling_operation_schema(
                                     body_type, list(models), what))
        app.include_router(router)
    return routes
