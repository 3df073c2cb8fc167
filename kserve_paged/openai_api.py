"""OpenAI-compatible routes (``/openai/v1/...``) on KServe's FastAPI app.

KServe 0.21's own OpenAI routes need vLLM installed (kserve.md), so these are ours: request
bodies are validated here (pydantic), responses are built from the ``openai`` package's types
where they fit, errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Sampling options follow vLLM's OpenAI server: n, penalties, logit_bias, seed, logprobs (legacy
object on completions, ``content`` list on chat), echo, prompt_logprobs,
include_stop_str_in_output, skip_special_tokens. Options that would change results but that the
engine cannot honour (best_of != n, suffix, tools, JSON mode, beam search, guided decoding, ...)
are refused with a 400 naming the option, never ignored.
A client that disconnects gets its requests aborted: streaming through generator cancellation,
non-streaming by polling ``request.is_disconnected()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from kserve.errors import InferenceError, ModelNotReady
from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types import Model as OpenAIModel
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from engine.async_llm import EngineDeadError, RequestStream
from engine.outputs import CompletionOutput, RequestOutput
from kserve_paged.logprobs import (
    Entry,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_json,
)
from kserve_paged.model import PagedLLMModel
from kserve_paged.sampling import OptionError, unsupported_options

logger = logging.getLogger("kserve.paged.openai")

PREFIX = "/openai/v1"
DISCONNECT_POLL_S = 0.25
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /completions
_FINISH_REASONS = {"stop", "length"}


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type_: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.code = code

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=error_body(
            self.message, self.type, self.param, self.code))


def error_body(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# -- request bodies ---------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingBody(BaseModel):
    """Fields common to both endpoints. Unknown fields are accepted and ignored (clients send
    vendor extras); the known ones that would change results are checked in ``unsupported``."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    cache_salt: str | None = None
    priority: int = 0
    # vLLM's extras
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None

    def sampling_options(self) -> dict[str, Any]:
        """The options that go to SamplingParams as given (``logprobs`` is per endpoint)."""
        return {name: getattr(self, name) for name in (
            "temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos",
            "min_tokens", "stop_token_ids", "n", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "logit_bias", "prompt_logprobs", "include_stop_str_in_output",
            "skip_special_tokens")}

    def top_logprobs_k(self) -> int | None:
        """Top log-probabilities per generated token, or None when none are asked for."""
        return None

    def unsupported(self) -> list[tuple[str, str]]:
        found = []
        if self.response_format and self.response_format.get("type", "text") != "text":
            found.append(("response_format",
                          f"response_format {self.response_format.get('type')!r} is not "
                          "supported (only 'text'): this server has no structured output"))
        if self.stream_options is not None and not self.stream:
            found.append(("stream_options", "stream_options is only allowed with stream=true"))
        for name in unsupported_options({**(self.model_extra or {}), "n": self.n}):
            found.append((name, f"{name} is not supported by this server"))
        return found


class CompletionBody(_SamplingBody):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # true is no token id
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def top_logprobs_k(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> list[tuple[str, str]]:
        found = super().unsupported()
        if self.best_of is not None and self.best_of != self.n:
            found.append(("best_of", f"best_of={self.best_of} is not supported: every sample "
                          f"is returned, so best_of must be unset or equal n ({self.n})"))
        if self.suffix:
            found.append(("suffix", "suffix is not supported (no fill-in-the-middle)"))
        return found


# Chat extras of vLLM and OpenAI that change what is generated, beyond the shared table; any
# value but the harmless one is a 400.
_CHAT_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (False,), "chat_template": (), "chat_template_kwargs": (), "documents": (),
    "audio": (), "prediction": (), "web_search_options": (),
}


