"""Prometheus metrics of the kserve-paged server, under the names vLLM uses (docs/kserve.md).

Dashboards, KEDA queries and the Gateway API Inference Extension read these exact names, so they
are a contract: ``vllm:num_requests_running``, ``vllm:prefix_cache_hits_total``, ... each with the
label ``model_name``. They live in prometheus_client's default registry, which KServe serves on
``/metrics``; pass ``registry=`` to use another one (tests do).

prometheus_client details that matter here:
- A Counter's family name drops a ``_total`` suffix and its samples add it back, so
  ``Counter("vllm:prompt_tokens_total")`` exposes ``vllm:prompt_tokens_total`` (and
  ``vllm:prompt_tokens_created``). Histograms expose ``_bucket``, ``_sum``, ``_count`` and
  ``_created``. :func:`exposed_sample_names` lists every name a scrape can contain.
- Its OpenMetrics encoder (0.2x, client_python issue #1177) turns ``:`` into ``_`` in sample lines
  unless the scraper asked for ``escaping=allow-utf-8``; Prometheus 2.x asks for OpenMetrics
  without it. :func:`render` negotiates the format without that defect.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import exposition as _exposition

if TYPE_CHECKING:  # annotations only: importing the engine package would load torch
    from engine.async_llm import StepInfo
    from engine.outputs import RequestOutput

LABELS = ("model_name",)

# Bucket bounds follow vLLM's, so its dashboards' quantiles read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Token counts per request: vLLM's 1, 2, 5, 10, 20, 50, ... series, which it stops at
# max_model_len. One registry serves every model, so the series runs to the largest context
# any model could have; for a given max_model_len the buckets past it only ever hold the total,
# and quantiles read the same as vLLM's.
TOKEN_BUCKETS = tuple(m * 10**e for e in range(8) for m in (1, 2, 5))

# Finish reasons (engine.core.request.RequestStatus values; "error" is this engine's own, vLLM has
# the other three). Every series exists from the start, so rates work before the first error.
FINISH_REASONS = ("stop", "length", "abort", "error")
# vllm:lora_requests_info before the engine reports adapters (and without LoRA): none, max_lora 0.
# The gateway's endpoint picker reads this gauge for adapter affinity.
MAX_LORA = 0
LORA_LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")

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
# Engine stats key of the kept drafts by position (a list, one counter series per position).
PER_POS_STAT = "spec_decode_num_accepted_tokens_per_pos"

_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "info": ("_info",),
             "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("", "_sum", "_count", "_created")}


class _Families:
    """The metric families, created once per registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def gauge(name: str, doc: str, labels: Iterable[str] = LABELS) -> Gauge:
            return Gauge(name, doc, list(labels), registry=registry)

        def counter(name: str, doc: str, labels: Iterable[str] = LABELS) -> Counter:
            return Counter(name, doc, list(labels), registry=registry)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, list(LABELS), buckets=list(buckets), registry=registry)

        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter(
            "vllm:num_preemptions_total", "Cumulative number of preemptions from the engine.")
        # Ours (no vLLM equivalent): what block sharing (forks, prefix hits) saves and costs.
        self.kv_blocks_shared = gauge(
            "kserve_paged:kv_blocks_shared",
            "KV blocks saved by sharing: references to a block beyond its first (n > 1 samples, "
            "beams, prefix-cache hits).")
        self.kv_cow_copies = counter(
            "kserve_paged:kv_cow_copies_total",
            "KV blocks copied on write (a shared block about to be written).")
        self.prompt_tokens = counter(
            "vllm:prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens_total", "Number of generation tokens processed.")
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.", REQUEST_BUCKETS)
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in the waiting queue in seconds.", REQUEST_BUCKETS)
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine step.",
            ITERATION_TOKEN_BUCKETS)
        self.request_success = counter(
            "vllm:request_success_total", "Count of successfully processed requests.",
            (*LABELS, "finished_reason"))
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            TOKEN_BUCKETS)
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", REQUEST_BUCKETS)
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", REQUEST_BUCKETS)
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", REQUEST_BUCKETS)
        self.lora_requests_info = gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests (value: time of the last update).", LORA_LABELS)
        # This project's own: how much of the reserved KV memory holds tokens (shared: above).
        self.kv_slots_reserved = gauge(
            "kserve_paged:kv_slots_reserved",
            "KV-cache token slots in blocks held by requests (block_size per block).")
        self.kv_slots_holding_tokens = gauge(
            "kserve_paged:kv_slots_holding_tokens",
            "Reserved KV-cache token slots that hold a token; the rest is partial-block waste.")
        # Speculative decoding (vLLM's names): verified steps that carried drafts, draft tokens,
        # drafts kept (in all and by position). Acceptance rate: accepted / draft tokens.
        self.spec_decode_num_drafts = counter(
            "vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.")
        self.spec_decode_num_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.")
        self.spec_decode_num_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.")
        self.spec_decode_num_accepted_tokens_per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos_total",
            "Accepted tokens per draft position.", (*LABELS, "position"))
        self.cache_config_info = gauge(
            "vllm:cache_config_info", "Information of the KV-cache config (value 1).",
            (*LABELS, "block_size", "num_gpu_blocks"))

    def collectors(self) -> list[Any]:
        return list(vars(self).values())


_families_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = (
    weakref.WeakKeyDictionary())
_families_lock = threading.Lock()


def _families(registry: CollectorRegistry | None) -> _Families:
    registry = REGISTRY if registry is None else registry
    with _families_lock:
        families = _families_by_registry.get(registry)
        if families is None:
            families = _families_by_registry[registry] = _Families(registry)
        return families


class EngineMetrics:
    """The metrics of one served model (label ``model_name``).

    Instantiating it twice, for the same or another model, reuses the registry's families."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self._f = _families(registry)
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


def _described(registry: CollectorRegistry | None) -> list[tuple[str, str]]:
    families = _families(CollectorRegistry() if registry is None else registry)
    return [(m.name, m.type) for c in families.collectors() for m in c.describe()]


def metric_names(registry: CollectorRegistry | None = None) -> frozenset[str]:
    """The names as documented (and as vLLM documents them): gauges and histograms by their
    name, counters with ``_total``. Derived from the collectors this module registers."""
    return frozenset(name + "_total" if kind == "counter" else name
                     for name, kind in _described(registry))


def exposed_sample_names(registry: CollectorRegistry | None = None) -> frozenset[str]:
    """Every sample name a scrape of these metrics can contain (``_bucket``, ``_created``, ...),
    derived from the collectors this module registers. PromQL may use exactly these."""
    return frozenset(name + suffix for name, kind in _described(registry)
                     for suffix in _SUFFIXES[kind])


def render(accept_header: str | None = None,
           registry: CollectorRegistry | None = None) -> tuple[bytes, str]:
    """The body and content type for a ``/metrics`` request with this ``Accept`` header.

    prometheus_client's negotiation, except that OpenMetrics with ``underscores`` escaping (what
    Prometheus 2.x asks for) is answered in the classic text format instead, which keeps the
    ``vllm:`` names intact (see the module docstring)."""
    registry = REGISTRY if registry is None else registry
    encoder, content_type = _exposition.choose_encoder(accept_header or "")
    if content_type.startswith("application/openmetrics-text") and "allow-utf-8" not in content_type:
        return _exposition.generate_latest(registry), _exposition.CONTENT_TYPE_PLAIN_0_0_4
    return encoder(registry), content_type
