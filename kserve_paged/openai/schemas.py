"""Request and response bodies of the OpenAI routes, the refusal rules of each field, and how a
request's JSON becomes one (malformed JSON, a bad field or an unsupported option is a 400 in
OpenAI's shape, before any work is queued).

A request option that would change results but that the engine cannot honour is refused by
``unsupported()`` with a 400 naming it, never ignored. Response bodies are the ``openai``
package's types, widened where vLLM-style answers carry more."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar, Union

from fastapi import Request
from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletion
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictInt,
    Tag,
    ValidationError,
    create_model,
)

from kserve_paged import body_decode
from kserve_paged.openai.errors import APIError
from kserve_paged.request_options import OPTIONS, SamplingRequest, unsupported_options

# -- request bodies ---------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False


# The sampling options' fields, declared from the one table of them (request_options.OPTIONS).
_SamplingFields = create_model(
    "_SamplingFields", __config__=ConfigDict(extra="allow"),
    **{name: (option.body_type, option.body_default) for name, option in OPTIONS.items()
       if option.body_type is not None})


class SamplingBody(_SamplingFields):
    """Fields common to both endpoints: the sampling options of ``OPTIONS`` and these.
    Unknown fields are accepted and ignored (clients send vendor extras); the known ones that
    would change results are checked in ``unsupported``."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    cache_salt: str | None = None
    priority: int = 0
    timeout: float | None = None  # ours: seconds to the deadline (kserve_paged/admission.py)

    @property
    def output_budget(self) -> int | None:
        """The client's max_tokens (chat: or max_completion_tokens)."""
        return self.max_tokens

    def sampling_request(self, vocab_size: int | None,
                         default_max_tokens: int | None = None) -> SamplingRequest:
        """The body's options, coerced and checked (OptionError naming one): the table's
        fields, the structured-output spellings (vLLM's are extras), and the endpoint's own
        ``max_tokens`` and ``logprobs``."""
        wire = {**(self.model_extra or {}), **{name: getattr(self, name, None) for name in OPTIONS}}
        wire.update(max_tokens=self.output_budget, logprobs=self.top_logprobs_k(),
                    response_format=self.response_format)
        return SamplingRequest.of(wire, vocab_size=vocab_size,
                                  default_max_tokens=default_max_tokens)

    def top_logprobs_k(self) -> int | None:
        """Top log-probabilities per generated token, or None when none are asked for."""
        return None

    def unsupported(self) -> list[tuple[str, str]]:
        found = []
        if self.stream_options is not None and not self.stream:
            found.append(("stream_options", "stream_options is only allowed with stream=true"))
        for name in unsupported_options({**(self.model_extra or {}), "n": self.n}):
            found.append((name, f"{name} is not supported by this server"))
        if self.use_beam_search and self.stream:
            found.append(("stream", "stream=true is not supported with use_beam_search: beam "
                          "search results are final only"))
        if not self.use_beam_search:
            if self.best_of is not None and self.best_of != self.n:
                found.append(("best_of", f"best_of={self.best_of} needs use_beam_search: "
                              f"every sample is returned, so without beam search best_of must "
                              f"be unset or equal n ({self.n})"))
            for name in ("length_penalty", "early_stopping"):
                if getattr(self, name) is not None:
                    found.append((name, f"{name} needs use_beam_search"))
        return found


class CompletionBody(SamplingBody):
    # true is no token id. Left to right, token ids first: pydantic's smart mode tries every
    # member on the whole list, which for a long id prompt costs seconds of the event loop.
    prompt: Annotated[str | list[StrictInt] | list[str] | list[list[StrictInt]],
                      Field(union_mode="left_to_right")]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def top_logprobs_k(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> list[tuple[str, str]]:
        found = super().unsupported()
        if self.suffix:
            found.append(("suffix", "suffix is not supported (no fill-in-the-middle)"))
        return found


# Chat extras of vLLM and OpenAI that change what is generated, beyond the shared table; any
# value but the harmless one is a 400 (on /tokenize too: it renders as chat does).
CHAT_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (False,), "chat_template": (), "documents": (),
    "audio": (), "prediction": (), "web_search_options": (),
}