class ChatBody(_SamplingBody):
    """``max_completion_tokens`` is OpenAI's newer name for ``max_tokens``; a request giving
    both with different values is refused (400 naming max_completion_tokens) rather than one
    of them silently winning."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def top_logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def output_budget(self) -> int | None:
        return (self.max_completion_tokens if self.max_completion_tokens is not None
                else self.max_tokens)

    def unsupported(self) -> list[tuple[str, str]]:
        found = super().unsupported()
        extra = self.model_extra or {}
        for name in unsupported_options(extra, _CHAT_UNSUPPORTED, check_best_of=False):
            found.append((name, f"{name} is not supported by this server"))
        if extra.get("modalities") not in (None, [], ["text"]):
            found.append(("modalities", "modalities other than [\"text\"] are not supported"))
        if (self.max_completion_tokens is not None and self.max_tokens is not None
                and self.max_completion_tokens != self.max_tokens):
            found.append(("max_completion_tokens",
                          f"max_completion_tokens ({self.max_completion_tokens}) and max_tokens "
                          f"({self.max_tokens}) disagree; give one of them"))
        if self.top_logprobs is not None and not self.logprobs:
            found.append(("top_logprobs", "top_logprobs requires logprobs=true"))
        if self.tools:
            found.append(("tools", "tools are not supported (no tool calling)"))
        if self.tool_choice not in (None, "none"):
            found.append(("tool_choice", "tool_choice is not supported (no tool calling)"))
        if self.functions:
            found.append(("functions", "functions are not supported (no function calling)"))
        if self.function_call not in (None, "none"):
            found.append(("function_call", "function_call is not supported"))
        return found


# -- helpers ----------------------------------------------------------------------------------

async def _parse(request: Request, cls: type[BaseModel]) -> Any:
    try:
        raw = await request.body()
        data = json.loads(raw) if raw else None
        # JSON may escape lone surrogates (\ud800), which no tokenizer takes: refuse them here.
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except UnicodeEncodeError:
        raise APIError(400, "the request body holds invalid Unicode (a lone surrogate)") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        body = cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ()) if not isinstance(p, int)) or None
        if param and "[" in param:
            param = param.split("[")[0]
        raise APIError(400, f"invalid request: {param}: {err.get('msg')}" if param
                       else f"invalid request: {err.get('msg')}", param=param) from None
    for param, message in body.unsupported():
        raise APIError(400, message, param=param, code="unsupported_parameter")
    if body.model_extra:
        # vLLM's behaviour, which OpenAI clients rely on (they send vendor extras): ignore
        # unknown fields, but leave a trace for the operator.
        logger.warning("ignoring unknown field(s) %s in %s", sorted(body.model_extra),
                       request.url.path)
    return body


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def _chat_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with plain-text content, as chat templates expect."""
    conversation = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str):
            raise APIError(400, f"messages[{i}].role must be a string", param="messages")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise APIError(400, f"messages[{i}]: content part {kind!r} is not supported "
                                   "(text only)", param="messages")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text "
                           "parts", param="messages")
        conversation.append({**message, "content": content})
    return conversation


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> CompletionUsage:
    return CompletionUsage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens,
                           prompt_tokens_details={"cached_tokens": cached})


def _check_output(out: RequestOutput) -> None:
    if out.error is not None or any(c.finish_reason == "error" for c in out.outputs):
        raise APIError(500, f"generation failed: {out.error}")


def _finish_reason(completion: CompletionOutput) -> str | None:
    reason = completion.finish_reason
    return reason if reason in _FINISH_REASONS else (None if reason is None else "stop")


def _new_entries(completion: CompletionOutput, delta: bool) -> tuple[list[int], list[Entry]]:
    """The completion's token ids (all, or this step's) with their log-probability entries."""
    ids = list(completion.delta_token_ids) if delta else list(completion.token_ids)
    entries: list[Entry] = list(completion.logprobs or [])
    if len(entries) < len(completion.token_ids):  # an engine that returned none
        entries += [None] * (len(completion.token_ids) - len(entries))
    return ids, entries[len(completion.token_ids) - len(ids):len(completion.token_ids)]


# -- response bodies (OpenAI's types, widened where vLLM-style answers carry more) -------------

class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs; entries are null for the first echoed prompt token."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoiceOut(CompletionChoice):
    logprobs: CompletionLogprobs | None = None  # type: ignore[assignment]
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra, when asked for


