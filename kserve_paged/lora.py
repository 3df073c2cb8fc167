"""LoRA adapters in the server: each adapter is served as a model name of its own.

The registry lives on the base model (``PagedLLMModel.loras``: name -> LoRARequest, loaded by
``PagedLLMModel.load_lora``); an :class:`AdapterView` is the base model seen through one
adapter, a `ServedModel` the OpenAI handlers serve unchanged, and an :class:`AdapterModel` in
KServe's model repository serves v1/v2 under the adapter's name. One loaded adapter may be served
under several names (``PagedLLMModel.alias_lora``: the start-up adapters of one folder, as
KServe's LLMInferenceService lists each twice). Runtime loads and unloads
(vLLM's ``/load_lora_adapter`` and ``/unload_lora_adapter``, lora_routes.py) run on the engine
thread between steps.
"""

from __future__ import annotations

from typing import Any

from kserve import Model
from kserve.protocol.infer_type import InferRequest, InferResponse

from kserve_paged import v2
from kserve_paged.admission import headers_deadline
from kserve_paged.request_options import SamplingRequest
from kserve_paged.served import ServedModel
from kserve_paged_engine.frontend.async_llm import RequestStream
from kserve_paged_engine.lora import LoRARequest
from kserve_paged_engine.model_info import ModelInfo
from kserve_paged_engine.pooling_params import PoolingParams
from kserve_paged_engine.sampling_params import SamplingParams


class AdapterView:
    """The base model under one adapter's name: everything is the base model's, except the
    name and that requests run with the adapter."""

    def __init__(self, base: ServedModel, lora: LoRARequest, name: str | None = None) -> None:
        self.base = base
        self.lora = lora
        self.name = name or lora.lora_name  # one adapter may be served under several names
        self.created = base.created
        self.tool_call_parser = base.tool_call_parser
        self.reasoning_parser = base.reasoning_parser
        self.default_chat_template_kwargs = base.default_chat_template_kwargs
        self.loras: dict[str, LoRARequest] = {}  # an adapter serves no adapters of its own

    @property
    def accepting(self) -> bool:
        return self.base.accepting

    @property
    def info(self) -> ModelInfo:
        return self.base.info

    @property
    def loaded_info(self) -> ModelInfo | None:
        return self.base.loaded_info

    def not_ready_reason(self) -> str:
        return self.base.not_ready_reason()

    def check_ready(self) -> None:
        self.base.check_ready()

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        self.base.check_prompt_chars(num_chars, param)

    async def encode(self, prompt: str | list[int], *, add_special_tokens: bool = True
                     ) -> list[int]:
        return await self.base.encode(prompt, add_special_tokens=add_special_tokens)

    def sampling_params(self, request: SamplingRequest, prompt_len: int) -> SamplingParams:
        return self.base.sampling_params(request, prompt_len)

    async def submit(self, prompt_ids: list[int], params: SamplingParams, *, kind: str,
                     priority: int = 0, cache_salt: str | None = None,
                     deadline: float | None = None,
                     pooling_params: PoolingParams | None = None) -> RequestStream:
        return await self.base.submit(prompt_ids, params, kind=kind, priority=priority,
                                      cache_salt=cache_salt, deadline=deadline,
                                      lora_request=self.lora,
                                      served_name=self.name, pooling_params=pooling_params)


class AdapterModel(Model):
    """The adapter as a model of KServe's repository: ``/v2/models/{adapter}/infer``, its
    ready route and metadata, all answered by the base model's engine with the adapter."""

    def __init__(self, base: ServedModel, lora: LoRARequest, name: str | None = None) -> None:
        super().__init__(name or lora.lora_name)
        self.view = AdapterView(base, lora, name)
        self.ready = True

    async def healthy(self) -> bool:
        return self.view.accepting

    def get_input_types(self) -> list[dict[str, Any]]:
        return v2.input_types()

    def get_output_types(self) -> list[dict[str, Any]]:
        return v2.output_types()

    async def predict(self, payload: InferRequest | dict[str, Any],
                      headers: dict[str, str] | None = None,
                      response_headers: dict[str, str] | None = None
                      ) -> InferResponse | dict[str, Any]:
        self.view.check_ready()
        return await v2.predict(self.view, payload, headers_deadline(headers))


class LoRAError(ValueError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
