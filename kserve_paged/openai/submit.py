"""An OpenAI request's prompts to engine streams: the body's sampling options (and a tool
call's constraint) validated for every prompt, then all submitted or none."""

from __future__ import annotations

from typing import Any

from engine.async_llm import RequestStream
from kserve_paged.admission import parse_timeout, tighten
from kserve_paged.openai.errors import APIError
from kserve_paged.openai.schemas import SamplingBody
from kserve_paged.sampling import OptionError
from kserve_paged.served import ServedModel, submit_all
from kserve_paged.structured import structured_outputs_given


async def open_streams(model: ServedModel, prompt_ids: list[list[int]], body: SamplingBody,
                       max_tokens: int | None, default_max: int | None, cache_salt: str | None,
                       kind: str, prompt_logprobs: int | None = None,
                       constraint: dict[str, Any] | None = None) -> list[RequestStream]:
    """One stream per prompt, the body's options validated for every prompt before any is
    queued (served.submit_all); refusals as OpenAI's 400."""
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
    try:
        if body.timeout is not None:  # the header's and the server's may be earlier
            tighten(parse_timeout(body.timeout, "timeout"))
        _, streams = await submit_all(
            model, prompt_ids, lambda ids: model.sampling_params(options, ids, default_max),
            kind=kind, priority=body.priority, cache_salt=cache_salt)
    except OptionError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    return streams
