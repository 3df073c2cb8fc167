"""The synchronous engine: requests in, one scheduler step + model forward per `step()`.

`LLMEngine` coordinates; each job is elsewhere. Requests in: `input_processor.py`. A step, each
stage one call in `_step`: the scheduler (engine/kserve_paged_engine/core/scheduler.py) picks
the work, the executor (engine/kserve_paged_engine/worker/) runs the model, the sample stage
(`sample_stage.py`) turns the logits into tokens, the stop check (`stop_check.py`) decides who
ends and why, the scheduler appends the tokens and frees what ended, and `output_processor.py`
builds the outputs. Start-up decisions (model folder, KV-cache size): `startup.py`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any

from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.core.block_hash import BlockHasher
from kserve_paged_engine.core.kv_cache_manager import KVCacheManager
from kserve_paged_engine.core.kv_sizing import checkpoint_dtype, resolve_device, resolve_dtype
from kserve_paged_engine.core.request import Request, RequestStatus
from kserve_paged_engine.core.scheduler import Scheduler
from kserve_paged_engine.core.scheduler_output import SchedulerOutput
from kserve_paged_engine.frontend import startup
from kserve_paged_engine.frontend.beam_search import BeamSearches
from kserve_paged_engine.frontend.engine_reports import EngineReports
from kserve_paged_engine.frontend.forks import Forks
from kserve_paged_engine.frontend.input_processor import InputProcessor, Prompt
from kserve_paged_engine.frontend.output_processor import OutputProcessor
from kserve_paged_engine.frontend.pooling import PoolingPipeline
from kserve_paged_engine.frontend.sample_stage import SampledStep, SamplingPipeline
from kserve_paged_engine.frontend.stop_check import StopCheck
from kserve_paged_engine.lora import LoRAManager, LoRARequest
from kserve_paged_engine.model_executor.model_job import (
    ENCODER_ARCHITECTURES,
    pooler_config,
    resolve_job,
)
from kserve_paged_engine.model_executor.model_loader import load_tokenizer
from kserve_paged_engine.model_executor.models import architecture_of
from kserve_paged_engine.outputs import RequestOutput
from kserve_paged_engine.pooling_params import PoolingParams
from kserve_paged_engine.sample.sampler import Sampler
from kserve_paged_engine.sample.structured_output import GrammarBitmask
from kserve_paged_engine.sampling_params import SamplingParams
from kserve_paged_engine.spec_decode.decoder import SpecDecoder
from kserve_paged_engine.spec_decode.draft_model import DraftModelProposer, load_draft_model
from kserve_paged_engine.worker.cpu_memory import tune_glibc_malloc
from kserve_paged_engine.worker.executor import ExecutorError, LocalExecutor
from kserve_paged_engine.worker.model_runner import ModelRunner, StepResult
from kserve_paged_engine.worker.tp_executor import TPExecutor

WARMUP_PREFILL_TOKENS = 512  # the warm-up's long prefill: W1's prompts are 75-500 tokens
logger = logging.getLogger("kserve_paged_engine")


class LLMEngine(EngineReports):
    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        config = config or EngineConfig(**kwargs)
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            tune_glibc_malloc()  # no-op under tcmalloc (see kserve_paged_engine.worker.cpu_memory)
        self.model_path, self.quantization = startup.resolve_model(config, self.device.type)
        self.dtype = resolve_dtype(config.dtype, self.device, checkpoint_dtype(self.model_path))
        self.dtype, why = startup.gguf_activations(config.dtype, self.dtype, self.quantization,
                                                   self.device.type)
        startup.log_dtype(config.dtype, self.dtype, self.device, why)
        draft_model = self._load()
        self._size_cache(draft_model)
        self._build(draft_model)
        self._counter = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.last_step_tokens = 0  # tokens computed by the last step (vLLM's iteration tokens)
        # Test-only fault injection: called with the step's request ids before the forward.
        self.fault_hook: Callable[[list[str]], None] | None = None

    def _load(self) -> Any:
        """The executor (tensor-parallel workers, or this process), the model and tokenizer;
        returns the draft model of draft-model speculation, if any."""
        config, tp = self.config, self.config.tensor_parallel_size
        t0 = time.monotonic()
        logger.info("loading %s (%s on %s)", self.model_path, self.dtype, self.device)
        self.executor: LocalExecutor | TPExecutor | None = (
            TPExecutor.acquire(tp, self.device, config.multi_node) if tp > 1
            else LocalExecutor())
        self.model, self.hf_config = self.executor.load_model(
            self.model_path, self.dtype, self.device, config.load_format, config.seed,
            self.quantization, expert_parallel=config.enable_expert_parallel)
        self.tokenizer = load_tokenizer(self.model_path)
        logger.info("weights loaded in %.1f s", time.monotonic() - t0)
        arch = architecture_of(self.hf_config)
        self.encoder = arch in ENCODER_ARCHITECTURES  # whole prompts, bidirectional
        if self.encoder:  # token types from [SEP] (engine/kserve_paged_engine/model_executor/models/bert.py)
            self.model.sep_token_id = getattr(self.tokenizer, "sep_token_id", None)
        self.job = resolve_job(config.runner, config.convert, arch, self.model_path)
        self.pooling = None if self.job == "generate" else PoolingPipeline(
            self.model, pooler_config(self.job, arch, self.model_path))
        if self.job != "generate":
            logger.info("job %s (%s pooling)", self.job, self.pooling.config.kind)
        spec = config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        return load_draft_model(spec, self.model.vocab_size, self.tokenizer, self.dtype,
                                self.device, config.seed)

    def _size_cache(self, draft_model: Any) -> None:
        """KV blocks by the sizing rule, and max_model_len capped to what the cache holds."""
        self.kv_layout, self.num_kv_blocks, self.max_model_len = startup.cache_and_length(
            self.config, self.model, draft_model, self.dtype, self.device, self.encoder,
            self.model_path)

    def _build(self, draft_model: Any) -> None:
        """The parts around the loaded model: KV-cache manager, scheduler, runner, LoRA,
        speculation, and the request pipeline (inputs, sampling, outputs)."""
        config, bs, max_len = self.config, self.config.block_size, self.max_model_len
        sizes = {"max_num_batched_tokens": config.max_num_batched_tokens,
                 "max_num_seqs": config.max_num_seqs, "max_model_len": max_len}
        # Pooling reads every prompt row it pools: no prefix hits skip them.
        caching = config.enable_prefix_caching and self.pooling is None
        hasher = BlockHasher(config.prefix_caching_hash_algo)
        self.kv_events = startup.kv_event_publisher(config, hasher, self.device)
        self.kv_tier = startup.kv_tier(config, hasher, self.model_path, self.dtype,
                                       self.device, self.kv_layout, self.model)
        self.kv = KVCacheManager(self.num_kv_blocks, bs, caching, hasher=hasher,
                                 group_windows=self.kv_layout.group_windows, tier=self.kv_tier,
                                 record_events=self.kv_events is not None)
        self.scheduler = Scheduler(config.scheduler_config(chunked_prefill=not self.encoder),
                                   self.kv, max_len)
        self.lora = None if not config.enable_lora else LoRAManager(
            self.model, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
            max_cpu_loras=config.max_cpu_loras or config.max_loras)
        self.runner = ModelRunner(self.model, self.kv, self.num_kv_blocks, bs, self.dtype,
                                  self.device, layout=self.kv_layout,
                                  kv_cache_dtype=config.kv_cache_dtype, lora=self.lora,
                                  tier=self.kv_tier, **sizes)
        # Tensor parallelism: each worker its share of every block, the same ids.
        self.executor.start(self.runner, num_blocks=self.num_kv_blocks, block_size=bs,
                            dtype=self.dtype, **sizes)
        spec = config.speculative_config
        draft = None if draft_model is None else DraftModelProposer(
            draft_model, spec.num_speculative_tokens, self.num_kv_blocks, bs, self.dtype,
            self.device, **sizes)
        self.spec = SpecDecoder(spec, draft) if spec is not None else None
        startup.warm_up_and_capture(config, self.runner, self.device,
                                    tp=isinstance(self.executor, TPExecutor))
        self.forks, self.beams = Forks(), BeamSearches()
        self.inputs = InputProcessor(
            self.tokenizer, self.model.vocab_size,
            startup.eos_ids(self.model_path, self.tokenizer), self.scheduler, self.forks,
            self.beams, self.lora, grammar_compile_s=config.max_grammar_compile_s,
            job=self.job, hidden_size=self.model.hidden_size)
        self.grammars = self.inputs.grammars
        self.sampling = SamplingPipeline(
            Sampler(config.seed, ladder=self.runner.attention_backend == "cpu"),
            GrammarBitmask(self.model.vocab_size), self.spec, self.scheduler, self.forks,
            self.beams, self.tokenizer.decode)
        self.outputs = OutputProcessor(self.tokenizer, self.forks, self.sampling.states)
        self.stops = StopCheck(max_len, self.outputs)

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            tier = self.kv_tier.take_events() if self.kv_tier is not None else []
            self.kv_events.publish(self.kv.pool.take_events() + tier)

    def close(self) -> None:
        """Release what outlives a step (the event socket, tensor-parallel workers); the engine
        is not used after."""
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if self.executor is not None:
            self.executor.close()
            self.executor = None
        if self.kv_tier is not None:
            self.kv_tier.close()
            self.kv_tier = None
        self.grammars.shutdown()  # and its compile process, if any

    def on_fatal(self, callback: Callable[[BaseException], None]) -> None:
        """`callback(error)`, from another thread, when the engine can no longer step (a
        tensor-parallel worker died): AsyncLLM fails everything at once, even while idle."""
        if self.executor is not None:
            self.executor.on_death = callback

    # ------------------------------------------------------------ requests
    def tokenize(self, prompt: str) -> list[int]:
        return self.inputs.tokenize(prompt)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    *, priority: int = 0, cache_salt: str | None = None,
                    arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None,
                    pooling_params: PoolingParams | None = None) -> None:
        """Queue a request (a pooling request with `pooling_params`); raises ValueError
        (nothing allocated) if it can never run, WrongJobError if the model's job is another."""
        added, text = self.inputs.add(
            request_id, prompt, params or SamplingParams(), priority=priority,
            cache_salt=cache_salt, arrival_time=arrival_time, lora_request=lora_request,
            pooling_params=pooling_params)
        for request in added:  # each stage starts keeping its own state of the request
            self.sampling.add(request)
            self.outputs.track(request, text)

    def next_request_id(self) -> str:
        self._counter += 1
        return f"req-{self._counter}"

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        expanded = self.forks.expand(request_ids) if self.forks.parents else request_ids
        expanded = self.beams.expand(expanded) if self.beams.searches else expanded
        self.scheduler.finish_requests(expanded, RequestStatus.FINISHED_ABORTED)
        self.outputs.forget(expanded + request_ids)
        self.sampling.forget(expanded + request_ids)
        if self.pooling is not None:
            self.pooling.forget(expanded)
        if self.spec is not None:
            self.spec.release(self.scheduler.running)
        self._publish_kv_events()  # what the aborts evicted, before the next step's events

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One scheduler step and one forward; outputs of requests that progressed or ended.
        The step's KV-cache events go out as one batch once it is done."""
        try:
            return self._step()
        finally:
            if self.spec is not None:  # the draft's KV of requests that ended or were preempted
                self.spec.release(self.scheduler.running)
            self._publish_kv_events()

    def _step(self) -> list[RequestOutput]:
        """The stages in order: schedule, execute, sample, stop check, scheduler update,
        outputs. A failure in execute or sample fails only the step's requests."""
        failed = self._start_grammars()
        out = self._schedule(failed)
        if out.is_empty:
            return self._deliver(failed)
        forked: list[tuple[Request, Request]] = []  # (child, parent) of n > 1 samples
        try:
            result = self._execute(out)
            step = self.sampling.run(out, result, forked)
        except ExecutorError:
            raise  # the ranks are out of step: fatal to the engine, not to these requests
        except Exception as exc:  # noqa: BLE001 - contain the fault to this step's requests
            logger.exception("engine step failed; failing its %d requests", len(out.scheduled))
            self.outputs.track_forks(forked)
            return self._deliver(failed + self._fail(
                out.scheduled + [c for c, _ in forked], f"{type(exc).__name__}: {exc}"))
        self.outputs.track_forks(forked)
        sampled, rejected = self.sampling.accept(step)  # a grammar's refusals dropped
        ends = self.stops.check(out, sampled, step.verified, step.forked)
        if step.verified_logprobs:  # speculating requests that asked for logprobs
            self.sampling.record_verified(step, ends)
        ended = self.scheduler.update_from_output(out, ends, step.forked)
        self.generation_tokens += len(sampled) + sum(map(len, step.verified.values()))
        return self._deliver(failed + self._outputs(step, sampled, rejected, ended))

    def _start_grammars(self) -> list[RequestOutput]:
        """Matchers for the grammars compiled since the last step; errors of those that
        failed to compile (the request's own constraint)."""
        failed: list[RequestOutput] = []
        for req, why in self.inputs.start_compiled_grammars():
            failed += self._fail([req], why, status=400)
        return failed

    def _schedule(self, failed: list[RequestOutput]) -> SchedulerOutput:
        """Drafts for the coming step, then the scheduler's pick; fails what can never run."""
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self.beams.is_beam,
                              self.sampling.generator_of)
        out = self.scheduler.schedule()
        for req, why in out.unschedulable:
            failed += self._fail([req], why)
        self.last_step_tokens = out.total_num_scheduled_tokens
        self.prompt_tokens += sum(r.num_prompt_tokens for r in out.started)
        if out.is_empty and self.inputs.compiling and not failed:
            # Nothing to run until a grammar is ready.
            concurrent.futures.wait([r.grammar.future for r in self.inputs.compiling],
                                    timeout=0.05, return_when="FIRST_COMPLETED")
        return out

    def _execute(self, out: SchedulerOutput) -> StepResult:
        """The forward; a pooling request's hidden rows go to its pool."""
        if self.fault_hook is not None:
            self.fault_hook([r.request_id for r in out.scheduled])
        t0 = time.perf_counter()
        result = self.executor.execute(out)
        if self.kv.tier is not None:  # the prefill rate the swap-or-recompute choice reads
            self.kv.tier.swaps.observe_step(out.num_scheduled_tokens, out.spec_tokens,
                                            time.perf_counter() - t0)
        if self.pooling is not None:
            self.pooling.collect(result)
        return result

    def _outputs(self, step: SampledStep, sampled: dict[str, int], rejected: list[Request],
                 ended: list[Request]) -> list[RequestOutput]:
        """The outputs of every request that got a token or ended (a pooling request's with
        its result), and of finished beam searches."""
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        if rejected:
            outputs += self._fail(rejected, "the sampled token broke the request's "
                                  "structured-output grammar")
        pooled = self.pooling.finish(ended) if self.pooling is not None else {}
        sampling = step.sampling + [spec.request for spec in step.spec_rows]
        outputs += self.outputs.step_outputs(sampling, sampled, ended, now, pooled)
        for search in step.beam_searches:
            if self.beams.ready(search, self.scheduler.requests):
                self.generation_tokens += len(search.beams)
                if self.beams.advance(search, self.scheduler):
                    outputs.append(self.outputs.beam_output(search, now))
        return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The step's last stage: the sampling state of what ended goes, and an n > 1
        request's samples are folded into one output per request the user sent."""
        self.sampling.forget(o.request_id for o in outputs if o.finished)
        return self.forks.merge(outputs) if self.forks.parents else outputs

    def _fail(self, requests: list[Request], message: str,
              status: int | None = None) -> list[RequestOutput]:
        """End requests with an error; a failing beam fails its whole search (one error output
        under the search's id)."""
        ids = [r.request_id for r in requests if not r.is_finished]
        searches: set[str] = set()
        if self.beams.searches:
            searches = {s for s in map(self.beams.search_of, ids) if s is not None}
            ids = [rid for rid in ids if not self.beams.is_beam(rid)]
        if searches:
            self.scheduler.finish_requests(self.beams.expand(list(searches)),
                                           RequestStatus.FINISHED_ERROR)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        if self.pooling is not None:
            self.pooling.forget(ids)
        return self.outputs.error_outputs(ids + sorted(searches), message, status)

    # ------------------------------------------------------------ state
    def warmup(self) -> None:
        """Requests end to end before serving, so the first user request pays no first-call
        costs (startup.warm_up_requests)."""
        startup.warm_up_requests(self, WARMUP_PREFILL_TOKENS)
        self.reset_prefix_cache()  # AllBlocksCleared: a router forgets what it knew of this pod
        self.kv.reset_counters()
        self.prompt_tokens = self.generation_tokens = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (refused while requests hold blocks); announced at once."""
        done = self.kv.reset_prefix_cache()
        self._publish_kv_events()
        return done

    def stats(self) -> dict[str, Any]:
        """The counters and gauges the metrics read after every step."""
        s = self.scheduler.stats()
        s.update(prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
                 last_step_tokens=self.last_step_tokens,
                 block_size=self.config.block_size, num_kv_blocks=self.num_kv_blocks)
        if self.lora is not None:
            s.update(self.lora_stats())
        if self.spec is not None:
            s.update(self.spec.stats())
        if self.kv_tier is not None:
            s.update(self.kv_tier.stat_dict())
        return s
