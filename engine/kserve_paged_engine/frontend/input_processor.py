"""Requests in: a prompt (text, token ids or vLLM's prompt dict) and its options become queued
requests, or a refusal (ValueError) before anything is allocated.

One request per prompt; an n > 1 request queues its first sample only (the others fork from it
once its prompt is computed, engine/kserve_paged_engine/frontend/forks.py); a beam search queues one root that
its beams fork from (engine/kserve_paged_engine/frontend/beam_search.py). A request with a structured-output constraint is
queued at once while its grammar compiles off the engine thread; the scheduler passes it over
until `start_compiled_grammars` has made its matcher.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

from kserve_paged_engine.core.request import Request
from kserve_paged_engine.core.scheduler import Scheduler
from kserve_paged_engine.frontend.beam_search import BeamSearches
from kserve_paged_engine.frontend.forks import Forks
from kserve_paged_engine.limits import check_prompt_ids, request_id_in_use
from kserve_paged_engine.lora import LoRAManager, LoRARequest
from kserve_paged_engine.pooling_params import PoolingParams, WrongJobError
from kserve_paged_engine.sample.structured_output import GrammarCompiler, RequestGrammar
from kserve_paged_engine.sample.token_filters import admit as admit_token_filters
from kserve_paged_engine.sampling_params import SamplingParams

logger = logging.getLogger("kserve_paged_engine")

Prompt = str | list[int] | dict[str, Any]


class InputProcessor:
    def __init__(self, tokenizer: Any, vocab_size: int, eos: tuple[int | None, list[int]],
                 scheduler: Scheduler, forks: Forks, beams: BeamSearches, lora: LoRAManager | None,
                 grammar_compile_s: float | None = None, job: str = "generate",
                 hidden_size: int = 0) -> None:
        self.tokenizer = tokenizer
        self.job, self.hidden_size = job, hidden_size  # the model's one job (model_job.py)
        self.vocab_size = vocab_size
        self.eos_token_id, self.extra_eos = eos
        stop_ids = [t for t in [self.eos_token_id, *self.extra_eos] if t is not None]
        self.grammars = GrammarCompiler(tokenizer, vocab_size, stop_ids,
                                        timeout_s=grammar_compile_s)
        self.scheduler = scheduler
        self.forks = forks
        self.beams = beams
        self.lora = lora
        self.compiling: list[Request] = []  # queued, their grammar not compiled yet

    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))

    def add(self, request_id: str, prompt: Prompt, params: SamplingParams, *, priority: int,
            cache_salt: str | None, arrival_time: float | None,
            lora_request: LoRARequest | None,
            pooling_params: PoolingParams | None = None) -> tuple[list[Request], str | None]:
        """Queue a request; raises ValueError (nothing allocated) if it can never run, and
        WrongJobError for a request of another kind than the model's job. Returns the requests
        queued (the engine's other stages start keeping theirs) and the prompt's text."""
        if pooling_params is not None:  # prompt only: computed, pooled, nothing sampled
            pooling_params.check(self.job, self.hidden_size)
            params = SamplingParams(max_tokens=0)
        elif self.job != "generate":
            raise WrongJobError(self.job, "generate")
        if lora_request is not None:
            if self.lora is None:
                raise ValueError(f"LoRA adapter {lora_request.lora_name!r} requested but LoRA "
                                 "is not enabled (enable_lora=True)")
            # Loads and checks it before anything is queued; its blocks key on its content.
            adapter = self.lora.add(lora_request)
            lora_request = dataclasses.replace(lora_request, content_digest=adapter.digest)
        if isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt", cache_salt)
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        # Checked here, not later: a bad salt or priority would raise inside schedule(), outside
        # any step's fault containment, and kill the engine for every request.
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string (got {type(cache_salt).__name__})")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer (got {priority!r})")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if text is not None else [int(t) for t in prompt]
        check_prompt_ids(token_ids, self.vocab_size)
        token_ids, text = self._filters(params, token_ids, text)
        if self.extra_eos and not params.ignore_eos:
            params = _with_stop_ids(params, self.extra_eos)
        if ((self.forks.parents and request_id in self.forks)
                or (self.beams.searches and request_id in self.beams)):
            raise ValueError(request_id_in_use(request_id))
        common = (token_ids, text, priority, cache_salt, arrival_time, lora_request)
        if pooling_params is not None:
            added = [self._add_one(request_id, params, *common)]
            added[0].pooling_params = pooling_params
        elif params.use_beam_search:  # one request; beams fork from it (beam_search.py)
            added = [self._add_one(request_id, params, *common)]
            self.beams.start(added[0], self.scheduler.max_model_len)
        elif params.n == 1:
            added = [self._add_one(request_id, params, *common)]
        else:
            added = self._add_samples(request_id, params, common)
        return added, text

    def _filters(self, params: SamplingParams, token_ids: list[int], text: str | None
                 ) -> tuple[list[int], str | None]:
        """vLLM's prompt cut (truncate_prompt_tokens: the last k tokens; the text no longer
        matches them) and token filters: allowed ids checked against the vocabulary, bad
        words turned into token sequences (set on `params`, as vLLM does)."""
        k = params.truncate_prompt_tokens
        if k is not None:
            keep = self.scheduler.max_model_len if k == -1 else k
            if keep > self.scheduler.max_model_len:
                raise ValueError(f"truncate_prompt_tokens ({k}) exceeds the context window "
                                 f"({self.scheduler.max_model_len})")
            if len(token_ids) > keep:
                token_ids, text = token_ids[-keep:], None
        admit_token_filters(params, self.vocab_size, self.tokenizer)  # once per request
        return token_ids, text

    def _add_samples(self, request_id: str, params: SamplingParams, common: tuple
                     ) -> list[Request]:
        """n parallel samples: the first child computes the prompt, the others fork from it
        when it samples its first token, sharing every prompt block."""
        children = Forks.children(request_id, params)
        if params.max_tokens == 0:  # nothing is sampled, so nothing to fork from: n scorings
            added = [self._add_one(child, child_params, *common)
                     for child, child_params in children]
            self.forks.register(request_id, [child for child, _ in children], pending=[])
            return added
        (first, first_params), rest = children[0], children[1:]
        added = [self._add_one(first, first_params, *common)]
        self.forks.register(request_id, [child for child, _ in children], pending=rest)
        return added

    def _add_one(self, request_id: str, params: SamplingParams, token_ids: list[int],
                 text: str | None, priority: int, cache_salt: str | None,
                 arrival_time: float | None, lora_request: LoRARequest | None) -> Request:
        request = Request(request_id, token_ids, params, eos_token_id=self.eos_token_id,
                          priority=priority, cache_salt=cache_salt, lora_request=lora_request)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.scheduler.add_request(request)  # raises on duplicates and over-long prompts
        if params.structured_outputs is not None:
            spec = params.structured_outputs
            request.grammar = RequestGrammar(self.grammars.submit(spec), spec.start_after_token_id)
            self.compiling.append(request)
        return request

    def start_compiled_grammars(self) -> list[tuple[Request, str]]:
        """Give each request whose grammar finished compiling its matcher (the scheduler then
        admits it); returns the requests whose compile failed, with why."""
        if not self.compiling:
            return []
        still, broken = [], []
        for req in self.compiling:
            if req.is_finished:
                continue  # aborted while compiling
            if not req.grammar.future.done():
                still.append(req)
                continue
            try:
                req.grammar.start()
            except Exception as exc:  # noqa: BLE001 - this request's grammar only
                logger.warning("grammar compile failed for %s: %s", req.request_id, exc)
                broken.append((req, f"the structured-output grammar did not compile: {exc}"))
        self.compiling = still
        return broken


def _with_stop_ids(params: SamplingParams, extra: list[int]) -> SamplingParams:
    params = copy.copy(params)
    params.stop_token_ids = list(params.stop_token_ids) + [t for t in extra
                                                           if t not in params.stop_token_ids]
    return params
