"""What the front ends serve: one protocol for a served model, and the one way a request's
prompts reach the engine.

v2.py, the OpenAI handlers (kserve_paged/openai/) and the LoRA views (lora.py) are written
against `ServedModel`: `PagedLLMModel` (model.py) implements it, and so does an
`AdapterView`, the base model under one adapter's name. `submit_all` is the rule both
protocols follow: every prompt's SamplingParams is made (and so validated) from the request's
one `SamplingRequest` before any is queued, then all are submitted with the request's
deadline, and if one submit fails those already queued are aborted: a request is answered
whole or not at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kserve_paged.request_options import SamplingRequest
from kserve_paged_engine.frontend.async_llm import RequestStream
from kserve_paged_engine.lora import LoRARequest
from kserve_paged_engine.model_info import ModelInfo
from kserve_paged_engine.pooling_params import PoolingParams
from kserve_paged_engine.sampling_params import SamplingParams


class ServedModel(Protocol):
    name: str
    created: float  # when it was registered (time.time())
    tool_call_parser: str  # how chat output is read for tool calls (openai/tools.py)
    reasoning_parser: str | None  # how a thinking model's output splits (openai/reasoning.py)
    default_chat_template_kwargs: dict[str, Any]  # every chat template render gets them
    loras: dict[str, LoRARequest]  # adapters served under their own names

    @property
    def accepting(self) -> bool:
        """Loaded, alive and not shutting down."""

    @property
    def info(self) -> ModelInfo:
        """The loaded engine's facts; RuntimeError before it has loaded."""

    @property
    def loaded_info(self) -> ModelInfo | None:
        """`info` while the engine serves, else None."""

    def not_ready_reason(self) -> str: ...

    def check_ready(self) -> None:
        """Raise KServe's ModelNotReady unless `accepting`."""

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        """Refuse (OptionError) a prompt text too long to tokenize, before tokenizing it."""

    async def encode(self, prompt: str | list[int], *, add_special_tokens: bool = True
                     ) -> list[int]:
        """A prompt's token ids, checked (OptionError when it is unusable)."""

    def sampling_params(self, request: SamplingRequest, prompt_len: int) -> SamplingParams:
        """One prompt's SamplingParams from the request's options, the model's defaults under
        them, validated (OptionError)."""

    async def submit(self, prompt_ids: list[int], params: SamplingParams, *, kind: str,
                     priority: int = 0, cache_salt: str | None = None,
                     deadline: float | None = None,
                     pooling_params: PoolingParams | None = None) -> RequestStream:
        """Hand a validated request to the engine, aborted at `deadline` (time.monotonic(),
        admission.py) if given (ValueError: refused; ModelNotReady); with `pooling_params`,
        a pooling request (kserve_paged/openai/pooling.py)."""


async def submit_all(model: ServedModel, prompts: Sequence[list[int]],
                     request: SamplingRequest, *, kind: str, priority: int = 0,
                     cache_salt: str | None = None, deadline: float | None = None
                     ) -> tuple[list[SamplingParams], list[RequestStream]]:
    """Make every prompt's SamplingParams (raising OptionError), then submit every prompt; a
    failing submit closes (aborts) the streams already opened and re-raises. Returns each
    prompt's params and stream."""
    params = [model.sampling_params(request, len(ids)) for ids in prompts]
    streams: list[RequestStream] = []
    try:
        for ids, p in zip(prompts, params):
            streams.append(await model.submit(ids, p, kind=kind, priority=priority,
                                              cache_salt=cache_salt, deadline=deadline))
    except BaseException:
        for s in streams:
            s.close()
        raise
    return params, streams
