"""The OpenAI routes' handlers: models, completions, chat completions.

Sampling options follow vLLM's OpenAI server: n, penalties, logit_bias, seed, logprobs (legacy
object on completions, ``content`` list on chat), echo, prompt_logprobs,
include_stop_str_in_output, skip_special_tokens. Options the engine cannot honour are refused
(see schemas.py). Prompts are checked for length before they are tokenized, and tokenized off
the event loop (PagedLLMModel.encode).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from kserve.errors import InferenceError, ModelNotReady
from openai.types import Model as OpenAIModel
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta

from engine.async_llm import EngineDeadError, RequestStream
from engine.outputs import RequestOutput
from kserve_paged.logprobs import TokenText, chat_logprobs, prompt_logprobs_json
from kserve_paged.lora import AdapterView
from kserve_paged.model import PagedLLMModel
from kserve_paged.openai.errors import APIError, error_body
from kserve_paged.openai.openapi import operation_schema
from kserve_paged.openai.parse import (
    chat_conversation,
    conversation_chars,
    parse_body,
    split_prompts,
)
from kserve_paged.openai.render import (
    ChoiceState,
    CompletionRender,
    check_output,
    finish_reason,
    new_entries,
    total_usage,
)
from kserve_paged.openai.schemas import (
    ChatBody,
    ChatCompletionOut,
    CompletionBody,
    CompletionOut,
    SamplingBody,
)
from kserve_paged.openai.stream import (
    DONE_EVENT,
    ClosingStreamingResponse,
    final_outputs,
    merge,
    sse,
    until_disconnect,
)
from kserve_paged.openai.tools import (
    StreamedCalls,
    ToolPlan,
    template_messages,
    tool_plan,
    with_calls,
)
from kserve_paged.sampling import OptionError
from kserve_paged.structured import structured_outputs_given

logger = logging.getLogger("kserve.paged.openai")

PREFIX = "/openai/v1"
VLLM_PREFIX = "/v1"  # completions and chat only (see register_openai_routes)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /completions


class OpenAIRoutes:
    """The handlers, bound to the served models (by name)."""

    def __init__(self, models: dict[str, PagedLLMModel]) -> None:
        self.models = models

    def _model(self, name: str | None) -> PagedLLMModel | AdapterView:
        if name is None:
            if len(self.models) != 1:
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
            lora = getattr(model, "loras", {}).get(name)
            if lora is not None:
                return AdapterView(model, lora)
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
            data.extend({"id": lora.lora_name, "object": "model", "created": int(model.created),
                         "owned_by": "kserve-paged", "root": lora.lora_path, "parent": name,
                         "max_model_len": info.max_model_len if info else None,
                         "ready": model.accepting} for lora in getattr(model, "loras", {}).values())
        return {"object": "list", "data": data}

    async def _prepare(self, model: PagedLLMModel, prompt_ids: list[list[int]],
                       body: SamplingBody, max_tokens: int | None, default_max: int | None,
                       cache_salt: str | None, kind: str, prompt_logprobs: int | None = None,
                       constraint: dict[str, Any] | None = None) -> list[RequestStream]:
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
        body: CompletionBody = await parse_body(request, CompletionBody)
        model = self._model(body.model)
        name = body.model or model.name
        prompts = split_prompts(body.prompt)
        tokenizer = model.info.tokenizer
        try:
            for p in prompts:  # every prompt's length before any is tokenized
                if isinstance(p, str):
                    model.check_prompt_chars(len(p))
            prompt_ids = [await model.encode(p) for p in prompts]
        except OptionError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        prompt_texts = ([p if isinstance(p, str) else tokenizer.decode(ids)
                         for p, ids in zip(prompts, prompt_ids)] if body.echo else None)
        # Echoed logprobs need the prompt's: ask the engine for as many as for the output.
        prompt_k = body.prompt_logprobs
        if body.echo and body.logprobs is not None:
            prompt_k = max(prompt_k or 0, body.logprobs)
        salt = body.cache_salt or request.headers.get("x-cache-salt")
        streams = await self._prepare(model, prompt_ids, body, body.max_tokens,
                                      COMPLETIONS_DEFAULT_MAX_TOKENS, salt, "cmpl", prompt_k)
        render = CompletionRender(body, TokenText(tokenizer), prompt_texts)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return ClosingStreamingResponse(
                self._stream_completion(streams, rid, created, name, include_usage, render),
                streams)
        finals = await until_disconnect(request, asyncio.ensure_future(final_outputs(streams)))
        if finals is None:
            return Response(status_code=499)
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

    async def _stream_completion(self, streams: list[RequestStream], rid: str, created: int,
                                 model: str, include_usage: bool, render: CompletionRender
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

    async def chat_completions(self, request: Request) -> Response:
        """Chat completions: ``n`` choices, ``logprobs``/``top_logprobs`` in OpenAI's chat shape,
        ``max_completion_tokens`` (see :class:`ChatBody`)."""
        body: ChatBody = await parse_body(request, ChatBody)
        model = self._model(body.model)
        name = body.model or model.name
        conversation = template_messages(chat_conversation(body.messages))
        plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls,
                         model.tool_call_parser)
        info = model.info
        tok = info.tokenizer
        if not info.has_chat_template:
            raise APIError(400, "this model has no chat template; use /completions",
                           param="messages")
        if body.continue_final_message and body.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both "
                           "be true", param="continue_final_message")
        try:  # the length of the messages before the template and the tokenizer see them
            model.check_prompt_chars(conversation_chars(conversation), "messages")
        except OptionError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        try:
            text = await asyncio.to_thread(
                tok.apply_chat_template, conversation, tokenize=False,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                tools=plan.template_tools if plan else None)
        except Exception as exc:  # template errors are the request's fault (bad roles, ...)
            raise APIError(400, f"the chat template rejected the messages: {exc}",
                           param="messages") from None
        try:
            prompt_ids = await model.encode(text, add_special_tokens=False)
        except OptionError as exc:
            raise APIError(400, f"the messages render to an unusable prompt: {exc}",
                           param="messages") from None
        salt = body.cache_salt or request.headers.get("x-cache-salt")
        streams = await self._prepare(model, [prompt_ids], body, body.output_budget, None,
                                      salt, "chatcmpl",
                                      constraint=plan.constraint() if plan else None)
        token_text = TokenText(tok)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return ClosingStreamingResponse(
                self._stream_chat(streams[0], rid, created, name, include_usage, body,
                                  token_text, plan), streams)
        finals = await until_disconnect(request, asyncio.ensure_future(final_outputs(streams)))
        if finals is None:
            return Response(status_code=499)
        out = finals[0]
        check_output(out)
        k = body.top_logprobs_k()
        choices = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            logprobs = None
            if k is not None:
                ids, entries = new_entries(c, delta=False)
                logprobs = {"content": chat_logprobs(ids, entries, k, token_text)}
            content, calls = plan.parse(c.text) if plan else (c.text, [])
            reason = finish_reason(c) or "stop"
            choices.append(ChatChoice(
                index=c.index, finish_reason=with_calls(reason, calls), logprobs=logprobs,
                message=ChatCompletionMessage(
                    role="assistant", content=content,
                    **({"tool_calls": [call.to_openai() for call in calls]} if calls else {}))))
        extra = ({"prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)}
                 if body.prompt_logprobs is not None else {})
        result = ChatCompletionOut(id=rid, object="chat.completion", created=created,
                                   model=name, choices=choices, usage=total_usage(finals),
                                   **extra)
        return JSONResponse(result.model_dump(mode="json", exclude_unset=True))

    async def _stream_chat(self, stream: RequestStream, rid: str, created: int, model: str,
                           include_usage: bool, body: ChatBody, token_text: TokenText,
                           plan: ToolPlan | None = None) -> AsyncIterator[str]:
        k = body.top_logprobs_k()
        calls_out = {index: StreamedCalls(plan) for index in range(body.n)} if plan else {}

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
                yield sse(chunk(index, ChoiceDelta(role="assistant", content="")))
            async for out in stream:
                check_output(out)
                if out.finished:
                    final = out
                for c in out.outputs:
                    if c.index in done:
                        continue
                    reason = finish_reason(c)
                    logprobs = None
                    if k is not None:
                        ids, entries = new_entries(c, delta=True)
                        logprobs = chat_logprobs(ids, entries, k, token_text)
                    if not c.delta_text and reason is None and not logprobs:
                        continue
                    if reason is not None:
                        done.add(c.index)
                    extra = {}
                    if prompt_pending:
                        extra["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
                        prompt_pending = False
                    if plan is None:
                        yield sse(chunk(c.index, ChoiceDelta(content=c.delta_text), reason,
                                         logprobs, **extra))
                        continue
                    calls = calls_out[c.index]
                    deltas = calls.feed(c.text, finished=reason is not None)
                    if reason is not None:
                        reason = with_calls(reason, calls.calls)
                    if not deltas:
                        deltas = [ChoiceDelta()]
                    for j, delta in enumerate(deltas):
                        last = j == len(deltas) - 1
                        yield sse(chunk(c.index, delta, reason if last else None,
                                         logprobs if last else None, **(extra if j == 0 else {})))
            if include_usage and final is not None:
                last = chunk(None)
                last.usage = total_usage([final])
                yield sse(last)
        except APIError as exc:
            yield sse(error_body(exc.message, exc.type, exc.param, exc.code))
        except EngineDeadError as exc:
            yield sse(error_body(str(exc), "server_error"))
        finally:
            stream.close()
        yield DONE_EVENT


def _in_openai_shape(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
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


def register_openai_routes(app: FastAPI, models: dict[str, PagedLLMModel],
                           prefixes: tuple[str, ...] = (PREFIX,),
                           aliases: tuple[str, ...] = (VLLM_PREFIX,)) -> OpenAIRoutes:
    """Add ``models``, ``completions`` and ``chat/completions`` under each prefix, and the
    last two under each alias (vLLM's paths, where an LLMInferenceService's route sends them;
    ``/v1/models`` stays KServe's v1 protocol route)."""
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
        app.include_router(router)
    return routes
