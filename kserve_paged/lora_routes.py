"""vLLM's runtime adapter routes: ``POST {prefix}/load_lora_adapter`` and
``/unload_lora_adapter`` with ``{"lora_name", "lora_path"}``, answered by the base model
(``PagedLLMModel.load_lora`` / ``unload_lora``); 404 with a message unless the server was
started with ``--enable_lora_runtime_updates``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from kserve_paged.lora import LoRAError
from kserve_paged.lora_paths import DEFAULT_LORA_ROOTS, AdapterPathError, confine
from kserve_paged.model import PagedLLMModel


def register_lora_routes(app: FastAPI, model: PagedLLMModel, *, runtime_updates: bool,
                         prefix: str = "/openai/v1",
                         roots: Sequence[str] = DEFAULT_LORA_ROOTS) -> None:
    """``POST {prefix}/load_lora_adapter`` and ``/unload_lora_adapter`` with
    ``{"lora_name", "lora_path"}``; 404 with a message while runtime updates are off. A
    ``lora_path`` must resolve under one of ``roots`` (lora_paths.py), else 400."""
    roots = tuple(roots)

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
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
            await model.load_lora(name, path)
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

    app.add_api_route(f"{prefix}/load_lora_adapter", load, methods=["POST"],
                      include_in_schema=False)
    app.add_api_route(f"{prefix}/unload_lora_adapter", unload, methods=["POST"],
                      include_in_schema=False)


def _error(status: int, message: str) -> JSONResponse:
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": kind, "param": None, "code": status}})
