"""The KServe model: one :class:`AsyncLLM` behind KServe's data plane (the v1/v2 protocol
itself is in v2.py, the OpenAI routes in kserve_paged.openai).

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
import itertools
import logging
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

from kserve import Model
from kserve.errors import ModelNotReady
from kserve.protocol.infer_type import InferRequest, InferResponse

from kserve_paged import v2
from kserve_paged.admission import headers_deadline, queue_full
from kserve_paged.generation_defaults import generation_defaults
from kserve_paged.lora import AdapterModel, LoRAError
from kserve_paged.metrics import EngineMetrics, MetricsObserver
from kserve_paged.request_caps import check_prompt_token_ids
from kserve_paged.request_options import OptionError, SamplingRequest
from kserve_paged.tracing import RequestTracer, request_attributes, request_headers
from kserve_paged_engine import limits
from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.frontend.async_llm import AsyncLLM, EngineDeadError, RequestStream
from kserve_paged_engine.lora import LoRARequest
from kserve_paged_engine.model_info import ModelInfo
from kserve_paged_engine.pooling_params import PoolingParams
from kserve_paged_engine.sampling_params import SamplingParams

logger = logging.getLogger("kserve.paged")

_lora_ids = itertools.count(1)  # one id per load: a reloaded adapter never reuses cached prefixes


class PagedLLMModel(Model):
    """``kserve.Model`` serving one LLM with the paged engine (a `ServedModel`, served.py).

    ``max_prompt_chars`` caps prompt text before it is tokenized (None: derived from the
    context window, see kserve_paged_engine.limits.max_prompt_chars)."""

    def __init__(self, name: str, config: EngineConfig, *, llm: AsyncLLM | None = None,
                 metrics: EngineMetrics | None = None,
                 max_prompt_chars: int | None = None, tool_call_parser: str = "hermes",
                 lora_modules: list[tuple[str, str]] | None = None,
                 reasoning_parser: str | None = None,
                 default_chat_template_kwargs: dict[str, Any] | None = None,
                 generation_config: str = "auto",
                 max_waiting_requests: int | None = None) -> None:
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
        # True once start_engine finished: weights warm and the start-up adapters loaded.
        self.started = False
        self._max_prompt_chars = max_prompt_chars
        self.tool_call_parser = tool_call_parser  # read by the chat route (openai/tools.py)
        # Thinking models (openai/reasoning.py): how the output splits into reasoning and
        # answer, and what every chat template render gets (a request's kwargs override).
        self.reasoning_parser = reasoning_parser
        self.default_chat_template_kwargs = dict(default_chat_template_kwargs or {})
        if generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be auto or vllm (got {generation_config!r})")
        self.generation_config = generation_config
        self._generation_defaults: SamplingRequest | None = None
        self.max_waiting_requests = max_waiting_requests  # None: unbounded (admission.py)
        # Adapters served under their own names (kserve_paged/lora.py), loaded at start-up.
        self.loras: dict[str, LoRARequest] = {}
        self._lora_modules = list(lora_modules or [])
        # KServe's model repository, where adapters are registered as v2 models (set by the
        # server; None: OpenAI routes only).
        self.repository: Any = None
        # Every name the base model is served under (--served_model_name; set by the server's
        # install): an adapter may take none of them.
        self.served_names: tuple[str, ...] = (name,)
        self.tracer: RequestTracer | None = None  # --otlp-traces-endpoint (server.install)

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
        await self._load_lora_modules()
        info = self.llm.model_info()
        self.metrics.set_cache_config(info.block_size, info.num_kv_blocks)
        # Gauges only: counters come from the engine thread's step callback alone, so an
        # older snapshot applied here after a newer one cannot be read as an engine restart.
        self.metrics.update(self.llm.stats(), counters=False)
        logger.info("model %s: ready in %.1fs (%s, max_model_len %d, %d KV blocks)", self.name,
                    time.monotonic() - self.load_started, info.model_path, info.max_model_len,
                    info.num_kv_blocks)
        self.started = True

    async def _load_lora_modules(self) -> None:
        """The start-up adapters (a bad one in a manifest ends the server). Names of one folder
        share one engine adapter: KServe's LLMInferenceService lists every adapter twice
        (`NAME` and `publishers/NS/models/NAME`), which would double its memory and its
        share of --max_loras."""
        loaded: dict[str, LoRARequest] = {}
        for name, path in self._lora_modules:
            twin = loaded.get(os.path.realpath(path))
            if twin is not None:
                self.alias_lora(name, twin)
                logger.info("model %s: LoRA adapter %s is %s", self.name, name, twin.lora_name)
                continue
            loaded[os.path.realpath(path)] = await self.load_lora(name, path)
            logger.info("model %s: LoRA adapter %s loaded from %s", self.name, name, path)

    def stop(self) -> None:
        self.ready = False
        self.llm.shutdown(timeout=5.0)

    def stop_engine(self) -> None:
        self.stop()

    async def healthy(self) -> bool:
        return self.accepting

    @property
    def accepting(self) -> bool:
        """Loaded (the start-up adapters too), alive and not shutting down: readiness, and
        whether new requests are taken."""
        return self.started and self.llm.is_ready and not self.draining

    def not_ready_reason(self) -> str:
        if self.draining:
            return "The server is shutting down."
        if self.llm.is_healthy():
            return "It is loading."
        error = self.llm.error
        return "The engine failed." if error is None else f"The engine failed: {error}"

    def begin_drain(self) -> None:
        """SIGTERM: readiness turns false and new requests get 503; in-flight ones go on."""
        self.draining = True

    # -- what both front ends (v2.py, kserve_paged.openai) use -------------------------------

    def check_ready(self) -> None:
        if not self.accepting:
            raise ModelNotReady(self.name, self.not_ready_reason())

    @property
    def info(self) -> ModelInfo:
        """The loaded engine's facts (tokenizer, context window, ...); RuntimeError before."""
        return self.llm.model_info()

    @property
    def loaded_info(self) -> ModelInfo | None:
        """``info`` while the engine serves, else None (model listings show what is known)."""
        return self.llm.model_info() if self.llm.is_ready else None

    @property
    def max_prompt_chars(self) -> int:
        """The longest prompt text that is tokenized at all; longer ones cannot fit."""
        if self._max_prompt_chars is not None:
            return self._max_prompt_chars
        return limits.max_prompt_chars(self.info.max_model_len)

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        """Refuse (OptionError) a prompt text too long to tokenize, before tokenizing it."""
        limit = self.max_prompt_chars
        if num_chars > limit:
            raise OptionError(limits.prompt_too_long(num_chars, limit), param)

    async def encode(self, prompt: str | list[int], *, add_special_tokens: bool = True
                     ) -> list[int]:
        """Token ids of a prompt (the tokenizer adds BOS as LLM.generate would), with the one
        prompt check of the front ends: text must be non-empty, valid Unicode and within
        ``max_prompt_chars``; ids must be in the vocabulary (kserve_paged_engine.limits.check_prompt_ids).
        Text is tokenized on a worker thread: a long prompt would stall the event loop."""
        info = self.info
        if isinstance(prompt, str):
            if not prompt:
                raise OptionError("the prompt is empty", "prompt")
            self.check_prompt_chars(len(prompt))
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise OptionError("the prompt is not valid Unicode text (it holds a lone "
                                  "surrogate)", "prompt") from None
            ids = await asyncio.to_thread(info.tokenizer.encode, prompt,
                                          add_special_tokens=add_special_tokens)
            ids = list(ids)
        else:  # its length before anything reads the ids (--max_prompt_token_ids)
            check_prompt_token_ids(len(prompt), info.max_model_len)
            ids = list(prompt)
        try:
            limits.check_prompt_ids(ids, info.vocab_size)
        except ValueError as exc:
            raise OptionError(str(exc), "prompt") from None
        return ids

    @property
    def generation_defaults(self) -> SamplingRequest:
        """Default sampling values: the model folder's generation_config.json under
        `--generation_config auto` (vLLM's meaning), none under `vllm`."""
        if self._generation_defaults is None:
            self._generation_defaults = (generation_defaults(self.info.model_path)
                                         if self.generation_config == "auto"
                                         else SamplingRequest())
        return self._generation_defaults

    def sampling_params(self, request: SamplingRequest, prompt_len: int) -> SamplingParams:
        """One prompt's SamplingParams, the model's defaults under the request's values."""
        return request.params(prompt_len, self.info.max_model_len, self.generation_defaults)

    async def submit(self, prompt_ids: list[int], params: SamplingParams, *, kind: str,
                     priority: int = 0, cache_salt: str | None = None,
                     deadline: float | None = None,
                     lora_request: LoRARequest | None = None,
                     served_name: str | None = None,
                     pooling_params: PoolingParams | None = None) -> RequestStream:
        """Hand a validated request to the engine, with its `deadline` (time.monotonic(),
        from the route: admission.py); ValueError -> 400, RequestRefused (429) when the waiting queue is at
        ``max_waiting_requests``. `served_name`: the name the request was sent to (an
        adapter's, for its span)."""
        limit = self.max_waiting_requests
        if limit is not None and (waiting := self.llm.num_waiting) >= limit:
            self.metrics.count_rejected("queue_full")
            raise queue_full(waiting, limit)
        request_id = f"{kind}-{uuid.uuid4().hex}"
        lora: dict[str, Any] = {"lora_request": lora_request} if lora_request is not None else {}
        if pooling_params is not None:  # an embedding or classification (openai/pooling.py)
            lora["pooling_params"] = pooling_params
        tracer = self.tracer
        if tracer is not None:  # the span is written when the request ends (tracing.py)
            name = served_name or (lora_request.lora_name if lora_request else self.name)
            tracer.start(request_id, request_headers(), request_attributes(params, name))
        try:
            return await self.llm.add(prompt_ids, params, request_id, priority=priority,
                                      cache_salt=cache_salt, deadline=deadline,
                                      on_deadline=self.metrics.count_timed_out, **lora)
        except BaseException as exc:
            if tracer is not None:
                tracer.discard(request_id)
            if isinstance(exc, EngineDeadError):
                raise ModelNotReady(self.name, str(exc)) from exc
            raise

    # -- LoRA adapters, each served under its own name (lora.py) ----------------------------

    async def load_lora(self, name: str, path: str,
                        roots: Sequence[str] | None = None) -> LoRARequest:
        """Load an adapter into the engine and serve it as `name`; LoRAError (400) if it
        cannot. `roots`: the folders it must stay under at every read (a client's adapter,
        lora_paths.py); None for the operator's."""
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise LoRAError(400, "lora_name and lora_path must be non-empty strings")
        self._check_adapter_name(name)
        lora = LoRARequest(name, next(_lora_ids), path,
                           tuple(roots) if roots is not None else None)
        try:
            await self.llm.add_lora(lora)
        except ValueError as exc:
            raise LoRAError(400, str(exc)) from None
        try:
            self.alias_lora(name, lora)
        except LoRAError:  # a concurrent load took the name meanwhile
            await self.llm.remove_lora(lora.lora_int_id)
            raise
        return lora

    def _check_adapter_name(self, name: str) -> None:
        """LoRAError (400) unless `name` is free: not an adapter's already, and not a name
        the base model is served under (one taken would hand that name's v2 traffic to the
        adapter, and unloading the adapter would remove it)."""
        if name in self.loras:
            raise LoRAError(400, f"The lora adapter '{name}' has already been loaded.")
        other = self.repository.get_model(name) if self.repository is not None else None
        if name == self.name or name in self.served_names or other is not None:
            raise LoRAError(400, f"'{name}' is a served model's name; a LoRA adapter "
                            "cannot take it")

    def alias_lora(self, name: str, lora: LoRARequest) -> None:
        """Serve the loaded adapter `lora` under `name` too (v1/v2 in KServe's repository)."""
        self._check_adapter_name(name)
        self.loras[name] = lora
        if self.repository is not None:
            self.repository.update(AdapterModel(self, lora, name), name)

    async def unload_lora(self, name: str) -> None:
        lora = self.loras.pop(name, None) if isinstance(name, str) else None
        if lora is None:
            raise LoRAError(404, f"The lora adapter '{name}' cannot be found.")
        if self.repository is not None and self.repository.get_model(name) is not None:
            self.repository.unload(name)
        if all(other is not lora for other in self.loras.values()):  # its last name
            await self.llm.remove_lora(lora.lora_int_id)

    # -- v1 / v2 inference (KServe calls these; the protocol is in v2.py) --------------------

    def get_input_types(self) -> list[dict[str, Any]]:
        return v2.input_types()

    def get_output_types(self) -> list[dict[str, Any]]:
        return v2.output_types()

    async def predict(self, payload: InferRequest | dict[str, Any],
                      headers: dict[str, str] | None = None,
                      response_headers: dict[str, str] | None = None
                      ) -> InferResponse | dict[str, Any]:
        """v2 (``text_input`` -> ``text_output``) or v1 (``instances`` -> ``predictions``):
        see :func:`kserve_paged.v2.predict`; the deadline comes in ``headers``
        (admission.py)."""
        self.check_ready()
        return await v2.predict(self, payload, headers_deadline(headers))
