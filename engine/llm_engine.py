"""The synchronous engine: requests in, one scheduler step + model forward per `step()`."""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.beam_search import BeamGroup, BeamSearches
from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_event_publisher import ZmqEventPublisher
from engine.core.kv_events import KVEventsConfig
from engine.core.kv_groups import kv_layout
from engine.core.kv_sizing import resolve_device, resolve_dtype, size_kv_cache
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.detokenizer import IncrementalDetokenizer
from engine.limits import check_prompt_ids
from engine.lora import LoRAManager, LoRARequest
from engine.model_executor.model_loader import load_model, load_tokenizer
from engine.model_info import ModelInfo
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.parallel_sampling import SampleGroups
from engine.sample.logits_processors import apply_penalties
from engine.sample.logprobs import record_prompt, sampled_entries
from engine.sample.sampler import Sampler, make_generator
from engine.sample.structured_output import GrammarBitmask, GrammarCompiler, RequestGrammar
from engine.sampling_params import SamplingParams
from engine.spec_decode.decoder import SpecDecoder, SpecRow
from engine.spec_decode.draft_model import DraftModelProposer, load_draft_model
from engine.worker.cpu_memory import tune_glibc_malloc
from engine.worker.model_runner import ModelRunner
from engine.worker.tp_executor import TPWorkerError, TPWorkers

logger = logging.getLogger("engine")

