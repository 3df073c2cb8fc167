"""The metrics of a served model: engine stats and each output's timestamps into the families
of metric_families.py (the names vLLM uses; docs/kserve.md). `MetricsObserver` is the engine
loop's step callback; `EngineMetrics` turns a stats snapshot into gauges and counters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from kserve_paged.metric_families import FINISH_REASONS, MAX_LORA, families

if TYPE_CHECKING:  # annotations only: importing the engine package would load torch
    from kserve_paged_engine.frontend.async_llm import StepInfo
    from kserve_paged_engine.outputs import RequestOutput

# Engine stats keys (LLM.stats()) -> gauge attribute / counter attribute.
GAUGE_STATS = {"num_running": "num_requests_running", "num_waiting": "num_requests_waiting",
               "kv_usage": "kv_cache_usage_perc",
               "kv_slots_allocated": "kv_slots_reserved", "kv_slots_used": "kv_slots_holding_tokens",
               "kv_blocks_shared": "kv_blocks_shared"}
COUNTER_STATS = {"prefix_cache_queries": "prefix_cache_queries",
                 "prefix_cache_hits": "prefix_cache_hits",
                 "num_preemptions": "num_preemptions", "prompt_tokens": "prompt_tokens",
                 "generation_tokens": "generation_tokens", "kv_cow_copies": "kv_cow_copies",
                 "spec_decode_num_drafts": "spec_decode_num_drafts",
                 "spec_decode_num_draft_tokens": "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens": "spec_decode_num_accepted_tokens"}
# Engine stats keys of the second KV tier -> counter attribute (label tier "1:fs"), and its gauge.
TIER_COUNTER_STATS = {f"kv_tier_{k}": f"kv_tier_{k}" for k in (
    "block_queries", "block_hits", "read_bytes", "write_bytes", "read_time", "write_time",
    "corrupt_blocks")}
TIER_GAUGE_STATS = {"kv_tier_usage": "kv_tier_usage"}
# Engine stats keys of preemption by swap (a tier on) -> attribute, labelled by model only.
SWAP_COUNTER_STATS = {"kv_swap_outs": "num_swap_outs", "kv_swap_ins": "num_swap_ins"}
SWAP_GAUGE_STATS = {"num_requests_swapped": "num_requests_swapped"}
TIER = "1:fs"
# The host-memory tier on a GPU (engine/kserve_paged_engine/core/kv_tier/host.py): the same families, label "0:CPU"
# (ours: the level above the first fs tier), no corrupt reads (nothing there is read from disk).
HOST_TIER = "0:CPU"
HOST_COUNTER_STATS = {f"kv_host_tier_{k}": f"kv_tier_{k}" for k in (
    "block_queries", "block_hits", "read_bytes", "write_bytes", "read_time", "write_time")}
HOST_GAUGE_STATS = {"kv_host_tier_usage": "kv_tier_usage"}
# Engine stats key of the kept drafts by position (a list, one counter series per position).
PER_POS_STAT = "spec_decode_num_accepted_tokens_per_pos"


class EngineMetrics:
    """The metrics of one served model (label ``model_name``).

    Instantiating it twice, for the same or another model, reuses the registry's families."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self._f = families(registry)
        self._last: dict[str, float] = {}
        self._cache_config: tuple[str, str] | None = None
        self._lock = threading.Lock()
        f = self._f
        # Create every labelled child now, so a scrape shows all series before the first request.
        self._gauges = {key: getattr(f, attr).labels(model_name) for key, attr in GAUGE_STATS.items()}
        self._counters = {key: getattr(f, attr).labels(model_name)
                          for key, attr in COUNTER_STATS.items()}
        self._ttft = f.time_to_first_token.labels(model_name)
        self._itl = f.inter_token_latency.labels(model_name)
        self._e2e = f.e2e_request_latency.labels(model_name)
        self._queue = f.request_queue_time.labels(model_name)
        self._iteration_tokens = f.iteration_tokens.labels(model_name)
        self._success = {r: f.request_success.labels(model_name, r) for r in FINISH_REASONS}
        self._prompt_tokens = f.request_prompt_tokens.labels(model_name)
        self._generation_tokens = f.request_generation_tokens.labels(model_name)
        self._inference_time = f.request_inference_time.labels(model_name)
        self._prefill_time = f.request_prefill_time.labels(model_name)
        self._decode_time = f.request_decode_time.labels(model_name)
        f.spec_decode_num_accepted_tokens_per_pos.labels(model_name, "0")  # shown from the start
        f.num_requests_rejected.labels(model_name, "queue_full")
        f.num_requests_timed_out.labels(model_name)
        self._lora_labels = (str(MAX_LORA), "", "")
        self._lora_info = f.lora_requests_info.labels(*self._lora_labels)
        self._lora_info.set_to_current_time()

    def update(self, stats: Mapping[str, Any], *, counters: bool = True) -> None:
        """Apply an engine stats dict (``LLM.stats()``): gauges are set; counters take the
        increase of the cumulative counts since the last call (a count that went down means the
        engine restarted, and counts from zero again). Keys absent from ``stats`` are left alone.

        Counters must be fed from one thread, in the engine's order: a snapshot applied after a
        newer one would read as a restart and be counted twice. Other callers pass
        ``counters=False`` (gauges only)."""
        with self._lock:
            if "kv_tier_usage" in stats and "kv_tier_usage" not in self._gauges:
                self._add_tier_series(TIER, TIER_COUNTER_STATS, TIER_GAUGE_STATS)
            if "kv_host_tier_usage" in stats and "kv_host_tier_usage" not in self._gauges:
                self._add_tier_series(HOST_TIER, HOST_COUNTER_STATS, HOST_GAUGE_STATS)
            for key, child in self._gauges.items():
                if stats.get(key) is not None:
                    child.set(float(stats[key]))
            if not counters:
                return
            for key, child in self._counters.items():
                if stats.get(key) is None:
                    continue
                value = float(stats[key])
                last = self._last.get(key, 0.0)
                increase = value - last if value >= last else value
                if increase > 0:
                    child.inc(increase)
                self._last[key] = value
            for pos, value in enumerate(stats.get(PER_POS_STAT) or ()):
                key = f"{PER_POS_STAT}:{pos}"
                last = self._last.get(key, 0.0)
                increase = value - last if value >= last else value
                if increase > 0:
                    self._f.spec_decode_num_accepted_tokens_per_pos.labels(
                        self.model_name, str(pos)).inc(increase)
                self._last[key] = float(value)

    def _add_tier_series(self, tier: str, counters: Mapping[str, str],
                         gauges: Mapping[str, str]) -> None:
        """A tier's series, only while it is on (as vLLM's); the swap series with the first."""
        f, name = self._f, self.model_name
        self._gauges |= {k: getattr(f, a).labels(name, tier) for k, a in gauges.items()}
        self._counters |= {k: getattr(f, a).labels(name, tier) for k, a in counters.items()}
        self._gauges |= {k: getattr(f, a).labels(name) for k, a in SWAP_GAUGE_STATS.items()}
        self._counters |= {k: getattr(f, a).labels(name) for k, a in SWAP_COUNTER_STATS.items()}

    def count_rejected(self, reason: str) -> None:
        """A request refused before it was queued (``reason``: queue_full)."""
        self._f.num_requests_rejected.labels(self.model_name, reason).inc()

    def count_timed_out(self) -> None:
        """A request aborted at its deadline."""
        self._f.num_requests_timed_out.labels(self.model_name).inc()

    def set_cache_config(self, block_size: int, num_gpu_blocks: int) -> None:
        """``vllm:cache_config_info{block_size, num_gpu_blocks}`` = 1 (one series per model)."""
        labels = (str(block_size), str(num_gpu_blocks))
        with self._lock:
            info = self._f.cache_config_info
            if self._cache_config is not None and self._cache_config != labels:
                info.remove(self.model_name, *self._cache_config)
            info.labels(self.model_name, *labels).set(1)
            self._cache_config = labels

    def observe_time_to_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_inter_token_latency(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_e2e_request_latency(self, seconds: float) -> None:
        self._e2e.observe(seconds)

    def observe_request_queue_time(self, seconds: float) -> None:
        self._queue.observe(seconds)

    def observe_iteration_tokens(self, num_tokens: int) -> None:
        self._iteration_tokens.observe(num_tokens)

    def touch_lora_info(self, stats: Mapping[str, Any] | None = None) -> None:
        """vLLM sets ``vllm:lora_requests_info`` to the current time at every engine step,
        labelled with the adapters of running and waiting requests (the engine's stats); one
        series is kept, the one with the current labels."""
        stats = stats or {}
        labels = (str(stats.get("max_lora", self._lora_labels[0])),
                  str(stats.get("waiting_lora_adapters", self._lora_labels[1])),
                  str(stats.get("running_lora_adapters", self._lora_labels[2])))
        with self._lock:
            if labels != self._lora_labels:
                self._f.lora_requests_info.remove(*self._lora_labels)
                self._lora_labels = labels
                self._lora_info = self._f.lora_requests_info.labels(*labels)
            self._lora_info.set_to_current_time()

    def observe_finished(self, reason: str, num_prompt_tokens: int | None = None,
                         num_generation_tokens: int | None = None,
                         phases: tuple[float, float, float] | None = None) -> None:
        """A request ended: ``vllm:request_success_total{finished_reason}``, and for one that
        produced an output, its token counts and (prefill, decode, inference) seconds."""
        child = self._success.get(reason)
        if child is None:
            raise ValueError(f"unknown finish reason {reason!r} (known: {FINISH_REASONS})")
        child.inc()
        if num_prompt_tokens is not None:
            self._prompt_tokens.observe(num_prompt_tokens)
        if num_generation_tokens is not None:
            self._generation_tokens.observe(num_generation_tokens)
        if phases is not None:
            prefill, decode, inference = phases
            self._prefill_time.observe(prefill)
            self._decode_time.observe(decode)
            self._inference_time.observe(inference)


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
        m.touch_lora_info(info.stats)
        if info.stepped and info.num_tokens > 0:
            m.observe_iteration_tokens(info.num_tokens)
        for out in info.outputs:
            self._observe(out)
        for rid in info.aborted:  # client gone or shutdown: ended without a final output
            self._last_token.pop(rid, None)
            m.observe_finished("abort")

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
            self._observe_finished(out)

    def _observe_finished(self, out: RequestOutput) -> None:
        """vLLM's per-request figures: phases from first scheduling to first token (prefill)
        and from first to last token (decode). With n > 1 the samples count as one request."""
        t = out.metrics
        assert t is not None
        reason = next((c.finish_reason for c in out.outputs if c.finish_reason), None)
        phases = None
        if (t.first_scheduled_time is not None and t.first_token_time is not None
                and t.last_token_time is not None):
            phases = (t.first_token_time - t.first_scheduled_time,
                      t.last_token_time - t.first_token_time,
                      t.last_token_time - t.first_scheduled_time)
        self.metrics.observe_finished(
            reason if reason in FINISH_REASONS else "error", len(out.prompt_token_ids),
            sum(len(c.token_ids) for c in out.outputs), phases)
