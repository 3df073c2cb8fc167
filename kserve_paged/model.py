"""The KServe model: one :class:`AsyncLLM` behind KServe's v1/v2 (REST and gRPC) data plane.

Readiness, and how it fits KServe 0.21:
- ``ModelServer.start`` refuses to start unless a model's ``ready`` attribute is true, and calls
  ``start_engine()`` (for ``engine = True`` models) alongside the HTTP server. Every readiness
  route (``/v2/models/{name}/ready``, ``/v1/models/{name}``, gRPC ModelReady) and the infer routes
  ask ``healthy()``.
- So ``ready`` only means "registered" (set by :meth:`load`, which is cheap), the weights load
  and warm up on the engine thread started by :meth:`start_engine`, and :meth:`healthy` is true
  once that finished and the engine is alive. Probes see 503 until the model can really serve.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from kserve import Model
from kserve.errors import InferenceError, InvalidInput, ModelNotReady
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse

from engine.async_llm import AsyncLLM, EngineDeadError, RequestStream, StepInfo
from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from kserve_paged.logprobs import TokenText, v2_logprobs
from kserve_paged.metrics import EngineMetrics
from kserve_paged.sampling import (
    SAMPLING_OPTIONS,
    V2_UNSUPPORTED_OPTIONS,
    OptionError,
    make_sampling_params,
    unsupported_options,
)

logger = logging.getLogger("kserve.paged")

INPUT_NAME = "text_input"
OUTPUT_NAME = "text_output"
LOGPROBS_NAME = "logprobs"  # only when the parameters ask for logprobs
PROMPT_LOGPROBS_NAME = "prompt_logprobs"  # only when they ask for prompt_logprobs
# v2 request parameters that tritonclient or KServe set for transport, not sampling.
_TRANSPORT_PARAMETERS = frozenset({"binary_data_output", "binary_data_size", "content_type",
                                   "headers", "timeout", "sequence_id", "sequence_start",
                                   "sequence_end"})
V2_DEFAULT_MAX_TOKENS = 16  # SamplingParams' default, so v2 and LLM.generate agree


class MetricsObserver:
    """Engine step callback -> Prometheus: gauges and counters from the stats, latency
    histograms from each output's timestamps (runs on the engine thread; prometheus_client is
    thread-safe)."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        self._last_token: dict[str, float] = {}

    def __call__(self, info: StepInfo) -> None:
        m = self.metrics
        m.update(info.stats)
        if info.stepped and info.num_tokens > 0:
            m.observe_iteration_tokens(info.num_tokens)
        for out in info.outputs:
            self._observe(out)
        for rid in info.aborted:
            self._last_token.pop(rid, None)

    def _observe(self, out: RequestOutput) -> None:
        t = out.metrics
        if t is None:
            return
        rid = out.request_id
        new_tokens = bool(out.outputs and out.outputs[0].delta_token_ids)
        if new_tokens and t.last_token_time is not None:
            previous = self._last_token.get(rid)
            if previous is None:
                if t.first_token_time is not None:
                    self.metrics.observe_time_to_first_token(t.first_token_time - t.arrival_time)
                if t.first_scheduled_time is not None:
                    self.metrics.observe_request_queue_time(
                        t.first_scheduled_time - t.arrival_time)
            else:
                self.metrics.observe_inter_token_latency(t.last_token_time - previous)
            self._last_token[rid] = t.last_token_time
        if out.finished:
            self._last_token.pop(rid, None)
            end = t.finished_time if t.finished_time is not None else time.monotonic()
            self.metrics.observe_e2e_request_latency(end - t.arrival_time)


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


