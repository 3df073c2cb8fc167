"""``POST /openai/v1/completions``: legacy completions, whole or streamed (SSE)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kserve_paged.logprobs import TokenText
from kserve_paged.openai.errors import APIError, error_body
from kserve_paged.openai.render import (
    ChoiceState,
    CompletionRender,
    check_output,
    finish_reason,
    total_usage,
)
from kserve_paged.openai.schemas import CompletionBody, CompletionOut
from kserve_paged.openai.stream import (
    DONE_EVENT,
    ClosingStreamingResponse,
    final_outputs,
    merge,
    sse,
)
from kserve_paged.openai.submission import submit_prompts
from kserve_paged.request_caps import check_prompt_count, check_prompt_token_ids
from kserve_paged.request_options import OptionError
from kserve_paged.served import ServedModel
from kserve_paged_engine.frontend.async_llm import EngineDeadError, RequestStream
from kserve_paged_engine.outputs import RequestOutput

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /completions


def split_prompts(prompt: str | list[str] | list[int] | list[list[int]]
                  ) -> list[str | list[int]]:
    """A completions ``prompt`` as a list of prompts (text, or token ids). An empty list is one
    empty prompt, which the one prompt check (PagedLLMModel.encode) refuses."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt or set(map(type, prompt)) == {int}:  # one pass in C: ids may be many
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def check_raw_prompt_ids(prompt: Any, max_model_len: int) -> None:
    """A completions ``prompt`` of token ids longer than --max_prompt_token_ids, refused from
    the decoded JSON before validation walks the ids (PagedLLMModel.encode checks the same
    cap again, for every other way in)."""
    if not isinstance(prompt, list) or not prompt:
        return
    lists = prompt if isinstance(prompt[0], list) else [prompt]
    try:
        for ids in lists:
            if isinstance(ids, list) and (not ids or not isinstance(ids[0], str)):
                check_prompt_token_ids(len(ids), max_model_len)
    except OptionError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


async def completions(model: ServedModel, request: Request, body: CompletionBody,
                      deadline: float | None = None) -> Response:
    """Legacy completions. ``n`` samples per prompt: choice ``index`` is prompt number * n
    + sample number. ``echo`` puts the prompt in front of each choice's text (and, with
    ``logprobs``, its tokens in front of the logprobs: the first one has none). ``deadline``:
    the request's (admission.py)."""
    name = body.model or model.name
    prompts = split_prompts(body.prompt)
    tokenizer = model.info.tokenizer
    try:
        check_prompt_count(len(prompts))
        options = body.sampling_request(model.info.vocab_size, COMPLETIONS_DEFAULT_MAX_TOKENS)
        for p in prompts:  # every prompt's length before any is tokenized
            if isinstance(p, str):
                model.check_prompt_chars(len(p))
        prompt_ids = [await model.encode(p) for p in prompts]
    except OptionError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    prompt_texts = ([p if isinstance(p, str) else tokenizer.decode(ids)
                     for p, ids in zip(prompts, prompt_ids)] if body.echo else None)
    # Echoed logprobs need the prompt's: ask the engine for as many as for the output.
    if body.echo and body.logprobs is not None:
        options = options.with_values(prompt_logprobs=max(body.prompt_logprobs or 0,
                                                          body.logprobs))
    salt = body.cache_salt or request.headers.get("x-cache-salt")
    streams = await submit_prompts(model, prompt_ids, options, kind="cmpl",
                                   priority=body.priority, cache_salt=salt, deadline=deadline)
    render = CompletionRender(body, TokenText(tokenizer), prompt_texts)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return ClosingStreamingResponse(
            _stream_completion(streams, rid, created, name, include_usage, render),
            streams)
    finals = await final_outputs(streams)
    choices = []
    for i, out in enumerate(finals):
        check_output(out)
        for c in sorted(out.outputs, key=lambda c: c.index):
            piece = render.piece(i, out, c, ChoiceState(), delta=False)
            choices.append({**piece, "finish_reason": finish_reason(c) or "stop"})
    result = CompletionOut.model_validate({
        "id": rid, "object": "text_completion", "created": created, "model": name,
        "choices": choices, "usage": total_usage(finals).model_dump(exclude_unset=True)})
    return JSONResponse(result.model_dump(mode="json", exclude_unset=True))

async def _stream_completion(streams: list[RequestStream], rid: str, created: int, model: str,
                             include_usage: bool, render: CompletionRender
                             ) -> AsyncIterator[str]:
    finals: dict[int, RequestOutput] = {}
    states: dict[int, ChoiceState] = {}
    want_logprobs = render.body.logprobs is not None
    try:
        async for i, out in merge(streams):
            check_output(out)
            if out.finished:
                finals[i] = out
            for c in out.outputs:
                index = i * render.body.n + c.index
                state = states.setdefault(index, ChoiceState())
                if state.done:
                    continue
                reason = finish_reason(c)
                first = not state.started
                if not (c.delta_text or reason or first and render.echo
                        or want_logprobs and c.delta_token_ids):
                    continue
                piece = render.piece(i, out, c, state, delta=True)
                state.done = reason is not None
                chunk = {"id": rid, "object": "text_completion", "created": created,
                         "model": model, "choices": [{**piece, "finish_reason": reason}]}
                if include_usage:
                    chunk["usage"] = None
                yield sse(chunk)
        if include_usage:
            usage = total_usage([finals[i] for i in sorted(finals)])
            yield sse({"id": rid, "object": "text_completion", "created": created,
                        "model": model, "choices": [],
                        "usage": usage.model_dump(exclude_unset=True)})
    except APIError as exc:
        yield sse(error_body(exc.message, exc.type, exc.param, exc.code))
    except EngineDeadError as exc:
        yield sse(error_body(str(exc), "server_error"))
    yield DONE_EVENT