class CompletionOut(Completion):
    choices: list[CompletionChoiceOut]  # type: ignore[assignment]


class ChatCompletionOut(ChatCompletion):
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra, when asked for


class _ChoiceState:
    """What one streamed choice has sent so far."""

    __slots__ = ("started", "done", "offset")

    def __init__(self) -> None:
        self.started = False
        self.done = False
        self.offset = 0


def _sse(data: BaseModel | dict[str, Any]) -> str:
    payload = (data.model_dump_json(exclude_unset=True) if isinstance(data, BaseModel)
               else json.dumps(data, separators=(",", ":")))
    return f"data: {payload}\n\n"


class _ClosingStreamingResponse(StreamingResponse):
    """Closes the body iterator and the request streams however the response ends, so a
    vanished client's requests are aborted at once (Starlette cancels the body only on ASGI <
    2.4 servers, and an unstarted generator's finally never runs)."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=_SSE_HEADERS)
        self._streams = streams

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            for stream in self._streams:
                stream.close()
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


async def _until_disconnect(request: Request, work: asyncio.Future[Any]) -> Any:
    """Await ``work``; cancel it (which aborts its requests) if the client goes away."""
    while True:
        done, _ = await asyncio.wait({work}, timeout=DISCONNECT_POLL_S)
        if done:
            return work.result()
        if await request.is_disconnected():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
            logger.info("client disconnected; request aborted")
            return None


# -- the routes -------------------------------------------------------------------------------

class OpenAIRoutes:
    """The handlers, bound to the served models (by name)."""

    def __init__(self, models: dict[str, PagedLLMModel]) -> None:
        self.models = models

    def _model(self, name: str | None) -> PagedLLMModel:
        if name is None:
            if len(self.models) != 1:
                raise APIError(400, "model is required", param="model")
            name, model = next(iter(self.models.items()))
        else:
            model = self.models.get(name)
        if model is None:
            raise APIError(404, f"The model `{name}` does not exist.", param="model",
                           type_="invalid_request_error", code="model_not_found")
        if not model.accepting:
            raise APIError(503, f"The model `{name}` is not ready. {model.not_ready_reason()}",
                           type_="service_unavailable_error", code="model_not_ready")
        return model

    async def list_models(self) -> dict[str, Any]:
        data = []
        for name, model in self.models.items():
            entry = OpenAIModel(id=name, created=int(model.created), object="model",
                                owned_by="kserve-paged")
            data.append({**entry.model_dump(exclude_unset=True), "root": model.model_path,
                         "max_model_len": model.max_model_len, "ready": model.accepting})
        return {"object": "list", "data": data}

    async def _prepare(self, model: PagedLLMModel, prompt_ids: list[list[int]],
                       body: _SamplingBody, max_tokens: int | None, default_max: int | None,
                       cache_salt: str | None, kind: str, prompt_logprobs: int | None = None
                       ) -> list[RequestStream]:
        options = {**body.sampling_options(), "max_tokens": max_tokens,
                   "logprobs": body.top_logprobs_k()}
        if prompt_logprobs is not None:
            options["prompt_logprobs"] = prompt_logprobs
        try:
            params = [model.sampling_params(options, ids, default_max) for ids in prompt_ids]
        except OptionError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        streams: list[RequestStream] = []
        try:
            for ids, p in zip(prompt_ids, params):
                streams.append(await model.submit(ids, p, kind=kind, priority=body.priority,
                                                  cache_salt=cache_salt))
        except BaseException as exc:
            for s in streams:
                s.close()
            if isinstance(exc, ValueError):
                raise APIError(400, str(exc)) from None
            raise
        return streams

    async def completions(self, request: Request) -> Response:
        """Legacy completions. ``n`` samples per prompt: choice ``index`` is prompt number * n
        + sample number. ``echo`` puts the prompt in front of each choice's text (and, with
        ``logprobs``, its tokens in front of the logprobs: the first one has none)."""
        body: CompletionBody = await _parse(request, CompletionBody)
        model = self._model(body.model)
        name = body.model or model.name
        prompts = _prompts(body.prompt)
        try:
            prompt_ids = [model.encode(p) for p in prompts]
        except OptionError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        prompt_texts = ([p if isinstance(p, str) else model.tokenizer.decode(ids)
                         for p, ids in zip(prompts, prompt_ids)] if body.echo else None)
        # Echoed logprobs need the prompt's: ask the engine for as many as for the output.
        prompt_k = body.prompt_logprobs
        if body.echo and body.logprobs is not None:
            prompt_k = max(prompt_k or 0, body.logprobs)
        salt = body.cache_salt or request.headers.get("x-cache-salt")
        streams = await self._prepare(model, prompt_ids, body, body.max_tokens,
                                      COMPLETIONS_DEFAULT_MAX_TOKENS, salt, "cmpl", prompt_k)
        render = _CompletionRender(body, TokenText(model.tokenizer), prompt_texts)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _ClosingStreamingResponse(
                self._stream_completion(streams, rid, created, name, include_usage, render),
                streams)
        finals = await _until_disconnect(request, asyncio.ensure_future(_finals(streams)))
        if finals is None:
            return Response(status_code=499)
        choices = []
        for i, out in enumerate(finals):
            _check_output(out)
            for c in sorted(out.outputs, key=lambda c: c.index):
                piece = render.piece(i, out, c, _ChoiceState(), delta=False)
                choices.append({**piece, "finish_reason": _finish_reason(c) or "stop"})
        result = CompletionOut.model_validate({
            "id": rid, "object": "text_completion", "created": created, "model": name,
            "choices": choices, "usage": _total_usage(finals).model_dump(exclude_unset=True)})
        return JSONResponse(result.model_dump(mode="json", exclude_unset=True))

    async def _stream_completion(self, streams: list[RequestStream], rid: str, created: int,
                                 model: str, include_usage: bool, render: _CompletionRender
                                 ) -> AsyncIterator[str]:
        finals: dict[int, RequestOutput] = {}
        states: dict[int, _ChoiceState] = {}
        want_logprobs = render.body.logprobs is not None
        try:
            async for i, out in _merge(streams):
                _check_output(out)
                if out.finished:
                    finals[i] = out
                for c in out.outputs:
                    index = i * render.body.n + c.index
                    state = states.setdefault(index, _ChoiceState())
                    if state.done:
                        continue
                    reason = _finish_reason(c)
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
                    yield _sse(chunk)
            if include_usage:
                usage = _total_usage([finals[i] for i in sorted(finals)])
                yield _sse({"id": rid, "object": "text_completion", "created": created,
                            "model": model, "choices": [],
                            "usage": usage.model_dump(exclude_unset=True)})
        except APIError as exc:
            yield _sse(error_body(exc.message, exc.type, exc.param, exc.code))
        except EngineDeadError as exc:
            yield _sse(error_body(str(exc), "server_error"))
        yield "data: [DONE]\n\n"

    async def chat_completions(self, request: Request) -> Response:
        """Chat completions: ``n`` choices, ``logprobs``/``top_logprobs`` in OpenAI's chat shape,
        ``max_completion_tokens`` (see :class:`ChatBody`)."""
        body: ChatBody = await _parse(request, ChatBody)
        model = self._model(body.model)
        name = body.model or model.name
        conversation = _chat_text(body.messages)
        tok = model.tokenizer
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /completions",
                           param="messages")
        if body.continue_final_message and body.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both "
                           "be true", param="continue_final_message")
        try:
            text = tok.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message)
        except Exception as exc:  # template errors are the request's fault (bad roles, ...)
            raise APIError(400, f"the chat template rejected the messages: {exc}",
                           param="messages") from None
        prompt_ids = list(tok.encode(text, add_special_tokens=False))
        if not prompt_ids:
            raise APIError(400, "the messages render to an empty prompt", param="messages")
        salt = body.cache_salt or request.headers.get("x-cache-salt")
        streams = await self._prepare(model, [prompt_ids], body, body.output_budget, None,
                                      salt, "chatcmpl")
        token_text = TokenText(tok)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _ClosingStreamingResponse(
                self._stream_chat(streams[0], rid, created, name, include_usage, body,
                                  token_text), streams)
        finals = await _until_disconnect(request, asyncio.ensure_future(_finals(streams)))
        if finals is None:
            return Response(status_code=499)
        out = finals[0]
        _check_output(out)
        k = body.top_logprobs_k()
        choices = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            logprobs = None
            if k is not None:
                ids, entries = _new_entries(c, delta=False)
                logprobs = {"content": chat_logprobs(ids, entries, k, token_text)}
            choices.append(ChatChoice(
                index=c.index, finish_reason=_finish_reason(c) or "stop", logprobs=logprobs,
                message=ChatCompletionMessage(role="assistant", content=c.text)))
        extra = ({"prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)}
                 if body.prompt_logprobs is not None else {})
        result = ChatCompletionOut(id=rid, object="chat.completion", created=created,
                                   model=name, choices=choices, usage=_total_usage(finals),
                                   **extra)
        return JSONResponse(result.model_dump(mode="json", exclude_unset=True))

    async def _stream_chat(self, stream: RequestStream, rid: str, created: int, model: str,
                           include_usage: bool, body: ChatBody, token_text: TokenText
                           ) -> AsyncIterator[str]:
        k = body.top_logprobs_k()

        def chunk(index: int | None, delta: ChoiceDelta | None = None, reason: str | None = None,
                  logprobs: list[dict[str, Any]] | None = None, **extra: Any
                  ) -> ChatCompletionChunk:
            choices = [] if index is None else [ChunkChoice(
                index=index, delta=delta or ChoiceDelta(), finish_reason=reason,
                logprobs=None if logprobs is None else {"content": logprobs})]
            return ChatCompletionChunk(id=rid, object="chat.completion.chunk", created=created,
                                       model=model, choices=choices, **extra)

        final: RequestOutput | None = None
        done: set[int] = set()
        # vLLM's prompt_logprobs ride on the first chunk with generated content.
        prompt_pending = body.prompt_logprobs is not None
        try:
            for index in range(body.n):
                yield _sse(chunk(index, ChoiceDelta(role="assistant", content="")))
            async for out in stream:
                _check_output(out)
                if out.finished:
                    final = out
                for c in out.outputs:
                    if c.index in done:
                        continue
                    reason = _finish_reason(c)
                    logprobs = None
                    if k is not None:
                        ids, entries = _new_entries(c, delta=True)
                        logprobs = chat_logprobs(ids, entries, k, token_text)
                    if not c.delta_text and reason is None and not logprobs:
                        continue
                    if reason is not None:
                        done.add(c.index)
                    extra = {}
                    if prompt_pending:
                        extra["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
                        prompt_pending = False
                    yield _sse(chunk(c.index, ChoiceDelta(content=c.delta_text), reason,
                                     logprobs, **extra))
            if include_usage and final is not None:
                last = chunk(None)
                last.usage = _total_usage([final])
                yield _sse(last)
        except APIError as exc:
            yield _sse(error_body(exc.message, exc.type, exc.param, exc.code))
        except EngineDeadError as exc:
            yield _sse(error_body(str(exc), "server_error"))
        finally:
            stream.close()
        yield "data: [DONE]\n\n"


class _CompletionRender:
    """Builds one completions choice (whole, or one streamed chunk's worth) from an output."""

    def __init__(self, body: CompletionBody, text: TokenText,
                 prompt_texts: list[str] | None) -> None:
        self.body = body
        self.text = text
        self.prompt_texts = prompt_texts

    @property
    def echo(self) -> bool:
        return self.prompt_texts is not None

    def piece(self, prompt_index: int, out: RequestOutput, c: CompletionOutput,
              state: _ChoiceState, delta: bool) -> dict[str, Any]:
        body = self.body
        first = not state.started
        state.started = True
        echo_now = self.prompt_texts is not None and first
        prefix = self.prompt_texts[prompt_index] if self.prompt_texts is not None and first else ""
        text = prefix + (c.delta_text if delta else c.text)
        choice: dict[str, Any] = {"index": prompt_index * body.n + c.index, "text": text,
                                  "logprobs": None}
        if body.logprobs is not None:
            parts = []
            if echo_now:
                entries = list(out.prompt_logprobs or [])
                entries += [None] * (len(out.prompt_token_ids) - len(entries))
                part, _ = completion_logprobs(out.prompt_token_ids, entries, body.logprobs,
                                              self.text, 0)
                parts.append(part)
                state.offset = len(prefix)
            ids, entries = _new_entries(c, delta)
            part, state.offset = completion_logprobs(ids, entries, body.logprobs, self.text,
                                                     state.offset)
            parts.append(part)
            choice["logprobs"] = {key: [v for p in parts for v in p[key]] for key in parts[0]}
        if body.prompt_logprobs is not None and first:
            choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
        return choice


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _total_usage(finals: list[RequestOutput]) -> CompletionUsage:
    """Prompt tokens once per prompt, completion tokens of every sample (as vLLM counts)."""
    return _usage(sum(len(o.prompt_token_ids) for o in finals),
                  sum(len(c.token_ids) for o in finals for c in o.outputs),
                  sum(o.num_cached_tokens for o in finals))


async def _finals(streams: list[RequestStream]) -> list[RequestOutput]:
    """Run the streams to their final outputs; abort all of them if cancelled."""
    async def last(stream: RequestStream) -> RequestOutput:
        final = None
        async for out in stream:
            final = out
        if final is None:
            raise APIError(500, "the request was aborted")
        return final

    try:
        return list(await asyncio.gather(*(last(s) for s in streams)))
    finally:
        for s in streams:
            s.close()


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (index, output), in arrival order."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, None))
        except Exception as exc:
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


def _wrap(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
    """Map every failure to OpenAI's error shape (KServe's handlers would answer its own)."""
    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as exc:
            return exc.response()
        except (ModelNotReady, EngineDeadError) as exc:
            return APIError(503, str(exc), type_="service_unavailable_error").response()
        except InferenceError as exc:
            return APIError(500, str(exc)).response()
        except Exception as exc:
            logger.exception("OpenAI route failed")
            return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()
    route.__name__ = getattr(handler, "__name__", "route")
    return route


def _inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema with its ``$defs`` inlined: an OpenAPI operation cannot carry
    ``$defs`` of its own (its ``$ref``s resolve against the whole document)."""
    defs = schema.get("$defs", {})

    def resolve(node: Any, seen: tuple[str, ...] = ()) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                name = ref.rsplit("/", 1)[-1]
                if name in seen:  # recursive types: leave them open
                    return {}
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return {**resolve(defs[name], (*seen, name)), **resolve(rest, seen)}
            return {k: resolve(v, seen) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [resolve(v, seen) for v in node]
        return node

    return resolve(schema)


_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "integer", "null"]}}}},
}


# One server-sent event (``data: {json chunk}`` or ``data: [DONE]``), as SSE parsers see it.
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
MAX_N = 128  # SamplingParams' limits, published
MAX_LOGPROBS = 20
# What the handlers accept beyond the field types, published so that clients (and fuzzers) see
# the real contract: value ranges, and options that only take their default (no tools, no
# suffix, text responses only; other values are 400s). Validation itself stays in the handlers, which
# answer in OpenAI's error shape.
_PUBLISHED: dict[str, dict[str, Any]] = {
    "max_tokens": {"minimum": 1}, "max_completion_tokens": {"minimum": 1},
    "temperature": {"minimum": 0}, "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1}, "min_p": {"minimum": 0, "maximum": 1},
    "min_tokens": {"minimum": 0},
    "stop": {"anyOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}},
                       {"type": "null"}]},
    "stop_token_ids": {"anyOf": [{"type": "array", "items": {"type": "integer", "minimum": 0}},
                                 {"type": "null"}]},
    "n": {"minimum": 1, "maximum": MAX_N}, "best_of": {"minimum": 1, "maximum": MAX_N},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0, "maximum": 100},
    "logit_bias": {"anyOf": [{"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                              "additionalProperties": {"type": "number", "minimum": -100,
                                                       "maximum": 100}},
                             {"type": "null"}]},
    "prompt_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "top_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "response_format": {"anyOf": [{"type": "object", "properties": {"type": {"const": "text"}}},
                                  {"type": "null"}]},
    "suffix": {"anyOf": [{"const": ""}, {"type": "null"}]},
    "tools": {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]},
    "functions": {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]},
    "tool_choice": {"anyOf": [{"const": "none"}, {"type": "null"}]},
    "function_call": {"anyOf": [{"const": "none"}, {"type": "null"}]},
    "messages": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role"],
        "properties": {"role": {"type": "string"},
                       "content": {"anyOf": [{"type": "string"},
                                             {"type": "array", "items": _TEXT_PART},
                                             {"type": "null"}]}}}},
}
_PUBLISHED_BY_BODY: dict[str, dict[str, dict[str, Any]]] = {
    "CompletionBody": {
        "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "minItems": 1,
                              "items": {"type": "string", "minLength": 1}},
                             _TOKEN_IDS, {"type": "array", "minItems": 1, "items": _TOKEN_IDS}]},
        "logprobs": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
                               {"type": "null"}]},
    },
}


def _request_schema(body: type[BaseModel], model_names: list[str]) -> dict[str, Any]:
    schema = _inline_refs(body.model_json_schema())
    props = schema["properties"]
    published = {**_PUBLISHED, **_PUBLISHED_BY_BODY.get(body.__name__, {})}
    if model_names:
        published["model"] = {"anyOf": [{"enum": model_names}, {"type": "null"}]}
    for name, extra in published.items():
        if name in props:
            field = props[name]
            if "anyOf" in extra or "type" in extra or "const" in extra:
                field = {k: v for k, v in field.items() if k in ("title", "default")}
            elif "anyOf" in field:  # constrain the non-null branch of an optional field
                field = {**field, "anyOf": [b if b.get("type") == "null" else {**b, **extra}
                                            for b in field["anyOf"]]}
                extra = {}
            props[name] = {**field, **extra}
    return schema


def _openapi(body: type[BaseModel], result: type[BaseModel], model_names: list[str]
             ) -> dict[str, Any]:
    """What the route publishes in /openapi.json. The handlers parse the body themselves (to
    answer in OpenAI's error shape, not FastAPI's 422), so FastAPI cannot derive this."""
    error = {"content": {"application/json": {"schema": _ERROR_SCHEMA}}}
    return {
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": _request_schema(body, model_names)}}},
        "responses": {
            "200": {"description": "The result, or with stream=true server-sent events",
                    "content": {"application/json": {
                                    "schema": _inline_refs(result.model_json_schema(
                                        mode="serialization"))},
                                "text/event-stream": {"schema": _SSE_EVENT}}},
            "400": {"description": "Invalid or unsupported request", **error},
            "404": {"description": "Unknown model", **error},
            "500": {"description": "Generation failed", **error},
            "503": {"description": "Not ready: loading, failed or shutting down", **error},
        },
    }


def register_openai_routes(app: FastAPI, models: dict[str, PagedLLMModel],
                           prefixes: tuple[str, ...] = (PREFIX,)) -> OpenAIRoutes:
    """Add ``models``, ``completions`` and ``chat/completions`` under each prefix."""
    routes = OpenAIRoutes(models)
    for prefix in prefixes:
        router = APIRouter(prefix=prefix, tags=["OpenAI"])
        router.add_api_route("/models", routes.list_models, methods=["GET"])
        router.add_api_route("/completions", _wrap(routes.completions), methods=["POST"],
                             response_model=None,
                             openapi_extra=_openapi(CompletionBody, CompletionOut,
                                                   list(models)))
        router.add_api_route("/chat/completions", _wrap(routes.chat_completions),
                             methods=["POST"], response_model=None,
                             openapi_extra=_openapi(ChatBody, ChatCompletionOut,
                                                   list(models)))
        app.include_router(router)
    return routes


__all__ = ["APIError", "OpenAIRoutes", "register_openai_routes", "PREFIX"]