class ChatBody(SamplingBody):
    """``max_completion_tokens`` is OpenAI's newer name for ``max_tokens``; a request giving
    both with different values is refused (400 naming max_completion_tokens) rather than one
    of them silently winning."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # over --default_chat_template_kwargs
    # vLLM's: the chat template's reasoning_effort (Harmony's "Reasoning:" line); a request's
    # chat_template_kwargs may still say otherwise.
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    def top_logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def output_budget(self) -> int | None:
        return (self.max_completion_tokens if self.max_completion_tokens is not None
                else self.max_tokens)

    def unsupported(self) -> list[tuple[str, str]]:
        found = super().unsupported()
        extra = self.model_extra or {}
        for name in unsupported_options(extra, CHAT_UNSUPPORTED, check_best_of=False):
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
        if self.functions:
            found.append(("functions", "functions (OpenAI's deprecated form) are not supported: "
                          "use tools"))
        if self.function_call not in (None, "none"):
            found.append(("function_call", "function_call is not supported"))
        return found



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


# -- reading a body -----------------------------------------------------------------------------

logger = logging.getLogger("kserve.paged.openai")
Body = TypeVar("Body", bound=SamplingBody)
Model = TypeVar("Model", bound=BaseModel)
# Bodies above this are decoded in the body decoder's child process (body_decode.py): parsing
# megabytes of JSON in this process would hold the GIL, stalling the engine and every request.
DECODE_OFF_PROCESS_BYTES = 256 << 10


async def read_json(request: Request) -> dict[str, Any]:
    """The request's body as a JSON object; malformed JSON (or a body that ends the decoder's
    child) is a 400, a body not parsed within its bound a 413 (body_decode.py)."""
    try:
        raw = await request.body()
        data = (await asyncio.get_running_loop().run_in_executor(
                    body_decode.EXECUTOR, body_decode.DECODER.decode, raw)
                if len(raw) > DECODE_OFF_PROCESS_BYTES else body_decode.decode_in_place(raw))
    except body_decode.BodyTooDeep:
        raise APIError(400, "the request body is nested too deeply") from None
    except body_decode.BodySurrogate:
        raise APIError(400, "the request body holds invalid Unicode (a lone surrogate)") from None
    except body_decode.BodyTooCostly as exc:  # the parse outlasted its bound
        raise APIError(413, str(exc)) from None
    except body_decode.BodyCrashedDecoder as exc:
        raise APIError(400, str(exc)) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    return data


def by_type(members: dict[str, type[BaseModel]], other: type[BaseModel] | None = None,
            missing: str | None = None, what: str = "an object", mode: Any = None) -> Any:
    """A union of request objects told apart by their ``"type"``, as the SDKs' types are:
    each type in ``members`` validates as its model, any other type as ``other`` (which the
    converter refuses by name) and an object without one as ``missing``'s model; a string
    validates as ``mode`` (a Literal of the names an SDK also takes, as tool_choice's "auto")
    where there is one; anything else is a 400 saying what it must be (``what``). An error's
    path names the type, as ``input[0].function_call.arguments``."""
    def tag(value: Any) -> str | None:
        if isinstance(value, BaseModel):  # a model built in code: its own type
            value = {"type": getattr(value, "type", None)}
        if isinstance(value, str) and mode is not None:
            return "mode"
        if not isinstance(value, dict):
            return None
        kind = value.get("type", missing)
        if isinstance(kind, str) and kind in members:
            return kind
        return "other" if other is not None else None
    choices: list[Any] = [Annotated[cls, Tag(name)] for name, cls in members.items()]
    if other is not None:
        choices.append(Annotated[other, Tag("other")])
    if mode is not None:
        choices.append(Annotated[mode, Tag("mode")])
    types = ", ".join(members)
    return Annotated[Union[tuple(choices)],  # noqa: UP007 (built from a list)
                     Discriminator(tag, custom_error_type="invalid_type",
                                   custom_error_message=f"must be {what} whose type is one "
                                   f"of {types}")]


def _where(loc: tuple[int | str, ...]) -> str:
    """A validation error's place as a path, ``messages[0].content[1].text``; the labels of
    plain union members (``list[str]``, ``function-after[...]``) left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" not in part:
            out += f".{part}" if out else part
    return out


def validate(cls: type[Model], data: dict[str, Any]) -> Model:
    """`data` as `cls`: a bad field, or an option `cls.unsupported()` names, is a 400 whose
    message names the field's place in the body."""
    try:
        body = cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err.get("loc", ()))
        param = ".".join(str(p) for p in loc if not isinstance(p, int)) or None
        if param and "[" in param:
            param = param.split("[")[0]
        where = _where(loc)
        raise APIError(400, f"invalid request: {where}: {err.get('msg')}" if where
                       else f"invalid request: {err.get('msg')}", param=param) from None
    for param, message in getattr(body, "unsupported", list)():
        raise APIError(400, message, param=param, code="unsupported_parameter")
    return body


async def parse_body(request: Request, cls: type[Body],
                     precheck: Callable[[dict[str, Any]], None] | None = None) -> Body:
    """The request's body as ``cls``; malformed JSON, bad fields and unsupported options are
    400s naming the field. ``precheck`` sees the decoded JSON before validation reads it (a
    size a cap refuses, refused before pydantic walks it)."""
    data = await read_json(request)
    if precheck is not None:
        precheck(data)
    body = validate(cls, data)
    if body.model_extra:
        # vLLM's behaviour, which OpenAI clients rely on (they send vendor extras): ignore
        # unknown fields, but leave a trace for the operator.
        logger.warning("ignoring unknown field(s) %s in %s", sorted(body.model_extra),
                       request.url.path)
    return body
