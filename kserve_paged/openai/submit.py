"""An OpenAI request's prompts to engine streams: the body's sampling options (and a tool
call's constraint) validated for every prompt, then all submitted or none."""

from __future__ import annotations

from typing import Any

from kserve_paged.admission import parse_timeout, tighten
from kserve_paged.openai.errors import APIError
from kserve_paged.openai.schemas import SamplingBody
from kserve_paged.request_options import OptionError
from kserve_paged.served import ServedModel, submit_all
from kserve_paged.structured import structured_outputs_given
from kserve_paged_engine.frontend.async_llm import RequestStream
from kserve_paged_engine.sampling_params import SamplingParams


async def open_streams(model: ServedModel, prompt_ids: list[list[int]], body: SamplingBody,
                       max_tokens: int | None, default_max: int | None, cache_salt: str | None,
                       kind: str, prompt_logprobs: int | None = None,
                       constraint: dict[str, Any] | None = None,
                       reasoning_gate: int | None = None) -> list[RequestStream]:
    """One stream per prompt, the body's options validated for every prompt before any is
    queued (served.submit_all); refusals as OpenAI's 400. `reasoning_gate`: the token after
    which a structured-output constraint starts (openai/chat_turn.py)."""
    options = {**body.sampling_options(), "max_tokens": max_tokens,
               "logprobs": body.top_logprobs_k()}
    if constraint is not None:  # the tools' own: no other constraint may be given
        if structured_outputs_given(options):
            raise APIError(400, "tool_choice \"required\" or a named function constrains "
                           "the output itself: it cannot be combined with response_format "
                           "or structured_outputs", param="tool_choice")
        options["structured_outputs"] = constraint
    if prompt_logprobs is not None:
        options["prompt_logprobs"] = prompt_logprobs
    def params_for(ids: list[int]) -> SamplingParams:
        params = model.sampling_params(options, ids, default_max)
        if reasoning_gate is not None and params.structured_outputs is not None:
            params.structured_outputs.start_after_token_id = reasoning_gate
        return params

    try:
        if body.timeout is not None:  # the header's and the server's may be earlier
            tighten(parse_timeout(body.timeout, "timeout"))
        _, streams = await submit_all(model, prompt_ids, params_for, kind=kind,
                                      priority=body.priority, cache_salt=cache_salt)
    except OptionError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    return streams
