"""KServe's v1/v2 protocol for text generation, and v2 parameters as gRPC carries them.

v2: ``text_input`` BYTES [N] -> ``text_output`` BYTES [N], sampling options in the request's
``parameters`` (REST, or gRPC with the wire decoding of :func:`v2_parameters`). v1:
``{"instances": [str, ...], "parameters": {...}}`` -> ``{"predictions": [str, ...]}``. Every
prompt of a request is validated before any is queued; errors are KServe's (400 InvalidInput,
503 ModelNotReady, 500 InferenceError).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from kserve.errors import InferenceError, InvalidInput, ModelNotReady
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse

from kserve_paged.admission import RequestRefused, parse_timeout_us, tighten
from kserve_paged.logprobs import TokenText, v2_logprobs
from kserve_paged.request_caps import check_prompt_count
from kserve_paged.request_options import (
    SAMPLING_OPTIONS,
    UNSUPPORTED_OPTIONS,
    OptionError,
    SamplingRequest,
    as_int,
    unsupported_options,
)
from kserve_paged.served import ServedModel, submit_all
from kserve_paged.structured import STRUCTURED_OPTION_NAMES
from kserve_paged.v2_pooling import predict_pooled
from kserve_paged_engine.frontend.async_llm import EngineDeadError, RequestStream
from kserve_paged_engine.outputs import RequestOutput

logger = logging.getLogger("kserve.paged")

INPUT_NAME = "text_input"
OUTPUT_NAME = "text_output"
LOGPROBS_NAME = "logprobs"  # only when the parameters ask for logprobs
PROMPT_LOGPROBS_NAME = "prompt_logprobs"  # only when they ask for prompt_logprobs
# v2 request parameters that tritonclient or KServe set for transport, not sampling.
_TRANSPORT_PARAMETERS = frozenset({"binary_data_output", "binary_data_size", "content_type",
                                   "headers", "sequence_id", "sequence_start", "sequence_end"})
TIMEOUT_PARAMETER = "timeout"  # the request's deadline, in microseconds (admission.py)
V2_DEFAULT_MAX_TOKENS = 16  # SamplingParams' default, so v2 and LLM.generate agree
# Known to v2 only as refusals: OpenAI bodies declare and check these themselves.
V2_UNSUPPORTED_OPTIONS: dict[str, tuple[Any, ...]] = {
    **{k: v for k, v in UNSUPPORTED_OPTIONS.items() if k != "beam_width"}, "echo": (False,),
    "suffix": (), "tools": (), "top_logprobs": (0,),
}


def input_types() -> list[dict[str, Any]]:
    """A text model's v2 inputs, as KServe's metadata route lists them."""
    return [{"name": INPUT_NAME, "datatype": "BYTES", "shape": [-1]}]


def output_types() -> list[dict[str, Any]]:
    return [{"name": OUTPUT_NAME, "datatype": "BYTES", "shape": [-1]}]


async def predict(model: ServedModel, payload: InferRequest | dict[str, Any],
                  deadline: float | None = None) -> InferResponse | dict[str, Any]:
    """v2: ``text_input`` BYTES [N] -> ``text_output`` BYTES [N], sampling options in the
    request's ``parameters``. v1: ``{"instances": [str, ...], "parameters": {...}}`` ->
    ``{"predictions": [str, ...]}``.

    With ``n`` > 1, ``text_output`` is [N, n] (row i: prompt i's samples in order) and v1's
    predictions are lists. With ``logprobs`` (k), an output ``logprobs`` of text_output's
    shape holds per sample a JSON string: a list, per generated token, of ``{token_id,
    token, logprob, rank, top_logprobs: [{token_id, token, logprob, rank}, ...]}`` (the top
    k). With ``prompt_logprobs``, an output ``prompt_logprobs`` [N] holds per prompt such a
    list (null for the first token). v1 answers carry them as decoded JSON. ``deadline``:
    the request's (time.monotonic(), admission.py), before ``parameters.timeout``."""
    if isinstance(payload, dict):
        return await _predict_v1(model, payload, deadline)
    if not isinstance(payload, InferRequest):
        raise InvalidInput(f"unsupported request type {type(payload).__name__}")
    inputs = {i.name: i for i in payload.inputs}
    extra = sorted(set(inputs) - {INPUT_NAME})
    if extra:
        raise InvalidInput(f"unexpected input(s) {extra}: this model takes only "
                           f"'{INPUT_NAME}' (BYTES, shape [N])")
    tensor = inputs.get(INPUT_NAME)
    if tensor is None:
        raise InvalidInput(f"input '{INPUT_NAME}' (BYTES, shape [N]) is required")
    if tensor.datatype != "BYTES":
        raise InvalidInput(f"input '{INPUT_NAME}' must be BYTES (got {tensor.datatype})")
    texts = _texts(tensor)
    options = v2_parameters(payload.parameters)
    if model.info.job != "generate":  # an FP32 tensor out (kserve_paged/v2_pooling.py)
        return await predict_pooled(model, payload, texts, options, _TRANSPORT_PARAMETERS,
                                    deadline)
    result = await _complete_all(model, texts, options, deadline)
    outputs = [_bytes_output(OUTPUT_NAME, result.texts, result.n)]
    if result.logprobs is not None:
        outputs.append(_bytes_output(LOGPROBS_NAME, [
            [json.dumps(s, separators=(",", ":")) for s in row] for row in result.logprobs],
            result.n))
    if result.prompt_logprobs is not None:
        outputs.append(_bytes_output(PROMPT_LOGPROBS_NAME, [
            [json.dumps(p, separators=(",", ":"))] for p in result.prompt_logprobs], 1))
    return InferResponse(
        response_id=payload.id or str(uuid.uuid4()), model_name=model.name,
        infer_outputs=outputs, from_grpc=payload.from_grpc,
        use_binary_outputs=payload.use_binary_outputs,
        requested_outputs=payload.request_outputs)


async def _predict_v1(model: ServedModel, body: dict[str, Any], deadline: float | None
                      ) -> dict[str, Any]:
    instances = body.get("instances")
    if not isinstance(instances, list) or not all(isinstance(i, str) for i in instances):
        raise InvalidInput('expected {"instances": ["prompt", ...]} (a list of strings)')
    options = body.get("parameters") or {}
    if not isinstance(options, dict):
        raise InvalidInput('"parameters" must be an object')
    result = await _complete_all(model, instances, options, deadline)
    flat = result.n == 1
    answer: dict[str, Any] = {"predictions": [row[0] if flat else row
                                              for row in result.texts]}
    if result.logprobs is not None:
        answer["logprobs"] = [row[0] if flat else row for row in result.logprobs]
    if result.prompt_logprobs is not None:
        answer["prompt_logprobs"] = result.prompt_logprobs
    return answer


def _check_final(out: Any) -> None:
    """A failed request's error: 400 for its own input (its grammar), 408 when its deadline
    passed, 500 for a fault of the server."""
    if out.error is not None or any(c.finish_reason == "error" for c in out.outputs):
        if out.error_status == 400:
            raise InvalidInput(str(out.error))
        if out.error_status is not None:
            raise RequestRefused(out.error_status, str(out.error))
        raise InferenceError(f"generation failed: {out.error}")


def beam_width_options(options: dict[str, Any]) -> dict[str, Any]:
    """v2's ``beam_width`` k as the engine's options: beam search over k beams returning
    ``n`` of them (default 1, transformers' num_return_sequences); 1 (or absent) is off."""
    out = dict(options)
    width = out.pop("beam_width", None)
    if width is None or (isinstance(width, str) and not width.strip()):
        return out
    k = as_int("beam_width", width)
    if k != 1:
        out["use_beam_search"], out["best_of"] = True, k
    return out


def _checked_options(options: dict[str, Any], deadline: float | None
                     ) -> tuple[dict[str, Any], float | None]:
    """The request's parameters as sampling options, refused (400) when the engine cannot
    honour them, and its deadline: ``parameters.timeout``, first of all, tightens it."""
    timeout = options.get(TIMEOUT_PARAMETER)
    try:
        seconds = None if timeout is None else parse_timeout_us(timeout, "parameters.timeout")
        deadline = tighten(deadline, seconds)  # the header's and the server's may be earlier
        options = beam_width_options(options)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    refused = unsupported_options(options, V2_UNSUPPORTED_OPTIONS)
    if refused:
        raise InvalidInput(f"unsupported parameter(s) {refused}: this engine cannot honour "
                           f"them; supported: {', '.join(SAMPLING_OPTIONS)}, beam_width, "
                           "priority, cache_salt, timeout")
    unknown = sorted(k for k in options
                     if k not in SAMPLING_OPTIONS and k not in _TRANSPORT_PARAMETERS
                     and k not in V2_UNSUPPORTED_OPTIONS and k not in STRUCTURED_OPTION_NAMES
                     and k not in ("priority", "cache_salt", "best_of", TIMEOUT_PARAMETER))
    if unknown:
        # As vLLM (and the OpenAI routes here) do with unknown fields: ignore, but say so.
        logger.warning("ignoring unknown v2 parameter(s) %s", unknown)
    return options, deadline


async def _complete_all(model: ServedModel, texts: list[str], options: dict[str, Any],
                        deadline: float | None) -> _Completed:
    options, deadline = _checked_options(options, deadline)
    if not texts:
        raise InvalidInput(f"input '{INPUT_NAME}' is empty")
    try:
        priority = request_priority(options.get("priority"))
        salt = request_cache_salt(options.get("cache_salt"))
        check_prompt_count(len(texts))
        request = SamplingRequest.of(options, vocab_size=model.info.vocab_size,
                                     default_max_tokens=V2_DEFAULT_MAX_TOKENS)
        for text in texts:  # every prompt's length before any is tokenized
            model.check_prompt_chars(len(text))
        prompts = [await model.encode(text) for text in texts]
        params, streams = await submit_all(model, prompts, request, kind="v2",
                                           priority=priority, cache_salt=salt,
                                           deadline=deadline)
    except (OptionError, ValueError, TypeError) as exc:
        raise InvalidInput(str(exc)) from None
    except EngineDeadError as exc:
        raise ModelNotReady(model.name, str(exc)) from exc
    try:
        finals = await asyncio.gather(*(_final(s) for s in streams))
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    except EngineDeadError as exc:
        raise ModelNotReady(model.name, str(exc)) from exc
    finally:
        for s in streams:
            s.close()
    for out in finals:
        _check_final(out)
    first = params[0]
    samples = [sorted(out.outputs, key=lambda c: c.index) for out in finals]
    result = _Completed(first.n, [[c.text for c in row] for row in samples])
    if first.logprobs is None and first.prompt_logprobs is None:
        return result
    text = TokenText(model.info.tokenizer)
    if first.logprobs is not None:
        result.logprobs = [[v2_logprobs(c.token_ids, c.logprobs or [None] * len(c.token_ids),
                                        first.logprobs, text) for c in row]
                           for row in samples]
    if first.prompt_logprobs is not None:
        result.prompt_logprobs = [
            v2_logprobs(out.prompt_token_ids, out.prompt_logprobs
                        or [None] * len(out.prompt_token_ids), first.prompt_logprobs, text)
            for out in finals]
    return result


@dataclass(slots=True)
class _Completed:
    """A v1/v2 request's results: per prompt, its n samples (and their logprobs if asked)."""

    n: int
    texts: list[list[str]]
    logprobs: list[list[list[dict[str, Any] | None]]] | None = None
    prompt_logprobs: list[list[dict[str, Any] | None]] | None = None


def _bytes_output(name: str, rows: list[list[str]], n: int) -> InferOutput:
    """A BYTES tensor: [N] when there is one value per prompt, else [N, n]."""
    shape = [len(rows)] if n == 1 else [len(rows), n]
    output = InferOutput(name=name, shape=shape, datatype="BYTES")
    data = np.array([v.encode("utf-8") for row in rows for v in row], dtype=np.object_)
    output.set_data_from_numpy(data.reshape(shape), binary_data=False)
    return output


def request_priority(value: Any) -> int:
    """``priority`` of a request (v2 parameters may carry it as a string)."""
    if value is None:
        return 0
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    elif isinstance(value, int) and not isinstance(value, bool):
        return value
    raise OptionError(f"priority must be an integer (got {value!r})", "priority")


def request_cache_salt(value: Any) -> str | None:
    """``cache_salt`` of a request: a string, or absent (empty means no salt)."""
    if value is None or isinstance(value, str):
        return value or None
    raise OptionError(f"cache_salt must be a string (got {value!r})", "cache_salt")


def _texts(tensor: Any) -> list[str]:
    """The prompts of a BYTES tensor; anything but strings, or data that does not fill the
    declared shape, is the client's error (400), never coerced with ``str()``."""
    shape = list(tensor.shape or [])
    if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
        raise InvalidInput(f"input '{INPUT_NAME}': shape {shape} must list non-negative sizes")
    try:
        values = tensor.as_numpy().reshape(-1).tolist()
    except ValueError as exc:
        raise InvalidInput(f"input '{INPUT_NAME}': the data does not match shape {shape}: "
                           f"{exc}") from None
    if len(values) != int(np.prod(shape, dtype=np.int64)):
        raise InvalidInput(f"input '{INPUT_NAME}': {len(values)} element(s) do not match "
                           f"shape {shape}")
    texts = []
    for v in values:
        if isinstance(v, bytes):
            try:
                v = v.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidInput(f"input '{INPUT_NAME}' is not valid UTF-8 text: "
                                   f"{exc}") from None
        if not isinstance(v, str):
            raise InvalidInput(f"input '{INPUT_NAME}' (BYTES) must hold strings, got "
                               f"{type(v).__name__}")
        texts.append(v)
    return texts


async def _final(stream: RequestStream) -> RequestOutput:
    final: RequestOutput | None = None
    async for out in stream:
        final = out
    if final is None or not final.finished:
        raise InferenceError("the request was aborted")
    return final


def v2_parameters(parameters: Any) -> dict[str, Any]:
    """A v2 request's ``parameters`` as plain values, REST or gRPC.

    KServe's gRPC ``InferParameter`` has no ``double_param``; tritonclient.grpc sends floats
    there anyway (field 4), which KServe's message keeps as an unknown field. Decode it from
    the serialized bytes rather than drop a client's temperature silently."""
    if not parameters:
        return {}
    result: dict[str, Any] = {}
    for key, value in parameters.items():
        if hasattr(value, "WhichOneof"):
            kind = value.WhichOneof("parameter_choice")
            result[key] = getattr(value, kind) if kind else _unknown_scalar(value)
        else:
            result[key] = value
    return result


def _unknown_scalar(message: Any) -> Any:
    """double_param (field 4, fixed64) or uint64_param (field 5, varint) of Triton's
    InferParameter, read from the wire bytes."""
    data = message.SerializeToString()
    if len(data) == 9 and data[0] == 0x21:
        return float(np.frombuffer(data[1:9], dtype="<f8")[0])
    if data and data[0] == 0x28:
        value, shift = 0, 0
        for byte in data[1:]:
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value
    return None