@dataclass(slots=True)
class _Tracked:
    """Engine-side state of a live request beyond what the scheduler keeps."""

    request: Request
    prompt: str | None
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    sent_tokens: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: dict[int, dict[int, Logprob]] = field(default_factory=dict)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        config = config or EngineConfig(**kwargs)
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cpu":
            tune_glibc_malloc()  # no-op under tcmalloc (see engine.worker.cpu_memory)
        from engine.default_model import PACKAGED_MODELS, ensure_default_model, ensure_model

        if config.model is None:
            self.model_path = str(ensure_default_model(progress=logger.info))
        elif config.model in PACKAGED_MODELS and not os.path.exists(config.model):
            # A packaged model's id (e.g. gemma3-270m): provisioned and converted once.
            self.model_path = str(ensure_model(config.model, progress=logger.info))
        else:
            self.model_path = str(config.model)
        t0 = time.monotonic()
        logger.info("loading %s (%s on %s)", self.model_path, self.dtype, self.device)
        tp = config.tensor_parallel_size
        self.workers = TPWorkers.acquire(tp, self.device) if tp > 1 else None
        loader = self.workers.load_model if self.workers is not None else load_model
        self.model, self.hf_config = loader(self.model_path, self.dtype, self.device,
                                            config.load_format, config.seed)
        self.tokenizer = load_tokenizer(self.model_path)
        logger.info("weights loaded in %.1f s", time.monotonic() - t0)

        spec = config.speculative_config
        draft_model = None
        if spec is not None and spec.method == "draft_model":
            draft_model = load_draft_model(spec, self.model.vocab_size, self.tokenizer,
                                           self.dtype, self.device, config.seed)
        bs = config.block_size
        # KV groups (engine/kv_groups.py): global and sliding layers get their own tables, so
        # a sliding layer holds only its window; tensor parallelism ships one table per step.
        windows = list(getattr(self.model, "layer_windows", None) or [None] * self.model.num_layers)
        self.kv_layout = kv_layout(windows, per_group=tp == 1
                                   and not config.disable_hybrid_kv_cache_manager)
        per_block = ModelRunner.kv_bytes_per_block(self.model, bs, self.dtype, self.kv_layout)
        if draft_model is not None:  # one budget: the draft's cache gets as many blocks
            per_block += ModelRunner.kv_bytes_per_block(draft_model, bs, self.dtype)
        self.num_kv_blocks = size_kv_cache(config, per_block, self.device)
        max_len = config.max_model_len or self.model.max_position_embeddings
        chunk = config.max_num_batched_tokens
        fits = self._longest_fit(max_len, chunk)
        if fits < max_len:
            logger.warning("max_model_len %d exceeds the KV cache (%d blocks of %d tokens hold "
                           "one request of %d tokens): capping it", max_len,
                           self.num_kv_blocks, bs, fits)
            max_len = fits
        self.model.check_max_model_len(max_len)
        self.max_model_len = max_len
        per_request = self.kv_layout.blocks_to_hold(max_len, bs, chunk)
        groups = self.kv_layout.group_windows
        logger.info("KV cache: %d blocks of %d tokens x %d layers, %.1f MiB%s; %d concurrent "
                    "sequences of max_model_len %d (%d blocks each%s)", self.num_kv_blocks, bs,
                    self.kv_layout.group_size, self.num_kv_blocks * per_block / 2**20,
                    f" per rank x {tp} ranks ({self.model.num_kv_heads} KV heads on rank 0)"
                    if tp > 1 else "", self.num_kv_blocks // per_request, max_len, per_request,
                    f" over {len(groups)} KV groups, windows {groups}" if len(groups) > 1
                    else "")

        self.kv = KVCacheManager(self.num_kv_blocks, bs, config.enable_prefix_caching,
                                 hash_algo=config.prefix_caching_hash_algo,
                                 group_windows=self.kv_layout.group_windows)
        self.kv_events = self._kv_event_publisher()
        self.scheduler = Scheduler(config, self.kv, max_len)
        self.runner = ModelRunner(self.model, self.kv, self.num_kv_blocks, bs, self.dtype,
                                  self.device, max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_num_seqs=config.max_num_seqs, max_model_len=max_len,
                                  layout=self.kv_layout)
        if self.workers is not None:  # each worker: its share of every block, same ids
            self.workers.allocate(num_blocks=self.num_kv_blocks, block_size=bs, dtype=self.dtype,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_num_seqs=config.max_num_seqs, max_model_len=max_len)
            self.runner.workers = self.workers
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            self.lora = self.runner.lora = LoRAManager(
                self.model, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                max_cpu_loras=config.max_cpu_loras or config.max_loras)
        self.sampler = Sampler(config.seed)
        draft = None if draft_model is None else DraftModelProposer(
            draft_model, spec.num_speculative_tokens, self.num_kv_blocks, bs, self.dtype,
            self.device, max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, max_model_len=max_len)
        self.spec = SpecDecoder(spec, draft) if spec is not None else None
        self.eos_token_id, self._extra_eos = self._eos_ids()
        stop_ids = [t for t in [self.eos_token_id, *self._extra_eos] if t is not None]
        self.grammars = GrammarCompiler(self.tokenizer, self.model.vocab_size, stop_ids)
        self._bitmask = GrammarBitmask(self.model.vocab_size)
        self._compiling: list[Request] = []  # queued, their grammar not compiled yet
        self._live: dict[str, _Tracked] = {}
        self._groups = SampleGroups()
        self._beams = BeamSearches()
        self._counter = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.last_step_tokens = 0  # tokens computed by the last step (vLLM's iteration tokens)
        # Test-only fault injection: called with the step's request ids before the forward.
        self.fault_hook: Callable[[list[str]], None] | None = None

    def _longest_fit(self, max_len: int, chunk: int) -> int:
        """The longest request (at most `max_len` tokens) the KV cache holds alone."""
        bs, blocks = self.config.block_size, self.num_kv_blocks
        if self.kv_layout.blocks_to_hold(max_len, bs, chunk) <= blocks:
            return max_len
        lo, hi = 0, max_len  # blocks_to_hold grows with the length
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.kv_layout.blocks_to_hold(mid, bs, chunk) <= blocks \
                else (lo, mid - 1)
        return lo

    def _kv_event_publisher(self) -> ZmqEventPublisher | None:
        """The publisher of KV-cache events, when --kv_events_config switches them on."""
        cfg = self.config.kv_events_config
        if not isinstance(cfg, KVEventsConfig) or not cfg.publishes:
            return None
        if not self.config.enable_prefix_caching:
            logger.warning("KV-cache events are on but prefix caching is off: nothing is cached, "
                           "so only AllBlocksCleared will ever be published")
        hasher = self.kv.hasher
        if hasher.algo != "sha256_cbor" or hasher.seed is None:
            logger.info("KV-cache events announce %s block hashes (PYTHONHASHSEED %s): a router "
                        "that recomputes vLLM's keys from prompts needs sha256_cbor and the "
                        "seed (docs/operations.md)", hasher.algo,
                        "unset" if hasher.seed is None else "set")
        self.kv.pool.record_events()
        return ZmqEventPublisher(cfg, medium="GPU" if self.device.type == "cuda" else "CPU")

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.kv.pool.take_events())

    def close(self) -> None:
        """Release what outlives a step (the event socket, tensor-parallel workers); the engine
        is not used after."""
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def on_fatal(self, callback: Callable[[BaseException], None]) -> None:
        """`callback(error)`, from another thread, when the engine can no longer step (a
        tensor-parallel worker died): AsyncLLM fails everything at once, even while idle."""
        if self.workers is not None:
            self.workers.on_death = callback

    def _eos_ids(self) -> tuple[int | None, list[int]]:
        ids: list[int] = []
        try:
            from transformers import GenerationConfig

            gen_eos = GenerationConfig.from_pretrained(self.model_path,
                                                       local_files_only=True).eos_token_id
        except Exception:  # noqa: BLE001 - a folder without generation_config.json is fine
            gen_eos = None
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            ids.append(int(tok_eos))
        for e in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if e is not None and int(e) not in ids:
                ids.append(int(e))
        if not ids:
            return None, []
        return ids[0], ids[1:]

    def model_info(self) -> ModelInfo:
        """What a server may know of this engine (AsyncLLM.model_info hands it on)."""
        return ModelInfo(model_path=self.model_path, tokenizer=self.tokenizer,
                         max_model_len=self.max_model_len, vocab_size=self.model.vocab_size,
                         block_size=self.config.block_size, num_kv_blocks=self.num_kv_blocks,
                         has_chat_template=bool(getattr(self.tokenizer, "chat_template", None)))

    # ------------------------------------------------------------ requests
    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))

    def add_request(self, request_id: str, prompt: str | list[int] | dict[str, Any],
                    params: SamplingParams | None = None, *, priority: int = 0,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request; raises ValueError (nothing allocated) if it can never run."""
        params = params or SamplingParams()
        if lora_request is not None:
            if self.lora is None:
                raise ValueError(f"LoRA adapter {lora_request.lora_name!r} requested but LoRA "
                                 "is not enabled (enable_lora=True)")
            self.lora.add(lora_request)  # loads and checks it before anything is queued
        text: str | None = None
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
        if isinstance(prompt, str):
            text = prompt
            token_ids = self.tokenize(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        check_prompt_ids(token_ids, self.model.vocab_size)
        if self._extra_eos and not params.ignore_eos:
            params = _with_stop_ids(params, self._extra_eos)
        if request_id in self._groups or request_id in self._beams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.use_beam_search:  # one request; beams fork from it (beam_search.py)
            root = self._add_one(request_id, token_ids, text, params, priority, cache_salt,
                                 arrival_time, lora_request)
            self._beams.start(root, self.max_model_len)
            return
        if params.n == 1:
            self._add_one(request_id, token_ids, text, params, priority, cache_salt,
                          arrival_time, lora_request)
            return
        # n parallel samples: the first child computes the prompt, the others fork from it
        # when it samples its first token (sample_groups.py), sharing every prompt block.
        children = SampleGroups.children(request_id, params)
        if params.max_tokens == 0:  # nothing is sampled, so nothing to fork from: n scorings
            for child, child_params in children:
                self._add_one(child, token_ids, text, child_params, priority, cache_salt,
                              arrival_time, lora_request)
            self._groups.register(request_id, [child for child, _ in children], pending=[])
            return
        (first, first_params), rest = children[0], children[1:]
        self._add_one(first, token_ids, text, first_params, priority, cache_salt, arrival_time,
                      lora_request)
        self._groups.register(request_id, [child for child, _ in children], pending=rest)

    def _add_one(self, request_id: str, token_ids: list[int], text: str | None,
                 params: SamplingParams, priority: int, cache_salt: str | None,
                 arrival_time: float | None, lora_request: LoRARequest | None = None
                 ) -> Request:
        request = Request(request_id, token_ids, params, eos_token_id=self.eos_token_id,
                          priority=priority, cache_salt=cache_salt, lora_request=lora_request)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.scheduler.add_request(request)  # raises on duplicates and over-long prompts
        if params.structured_outputs is not None:
            request.grammar = RequestGrammar(self.grammars.submit(params.structured_outputs))
            self._compiling.append(request)
        self._live[request_id] = _Tracked(
            request, text, IncrementalDetokenizer(self.tokenizer, token_ids, params),
            make_generator(params.seed), metrics=RequestMetrics(request.arrival_time))
        return request

    # ------------------------------------------------------------ adapters
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (ValueError if it is bad or LoRA is off)."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled (enable_lora=True)")
        self.lora.add(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.lora is not None and self.lora.remove(lora_int_id)

    def list_loras(self) -> list[int]:
        return self.lora.loaded_ids() if self.lora is not None else []

    def lora_stats(self) -> dict[str, Any]:
        """vLLM's lora_requests_info labels: adapters of running and waiting requests."""
        def names(requests) -> str:
            return ",".join(sorted({r.lora_request.lora_name for r in requests
                                    if r.lora_request is not None}))
        return {"running_lora_adapters": names(self.scheduler.running),
                "waiting_lora_adapters": names(self.scheduler.waiting),
                "max_lora": self.config.max_loras if self.lora is not None else 0}

    def next_request_id(self) -> str:
        self._counter += 1
        return f"req-{self._counter}"

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        expanded = self._beams.expand(self._groups.expand(request_ids))
        self.scheduler.finish_requests(expanded, RequestStatus.FINISHED_ABORTED)
        for rid in expanded + request_ids:
            self._live.pop(rid, None)
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
        failed = self._start_compiled_grammars()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self._beams.is_beam, self._generator_of)
        out = self.scheduler.schedule()
        for req, why in out.unschedulable:
            failed += self._fail([req], why)
        self.last_step_tokens = out.total_num_scheduled_tokens
        if out.is_empty:
            if self._compiling and not failed:  # nothing to run until a grammar is ready
                concurrent.futures.wait([r.grammar.future for r in self._compiling],
                                        timeout=0.05, return_when="FIRST_COMPLETED")
            return self._groups.merge(failed)
        now = time.monotonic()
        for req in out.scheduled:
            tracked = self._live.get(req.request_id) or self._live[req.group_id]
            if tracked.metrics.first_scheduled_time is None:
                tracked.metrics.first_scheduled_time = now
                self.prompt_tokens += req.num_prompt_tokens
        children: list[Request] = []
        beam_groups: dict[str, BeamGroup] = {}
        try:
            if self.fault_hook is not None:
                self.fault_hook([r.request_id for r in out.scheduled])
            result = self.runner.execute(out)
            logits, sampling = result.logits, result.sampling
            if result.prompt_logits is not None:
                record_prompt(result.prompt_logits, result.prompt_spans,
                              lambda r: self._live[r.request_id].prompt_logprobs,
                              self.tokenizer.decode)
            # Rows that sample: every non-beam request, plus a row of its parent's logits for
            # each n > 1 sample forked now that the prompt is computed. Beams only report.
            rows: list[int] = []
            to_sample: list[Request] = []
            spec_rows: list[SpecRow] = []  # requests with drafts: 1 + drafts rows each
            i = -1
            for r in sampling:
                i += 1
                if r.request_id in out.spec_tokens:
                    spec_rows.append(SpecRow(r, i, out.spec_tokens[r.request_id]))
                    i += len(spec_rows[-1].drafts)
                    continue
                if self._beams.is_beam(r.request_id):
                    group = self._beams.report(r, logits[i])
                    beam_groups[group.group_id] = group
                    continue
                rows.append(i)
                to_sample.append(r)
                for child in self._fork_samples(r, out.num_scheduled_tokens[r.request_id]):
                    children.append(child)
                    rows.append(i)
                    to_sample.append(child)
            verified = self._verify(logits, spec_rows)
            if to_sample:
                if rows != list(range(len(logits))):
                    logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
                tracks = [self._live[r.request_id] for r in to_sample]
                params = [r.sampling_params for r in to_sample]
                processed = apply_penalties(logits, params,
                                            [r.prompt_token_ids for r in to_sample],
                                            [r.output_token_ids for r in to_sample])
                processed = self._bitmask.apply(processed, [r.grammar for r in to_sample])
                token_tensor = self.sampler.sample(
                    processed, params, [t.generator for t in tracks],
                    [r.num_output_tokens for r in to_sample],
                    [r.eos_token_id for r in to_sample])
                for i, entry, chosen in sampled_entries(logits, token_tensor, to_sample,
                                                        self.tokenizer.decode):
                    tracks[i].logprobs.append(entry)
                    tracks[i].cumulative_logprob += chosen
                tokens = token_tensor.tolist()
            else:
                tokens = []
        except TPWorkerError:
            raise  # the ranks are out of step: fatal to the engine, not to these requests
        except Exception as exc:  # noqa: BLE001 - contain the fault to this step's requests
            logger.exception("engine step failed; failing its %d requests", len(out.scheduled))
            return self._groups.merge(
                failed + self._fail(out.scheduled + children, f"{type(exc).__name__}: {exc}"))
        sampled = {r.request_id: t for r, t in zip(to_sample, tokens)}
        rejected = self._accept_grammar_tokens(to_sample, sampled)
        for spec in spec_rows:
            sampled[spec.request.request_id] = verified[spec.request.request_id].pop(0)
        to_sample += [spec.request for spec in spec_rows]
        self.generation_tokens += len(sampled) + sum(map(len, verified.values()))
        ended = self.scheduler.update_from_output(out, sampled, self._observe_token, verified)
        for child in children:  # forked after the step: not in its schedule
            if child.request_id in sampled:
                self.scheduler.accept_token(child, sampled[child.request_id],
                                            self._observe_token)
        now = time.monotonic()
        outputs = failed
        if rejected:
            outputs += self._fail(rejected, "the sampled token broke the request's "
                                  "structured-output grammar")
        for req in to_sample:
            if req.request_id not in sampled:
                continue
            tracked = self._live[req.request_id]
            m = tracked.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            outputs.append(self._make_output(tracked, now))
        # Requests that ended without sampling: max_tokens=0 once the prompt is scored.
        outputs.extend(self._make_output(self._live[r.request_id], now) for r in ended
                       if r.request_id not in sampled and r.request_id in self._live)
        for group in beam_groups.values():
            if self._beams.ready(group, self.scheduler.requests):
                self.generation_tokens += len(group.beams)
                if self._beams.advance(group, self.scheduler):
                    outputs.append(self._beam_output(group, now))
        return self._groups.merge(outputs)

    def _generator_of(self, request: Request) -> torch.Generator:
        return self._live[request.request_id].generator or self.sampler.generator

    def _verify(self, logits: torch.Tensor, spec_rows: list[SpecRow]) -> dict[str, list[int]]:
        """Each speculating request's tokens this step: kept drafts, then one more."""
        if not spec_rows:
            return {}
        tokens = self.spec.verify(logits, spec_rows,
                                  [self._live[s.request.request_id] for s in spec_rows],
                                  self.sampler.generator, self.tokenizer.decode)
        return {s.request.request_id: t for s, t in zip(spec_rows, tokens)}

    def _start_compiled_grammars(self) -> list[RequestOutput]:
        """Give each request whose grammar finished compiling its matcher (the scheduler
        then admits it); fail the requests whose compile failed."""
        if not self._compiling:
            return []
        still, broken = [], []
        for req in self._compiling:
            if req.is_finished or req.request_id not in self._live:
                continue  # aborted while compiling
            if not req.grammar.future.done():
                still.append(req)
                continue
            try:
                req.grammar.start()
            except Exception as exc:  # noqa: BLE001 - this request's grammar only
                logger.warning("grammar compile failed for %s: %s", req.request_id, exc)
                broken.append((req, f"the structured-output grammar did not compile: {exc}"))
        self._compiling = still
        failed: list[RequestOutput] = []
        for req, message in broken:
            failed.extend(self._fail([req], message))
        return failed

    def _accept_grammar_tokens(self, sampling: list[Request], sampled: dict[str, int]
                               ) -> list[Request]:
        """Advance each constrained request's matcher by its sampled token; the requests
        whose token the grammar refused (which the mask should make impossible) are
        returned, their tokens dropped."""
        rejected = []
        for req in sampling:
            if req.grammar is not None and not req.grammar.matcher.accept_token(
                    sampled[req.request_id]):
                rejected.append(req)
                del sampled[req.request_id]
        return rejected
    def _fork_samples(self, parent: Request, num_scheduled: int) -> list[Request]:
        """Fork the other samples of an n > 1 request from its first, whose prompt this step
        computed: they share all of its blocks, the partial last one until written."""
        pending = self._groups.take_pending(parent.request_id)
        if not pending:
            return []
        src = self._live[parent.request_id]
        computed = parent.num_computed_tokens + num_scheduled
        children = []
        for child_id, params in pending:
            child = self.scheduler.fork(parent, child_id, params, num_computed=computed)
            if parent.grammar is not None:  # forked before any output: a fresh matcher
                child.grammar = RequestGrammar(parent.grammar.future)
                child.grammar.start()
            self._live[child_id] = _Tracked(
                child, src.prompt,
                IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, params),
                make_generator(params.seed), metrics=dataclasses.replace(src.metrics),
                prompt_logprobs=dict(src.prompt_logprobs))
            children.append(child)
        return children

    def _beam_output(self, group: BeamGroup, now: float) -> RequestOutput:
        """The final output of a beam search: the n best hypotheses, best first."""
        tracked = self._live.pop(group.group_id)
        tracked.metrics.first_token_time = tracked.metrics.first_token_time or now
        tracked.metrics.last_token_time = tracked.metrics.finished_time = now
        params = group.params
        completions = []
        for i, h in enumerate(group.finished[:params.n]):
            text = self.tokenizer.decode(h.token_ids,
                                         skip_special_tokens=params.skip_special_tokens)
            completions.append(CompletionOutput(
                index=i, text=text, token_ids=h.token_ids, finish_reason=h.finish_reason,
                delta_text=text, delta_token_ids=list(h.token_ids),
                cumulative_logprob=h.cum_logprob, score=h.score))
        req = tracked.request
        return RequestOutput(group.group_id, tracked.prompt, req.prompt_token_ids, completions,
                             True, max(req.num_cached_tokens, 0),
                             dataclasses.replace(tracked.metrics))

    def _observe_token(self, req: Request, ended_by_token: bool) -> str | None:
        """The scheduler's stop-string check: feed the new token to the request's detokenizer
        and say which stop string, if any, its text now ends in."""
        detok = self._live[req.request_id].detok
        detok.update([req.output_token_ids[-1]], stop_terminated=ended_by_token,
                     check_stop=req.past_min_tokens)
        return detok.stop_reason if detok.stopped else None

    def _make_output(self, tracked: _Tracked, now: float) -> RequestOutput:
        req = tracked.request
        finished = req.is_finished
        delta_ids = req.output_token_ids[tracked.sent_tokens:]
        tracked.sent_tokens = req.num_output_tokens
        if finished:
            tracked.metrics.finished_time = now
            del self._live[req.request_id]
        # Copies: outputs cross to the event loop's thread while the engine keeps going.
        completion = CompletionOutput(
            index=0, text=tracked.detok.output_text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            delta_text=tracked.detok.get_delta(finished), delta_token_ids=delta_ids)
        if req.sampling_params.logprobs is not None:
            completion.logprobs = list(tracked.logprobs)
            completion.cumulative_logprob = tracked.cumulative_logprob
        out = RequestOutput(req.request_id, tracked.prompt, req.prompt_token_ids, [completion],
                            finished, max(req.num_cached_tokens, 0),
                            dataclasses.replace(tracked.metrics))
        if req.sampling_params.prompt_logprobs is not None:
            # vLLM's shape: None for the first prompt token, then one dict per token.
            out.prompt_logprobs = [None] + [tracked.prompt_logprobs.get(p)
                                            for p in range(1, req.num_prompt_tokens)]
        return out

    def _fail(self, requests: list[Request], message: str) -> list[RequestOutput]:
        ids = [r.request_id for r in requests if not r.is_finished]
        # A failing beam fails its whole search: one error output under the group's id.
        groups = {g for g in map(self._beams.group_of, ids) if g is not None}
        ids = [rid for rid in ids if not self._beams.is_beam(rid)]
        self.scheduler.finish_requests(self._beams.expand(list(groups)),
                                       RequestStatus.FINISHED_ERROR)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        now = time.monotonic()
        outputs = []
        for rid in ids + sorted(groups):
            tracked = self._live.get(rid)
            if tracked is None:
                continue
            out = self._make_output(tracked, now)
            out.error = message
            outputs.append(out)
            # Samples not forked yet end with it (their group waits for every sample).
            for child_id, _ in self._groups.take_pending(rid):
                outputs.append(RequestOutput(
                    child_id, out.prompt, out.prompt_token_ids,
                    [CompletionOutput(0, "", [], finish_reason="error")], True, error=message))
        return outputs

    # ------------------------------------------------------------ state
    def warmup(self) -> None:
        """Run one tiny request end to end so the first user request pays no first-call costs."""
        rid = "__warmup__"
        self.add_request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=2, ignore_eos=True))
        while self.has_unfinished_requests():
            self.step()
        self.reset_prefix_cache()  # AllBlocksCleared: a router forgets what it knew of this pod
        self.kv.prefix_cache_queries = self.kv.prefix_cache_hits = 0
        self.prompt_tokens = self.generation_tokens = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (refused while requests hold blocks); announced at once."""
        done = self.kv.reset_prefix_cache()
        self._publish_kv_events()
        return done

    def stats(self) -> dict[str, Any]:
        s = self.scheduler.stats()
        s.update(prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
                 last_step_tokens=self.last_step_tokens,
                 block_size=self.config.block_size, num_kv_blocks=self.num_kv_blocks)
        if self.lora is not None:
            s.update(self.lora_stats())
        if self.spec is not None:
            s.update(self.spec.stats())
        return s


def _with_stop_ids(params: SamplingParams, extra: list[int]) -> SamplingParams:
    params = copy.copy(params)
    params.stop_token_ids = list(params.stop_token_ids) + [t for t in extra
                                                           if t not in params.stop_token_ids]
    return params
