"""LoRA adapters in the server: each adapter is served as a model name of its own.

The registry lives on the base :class:`PagedLLMModel` (``model.loras``: name -> LoRARequest);
an :class:`AdapterView` is the base model seen through one adapter, so the OpenAI handlers
serve it unchanged, and an :class:`AdapterModel` in KServe's model repository serves v1/v2
under the adapter's name. Runtime loads and unloads (vLLM's ``/load_lora_adapter`` and
``/unload_lora_adapter``) run on the engine thread between steps, and are refused unless the
server was started with ``--enable_lora_runtime_updates``.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from kserve import Model
from kserve.protocol.infer_type import InferRequest, InferResponse

from engine.async_llm import RequestStream
from engine.lora import LoRARequest
from engine.sampling_params import SamplingParams
from kserve_paged import v2

if TYPE_CHECKING:
    from kserve_paged.model import PagedLLMModel

_ids = itertools.count(1)  # one id per load: a reloaded adapter never reuses cached prefixes


class AdapterView:
    """The base model under one adapter's name: everything is the base model's, except the
    name and that requests run with the adapter."""

    def __init__(self, base: PagedLLMModel, lora: LoRARequest) -> None:
        self.base = base
        self.lora = lora
        self.name = lora.lora_name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.base, attr)

    async def submit(self, prompt_ids: list[int], params: SamplingParams, *, kind: str,
                     priority: int = 0, cache_salt: str | None = None) -> RequestStream:
        return await self.base.submit(prompt_ids, params, kind=kind, priority=priority,
                                      cache_salt=cache_salt, lora_request=self.lora)


class AdapterModel(Model):
    """The adapter as a model of KServe's repository: ``/v2/models/{adapter}/infer``, its
    ready route and metadata, all answered by the base model's engine with the adapter."""

    def __init__(self, base: PagedLLMModel, lora: LoRARequest) -> None:
        super().__init__(lora.lora_name)
        self.view = AdapterView(base, lora)
        self.ready = True

    async def healthy(self) -> bool:
        return self.view.base.accepting

    def get_input_types(self) -> list[dict[str, Any]]:
        return self.view.base.get_input_types()

    def get_output_types(self) -> list[dict[str, Any]]:
        return self.view.base.get_output_types()

    async def predict(self, payload: InferRequest | dict[str, Any],
                      headers: dict[str, str] | None = None,
                      response_headers: dict[str, str] | None = None
                      ) -> InferResponse | dict[str, Any]:
        self.view.base.check_ready()
        return await v2.predict(self.view, payload)


class LoRAError(ValueError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def load_lora(model: PagedLLMModel, name: str, path: str) -> LoRARequest:
    """Load an adapter into the engine and serve it as `name`; LoRAError (400) if it cannot."""
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise LoRAError(400, "lora_name and lora_path must be non-empty strings")
    if name == model.name or name in model.loras:
        raise LoRAError(400, f"The lora adapter '{name}' has already been loaded.")
    lora = LoRARequest(name, next(_ids), path)
    try:
        await model.llm.add_lora(lora)
    except ValueError as exc:
        raise LoRAError(400, str(exc)) from None
    model.loras[name] = lora
    if model.repository is not None:
        model.repository.update(AdapterModel(model, lora))
    return lora


async def unload_lora(model: PagedLLMModel, name: str) -> None:
    lora = model.loras.pop(name, None) if isinstance(name, str) else None
    if lora is None:
        raise LoRAError(404, f"The lora adapter '{name}' cannot be found.")
    if model.repository is not None and model.repository.get_model(name) is not None:
        model.repository.unload(name)
    await model.llm.remove_lora(lora.lora_int_id)


def register_lora_routes(app: FastAPI, model: PagedLLMModel, *, runtime_updates: bool,
                         prefix: str = "/openai/v1") -> None:
    """``POST {prefix}/load_lora_adapter`` and ``/unload_lora_adapter`` with
    ``{"lora_name", "lora_path"}``; 404 with a message while runtime updates are off."""

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
            await load_lora(model, name, body.get("lora_path"))
        except LoRAError as exc:
            return _error(exc.status, str(exc))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(request: Request) -> Response:
        if (no := refused()) is not None:
            return no
        try:
            body = await body_of(request)
            name = body.get("lora_name")
            await unload_lora(model, name)
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