class PagedLLMModel(Model):
    """``kserve.Model`` serving one LLM with the paged engine."""

    def __init__(self, name: str, config: EngineConfig, *, llm: AsyncLLM | None = None,
                 metrics: EngineMetrics | None = None) -> None:
        super().__init__(name)
        self.engine = True  # KServe awaits start_engine() next to the HTTP server
        self.config = config
        self.llm = llm if llm is not None else AsyncLLM(config)
        self.metrics = metrics if metrics is not None else EngineMetrics(name)
        self.llm.add_step_callback(MetricsObserver(self.metrics))
        self.created = time.time()
        self.load_started: float | None = None
        self.load_error: BaseException | None = None
        self.draining = False  # set on SIGTERM: refuse new work, let in-flight requests finish

    # -- lifecycle (see the module docstring) -----------------------------------------------

    def load(self) -> bool:
        """Registration only: weights load in start_engine(). KServe's data plane also calls
        this whenever ``healthy()`` is false, so it must stay cheap and idempotent."""
        self.ready = True
        return True

    def start(self) -> None:
        """KServe's default sets ``ready``; readiness is ``healthy()``'s business here."""

    async def start_engine(self) -> None:
        """Load and warm up on the engine thread; raise (ending the server) if that fails, so
        the pod restarts instead of sitting unready forever."""
        self.load_started = time.monotonic()
        logger.info("model %s: loading %s", self.name, self.config.model or "the default model")
        self.llm.start()
        try:
            await self.llm.wait_ready()
        except EngineDeadError as exc:
            self.load_error = exc
            logger.error("model %s: loading failed: %s", self.name, exc.__cause__ or exc)
            raise
        engine: Any = self.llm.engine
        self.metrics.set_cache_config(engine.config.block_size, engine.num_kv_blocks)
        # Gauges only: counters come from the engine thread's step callback alone, so an
        # older snapshot applied here after a newer one cannot be read as an engine restart.
        self.metrics.update(self.llm.stats(), counters=False)
        logger.info("model %s: ready in %.1fs (%s, max_model_len %d, %d KV blocks)", self.name,
                    time.monotonic() - self.load_started, engine.model_path, engine.max_model_len,
                    engine.num_kv_blocks)

    def stop(self) -> None:
        self.ready = False
        self.llm.shutdown(timeout=5.0)

    def stop_engine(self) -> None:
        self.stop()

    async def healthy(self) -> bool:
        return self.accepting

    @property
    def accepting(self) -> bool:
        """Loaded, alive and not shutting down: readiness, and whether new requests are taken."""
        return self.llm.is_ready and not self.draining

    def not_ready_reason(self) -> str:
        if self.draining:
            return "The server is shutting down."
        return "The engine failed." if not self.llm.is_healthy() else "It is loading."

    def begin_drain(self) -> None:
        """SIGTERM: readiness turns false and new requests get 503; in-flight ones go on."""
        self.draining = True

    # -- helpers shared with the OpenAI routes ----------------------------------------------

    def check_ready(self) -> None:
        if not self.accepting:
            raise ModelNotReady(self.name, self.not_ready_reason())

    @property
    def tokenizer(self) -> Any:
        return self.llm.engine.tokenizer  # type: ignore[attr-defined]

    @property
    def max_model_len(self) -> int | None:
        return getattr(self.llm.engine, "max_model_len", None) if self.llm.is_ready else None

    @property
    def model_path(self) -> str | None:
        return getattr(self.llm.engine, "model_path", None) if self.llm.is_ready else None

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (the tokenizer adds BOS as LLM.generate would)."""
        if isinstance(prompt, str):
            if not prompt:
                raise OptionError("the prompt is empty", "prompt")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise OptionError("the prompt is not valid Unicode text (it holds a lone "
                                  "surrogate)", "prompt") from None
            return list(self.tokenizer.encode(prompt))
        if not prompt:
            raise OptionError("the prompt is empty: at least one token is required", "prompt")
        vocab = getattr(getattr(self.llm.engine, "model", None), "vocab_size", None)
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (
                    vocab is not None and t >= vocab):
                raise OptionError(f"token id {t!r} is out of range for this model", "prompt")
        return list(prompt)

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size (token ids in logit_bias must be below it)."""
        model = getattr(self.llm.engine, "model", None) if self.llm.is_ready else None
        return getattr(model, "vocab_size", None)

    def sampling_params(self, options: Mapping[str, Any], prompt_ids: list[int],
                        default_max_tokens: int | None) -> SamplingParams:
        max_len = self.max_model_len
        assert max_len is not None
        return make_sampling_params(options, prompt_len=len(prompt_ids), max_model_len=max_len,
                                    default_max_tokens=default_max_tokens,
                                    vocab_size=self.vocab_size)

    async def submit(self, prompt_ids: list[int], params: SamplingParams, *, kind: str,
                     priority: int = 0, cache_salt: str | None = None) -> RequestStream:
        """Hand a validated request to the engine; ValueError (e.g. a full queue) -> 400."""
        request_id = f"{kind}-{uuid.uuid4().hex}"
        try:
            return await self.llm.add(prompt_ids, params, request_id, priority=priority,
                                      cache_salt=cache_salt)
        except EngineDeadError as exc:
            raise ModelNotReady(self.name, str(exc)) from exc

    # -- v2 / v1 inference ------------------------------------------------------------------

    def get_input_types(self) -> list[dict[str, Any]]:
        return [{"name": INPUT_NAME, "datatype": "BYTES", "shape": [-1]}]

    def get_output_types(self) -> list[dict[str, Any]]:
        return [{"name": OUTPUT_NAME, "datatype": "BYTES", "shape": [-1]}]

    async def predict(self, payload: InferRequest | dict[str, Any],
                      headers: dict[str, str] | None = None,
                      response_headers: dict[str, str] | None = None
                      ) -> InferResponse | dict[str, Any]:
        """v2: ``text_input`` BYTES [N] -> ``text_output`` BYTES [N], sampling options in the
        request's ``parameters``. v1: ``{"instances": [str, ...], "parameters": {...}}`` ->
        ``{"predictions": [str, ...]}``.

        With ``n`` > 1, ``text_output`` is [N, n] (row i: prompt i's samples in order) and v1's
        predictions are lists. With ``logprobs`` (k), an output ``logprobs`` of text_output's
        shape holds per sample a JSON string: a list, per generated token, of ``{token_id,
        token, logprob, rank, top_logprobs: [{token_id, token, logprob, rank}, ...]}`` (the top
        k). With ``prompt_logprobs``, an output ``prompt_logprobs`` [N] holds per prompt such a
        list (null for the first token). v1 answers carry them as decoded JSON."""
        self.check_ready()
        if isinstance(payload, dict):
            return await self._predict_v1(payload)
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
        result = await self._complete_all(texts, options)
        outputs = [_bytes_output(OUTPUT_NAME, result.texts, result.n)]
        if result.logprobs is not None:
            outputs.append(_bytes_output(LOGPROBS_NAME, [
                [json.dumps(s, separators=(",", ":")) for s in row] for row in result.logprobs],
                result.n))
        if result.prompt_logprobs is not None:
            outputs.append(_bytes_output(PROMPT_LOGPROBS_NAME, [
                [json.dumps(p, separators=(",", ":"))] for p in result.prompt_logprobs], 1))
        return InferResponse(
            response_id=payload.id or str(uuid.uuid4()), model_name=self.name,
            infer_outputs=outputs, from_grpc=payload.from_grpc,
            use_binary_outputs=payload.use_binary_outputs,
            requested_outputs=payload.request_outputs)

    async def _predict_v1(self, body: dict[str, Any]) -> dict[str, Any]:
        instances = body.get("instances")
        if not isinstance(instances, list) or not all(isinstance(i, str) for i in instances):
            raise InvalidInput('expected {"instances": ["prompt", ...]} (a list of strings)')
        options = body.get("parameters") or {}
        if not isinstance(options, dict):
            raise InvalidInput('"parameters" must be an object')
        result = await self._complete_all(instances, options)
        flat = result.n == 1
        answer: dict[str, Any] = {"predictions": [row[0] if flat else row
                                                  for row in result.texts]}
        if result.logprobs is not None:
            answer["logprobs"] = [row[0] if flat else row for row in result.logprobs]
        if result.prompt_logprobs is not None:
            answer["prompt_logprobs"] = result.prompt_logprobs
        return answer

    async def _complete_all(self, texts: list[str], options: dict[str, Any]) -> _Completed:
        refused = unsupported_options(options, V2_UNSUPPORTED_OPTIONS)
        if refused:
            raise InvalidInput(f"unsupported parameter(s) {refused}: this engine cannot honour "
                               f"them; supported: {', '.join(SAMPLING_OPTIONS)}, best_of (= n), "
                               "priority, cache_salt")
        unknown = sorted(k for k in options
                         if k not in SAMPLING_OPTIONS and k not in _TRANSPORT_PARAMETERS
                         and k not in V2_UNSUPPORTED_OPTIONS
                         and k not in ("priority", "cache_salt", "best_of"))
        if unknown:
            # As vLLM (and the OpenAI routes here) do with unknown fields: ignore, but say so.
            logger.warning("ignoring unknown v2 parameter(s) %s", unknown)
        if not texts:
            raise InvalidInput(f"input '{INPUT_NAME}' is empty")
        try:
            priority = request_priority(options.get("priority"))
            salt = request_cache_salt(options.get("cache_salt"))
            prepared = []
            for text in texts:  # validate everything before anything is queued
                ids = self.encode(text)
                prepared.append((ids, self.sampling_params(options, ids, V2_DEFAULT_MAX_TOKENS)))
        except (OptionError, ValueError, TypeError) as exc:
            raise InvalidInput(str(exc)) from None
        streams: list[RequestStream] = []
        try:
            for ids, params in prepared:
                streams.append(await self.submit(ids, params, kind="v2", priority=priority,
                                                 cache_salt=salt))
            finals = await asyncio.gather(*(_final(s) for s in streams))
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        except EngineDeadError as exc:
            raise ModelNotReady(self.name, str(exc)) from exc
        finally:
            for s in streams:
                s.close()
        for out in finals:
            if out.error is not None or any(c.finish_reason == "error" for c in out.outputs):
                raise InferenceError(f"generation failed: {out.error}")
        params = prepared[0][1]
        samples = [sorted(out.outputs, key=lambda c: c.index) for out in finals]
        result = _Completed(params.n, [[c.text for c in row] for row in samples])
        text = TokenText(self.tokenizer)
        if params.logprobs is not None:
            result.logprobs = [[v2_logprobs(c.token_ids, c.logprobs or [None] * len(c.token_ids),
                                            params.logprobs, text) for c in row]
                               for row in samples]
        if params.prompt_logprobs is not None:
            result.prompt_logprobs = [
                v2_logprobs(out.prompt_token_ids, out.prompt_logprobs
                            or [None] * len(out.prompt_token_ids), params.prompt_logprobs, text)
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
