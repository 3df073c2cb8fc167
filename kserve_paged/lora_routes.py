"""vLLM's runtime adapter routes: ``POST {prefix}/load_lora_adapter`` and
``/unload_lora_adapter`` with ``{"lora_name", "lora_path"}``, answered by the base model
(``PagedLLMModel.load_lora`` / ``unload_lora``), under ``/openai/v1`` (KServe's OpenAI prefix)
and ``/v1`` (vLLM's own paths, where a vLLM client calls them); 404 with a message unless the
server was started with ``--enable_lora_runtime_updates`` (or vLLM's
``$VLLM_ALLOW_RUNTIME_LORA_UPDATING``, lora_paths.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from kserve_paged.lora import LoRAError
from kserve_paged.lora_paths import DEFAULT_LORA_ROOTS, AdapterPathError, confine
from kserve_paged.model import PagedLLMModel
from kserve_paged.openai.errors import ERROR_SCHEMA

# KServe's OpenAI prefix, and vLLM's own (its api_server's /v1/load_lora_adapter).
LORA_PREFIXES = ("/openai/v1", "/v1")


def register_lora_routes(app: FastAPI, model: PagedLLMModel, *, runtime_updates: bool,
                         prefixes: Sequence[str] = LORA_PREFIXES,
                         roots: Sequence[str] = DEFAULT_LORA_ROOTS) -> None:
    """``POST {prefix}/load_lora_adapter`` and ``/unload_lora_adapter`` under each of
    ``prefixes`` with ``{"lora_name", "lora_path"}``; 404 with a message while runtime
    updates are off. A ``lora_path`` must resolve under one of ``roots`` (lora_paths.py),
    else 400; the engine holds the adapter to the same roots at every later read."""
    roots = tuple(roots)

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (ValueError, RecursionError):
            raise LoRAError(400, "the body must be JSON") from None
        if not isinstance(body, dict):
            raise LoRAError(400, "the body must be a JSON object")
        return body

    def refused() -> Response | None:
        if runtime_updates:
            return None
        return _error(404, "runtime LoRA updates are off: start the server with "
                      "--enable_lora_runtime_updates")

    async def load(request: Request) -> Response:
        if (no := refused()) is not None:
            return no
        try:
            body = await body_of(request)
            name = body.get("lora_name")
            if not isinstance(name, str) or not name:
                raise LoRAError(400, "lora_name must be a non-empty string")
            path = await asyncio.to_thread(confine, body.get("lora_path"), roots)
            await model.load_lora(name, path, roots=roots)
        except AdapterPathError as exc:
            return _error(400, str(exc))
        except LoRAError as exc:
            return _error(exc.status, str(exc))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(request: Request) -> Response:
        if (no := refused()) is not None:
            return no
        try:
            body = await body_of(request)
            name = body.get("lora_name")
            await model.unload_lora(name)
        except LoRAError as exc:
            return _error(exc.status, str(exc))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    for prefix in prefixes:
        app.add_api_route(f"{prefix}/load_lora_adapter", load, methods=["POST"],
                          tags=["LoRA"], openapi_extra=_operation(with_path=True))
        app.add_api_route(f"{prefix}/unload_lora_adapter", unload, methods=["POST"],
                          tags=["LoRA"], openapi_extra=_operation(with_path=False))


def _operation(with_path: bool) -> dict[str, Any]:
    """What a LoRA route publishes in /openapi.json (the handler parses its body itself)."""
    props: dict[str, Any] = {"lora_name": {"type": "string", "minLength": 1}}
    if with_path:
        props["lora_path"] = {"type": "string", "minLength": 1,
                              "description": "An adapter folder under one of --lora_roots"}
    error = {"content": {"application/json": {"schema": ERROR_SCHEMA}}}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": list(props), "properties": props}}}},
        "responses": {
            "200": {"description": "Done", "content": {"text/plain": {
                "schema": {"type": "string"}}}},
            "400": {"description": "A malformed body, a path outside --lora_roots, or an "
                           "adapter that cannot be read", **error},
            "404": {"description": "Runtime updates are off, or no such adapter", **error},
            "413": {"description": "The request body is too large", **error},
        }}


def _error(status: int, message: str) -> JSONResponse:
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": kind, "param": None, "code": status}})
