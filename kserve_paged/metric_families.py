"""The Prometheus metric families of the kserve-paged server, under the names vLLM uses
(docs/kserve.md), and the exposition of them on ``/metrics`` (metrics.py feeds them).

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
import weakref
from collections.abc import Iterable
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import exposition as _exposition

LABELS = ("model_name",)
# Ours, named in vLLM's style for the dashboards that read vllm:*; vLLM has no such metric.
OWN_VLLM_STYLE = frozenset({"vllm:num_requests_rejected_total", "vllm:num_requests_timed_out_total"})
# vLLM's KV offloading connector's tiering metrics (vllm/v1/kv_offload/tiering): not among its
# core metrics (tests/data/vllm_metrics.json); series only while a second tier is on, label
# `tier` as there ("1:fs", the first secondary tier).
VLLM_OFFLOAD_TIERING = frozenset({
    "vllm:kv_offload_tiering_block_queries_total", "vllm:kv_offload_tiering_block_hits_total",
    "vllm:kv_offload_tiering_read_bytes_total", "vllm:kv_offload_tiering_write_bytes_total",
    "vllm:kv_offload_tiering_read_time_total", "vllm:kv_offload_tiering_write_time_total"})
TIER_LABELS = (*LABELS, "tier")
# Preemption by swap to the second tier (engine/kserve_paged_engine/core/kv_tier/swap.py), series only while a tier is
# on: vLLM V0's gauge of swapped requests, and counters of ours in its style beside
# vllm:num_preemptions_total (V0 counted no swaps; a preemption that did not swap recomputed).
VLLM_STYLE_SWAP = frozenset({"vllm:num_requests_swapped", "vllm:num_swap_outs_total",
                             "vllm:num_swap_ins_total"})

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

# Finish reasons (kserve_paged_engine.core.request.RequestStatus values; "error" is this engine's own, vLLM has
# the other three). Every series exists from the start, so rates work before the first error.
FINISH_REASONS = ("stop", "length", "abort", "error")
# vllm:lora_requests_info before the engine reports adapters (and without LoRA): none, max_lora 0.
# The gateway's endpoint picker reads this gauge for adapter affinity.
MAX_LORA = 0
LORA_LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")

_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "info": ("_info",),
             "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("", "_sum", "_count", "_created")}


class _Families:
    """The metric families, created once per registry (in this order: a scrape lists them so)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._engine_state()
        self._tokens_and_latencies()
        self._per_request()
        self._adapters_slots_and_speculation()
        self._offload_tier()

    def gauge(self, name: str, doc: str, labels: Iterable[str] = LABELS) -> Gauge:
        return Gauge(name, doc, list(labels), registry=self._registry)

    def counter(self, name: str, doc: str, labels: Iterable[str] = LABELS) -> Counter:
        return Counter(name, doc, list(labels), registry=self._registry)

    def histogram(self, name: str, doc: str, buckets: Iterable[float]) -> Histogram:
        return Histogram(name, doc, list(LABELS), buckets=list(buckets), registry=self._registry)

    def _engine_state(self) -> None:
        """Queues, KV-cache use, prefix-cache accounting, preemptions, block sharing."""
        self.num_requests_running = self.gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = self.gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = self.gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = self.counter(
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = self.counter(
            "vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = self.counter(
            "vllm:num_preemptions_total", "Cumulative number of preemptions from the engine.")
        # Ours (no vLLM equivalent): what block sharing (forks, prefix hits) saves and costs.
        self.kv_blocks_shared = self.gauge(
            "kserve_paged:kv_blocks_shared",
            "KV blocks saved by sharing: references to a block beyond its first (n > 1 samples, "
            "beams, prefix-cache hits).")
        self.kv_cow_copies = self.counter(
            "kserve_paged:kv_cow_copies_total",
            "KV blocks copied on write (a shared block about to be written).")
        # Ours in vLLM's style (vLLM has neither; OWN_VLLM_STYLE): requests refused with 429
        # for a full waiting queue (--max_waiting_requests), and requests ended at their
        # deadline (timeout, x-request-timeout, --request_timeout_s).
        self.num_requests_rejected = self.counter(
            "vllm:num_requests_rejected_total",
            "Requests refused before they were queued (429), by reason (queue_full).",
            (*LABELS, "reason"))
        self.num_requests_timed_out = self.counter(
            "vllm:num_requests_timed_out_total",
            "Requests aborted at their deadline (408, or a stream's error event).")

    def _tokens_and_latencies(self) -> None:
        self.prompt_tokens = self.counter(
            "vllm:prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = self.counter(
            "vllm:generation_tokens_total", "Number of generation tokens processed.")
        self.time_to_first_token = self.histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TTFT_BUCKETS)
        self.inter_token_latency = self.histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS)
        self.e2e_request_latency = self.histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.", REQUEST_BUCKETS)
        self.request_queue_time = self.histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in the waiting queue in seconds.", REQUEST_BUCKETS)
        self.iteration_tokens = self.histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine step.",
            ITERATION_TOKEN_BUCKETS)

    def _per_request(self) -> None:
        """vLLM's per-request figures, observed when a request ends."""
        self.request_success = self.counter(
            "vllm:request_success_total", "Count of successfully processed requests.",
            (*LABELS, "finished_reason"))
        self.request_prompt_tokens = self.histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS)
        self.request_generation_tokens = self.histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            TOKEN_BUCKETS)
        self.request_inference_time = self.histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", REQUEST_BUCKETS)
        self.request_prefill_time = self.histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", REQUEST_BUCKETS)
        self.request_decode_time = self.histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", REQUEST_BUCKETS)

    def _adapters_slots_and_speculation(self) -> None:
        self.lora_requests_info = self.gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests (value: time of the last update).", LORA_LABELS)
        # This project's own: how much of the reserved KV memory holds tokens (shared: above).
        self.kv_slots_reserved = self.gauge(
            "kserve_paged:kv_slots_reserved",
            "KV-cache token slots in blocks held by requests (block_size per block).")
        self.kv_slots_holding_tokens = self.gauge(
            "kserve_paged:kv_slots_holding_tokens",
            "Reserved KV-cache token slots that hold a token; the rest is partial-block waste.")
        # Speculative decoding (vLLM's names): verified steps that carried drafts, draft tokens,
        # drafts kept (in all and by position). Acceptance rate: accepted / draft tokens.
        self.spec_decode_num_drafts = self.counter(
            "vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.")
        self.spec_decode_num_draft_tokens = self.counter(
            "vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.")
        self.spec_decode_num_accepted_tokens = self.counter(
            "vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.")
        self.spec_decode_num_accepted_tokens_per_pos = self.counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos_total",
            "Accepted tokens per draft position.", (*LABELS, "position"))
        self.cache_config_info = self.gauge(
            "vllm:cache_config_info", "Information of the KV-cache config (value 1).",
            (*LABELS, "block_size", "num_gpu_blocks"))


    def _offload_tier(self) -> None:
        """The second KV tier (docs/kv_tier.md), vLLM's tiering names where it has them."""
        def tiering(what: str, doc: str) -> Counter:
            return self.counter(f"vllm:kv_offload_tiering_{what}", doc, TIER_LABELS)

        self.kv_tier_block_queries = tiering(
            "block_queries", "Number of block lookup queries sent to secondary tiers.")
        self.kv_tier_block_hits = tiering(
            "block_hits", "Number of block lookup hits in secondary tiers.")
        self.kv_tier_read_bytes = tiering(
            "read_bytes", "Total bytes read from secondary tiers into the primary tier.")
        self.kv_tier_write_bytes = tiering(
            "write_bytes", "Total bytes written from the primary tier to secondary tiers.")
        self.kv_tier_read_time = tiering(
            "read_time", "Total time spent reading from secondary tiers, in seconds.")
        self.kv_tier_write_time = tiering(
            "write_time", "Total time spent handing blocks to secondary tiers, in seconds.")
        # Ours (vLLM has a usage gauge for its CPU tier only, and counts no corrupt reads).
        self.kv_tier_usage = self.gauge(
            "kserve_paged:kv_offload_tier_usage_perc",
            "Second KV tier usage (blocks kept / capacity). 1 means 100 percent usage.",
            TIER_LABELS)
        self.kv_tier_corrupt_blocks = self.counter(
            "kserve_paged:kv_offload_tier_corrupt_blocks_total",
            "Second-tier blocks found missing, short or corrupt on read (each a miss).",
            TIER_LABELS)
        self.num_requests_swapped = self.gauge(
            "vllm:num_requests_swapped",
            "Number of preempted requests whose KV cache waits in the second tier.")
        self.num_swap_outs = self.counter(
            "vllm:num_swap_outs_total",
            "Preemptions that swapped the request's KV cache out to the second tier.")
        self.num_swap_ins = self.counter(
            "vllm:num_swap_ins_total",
            "Swapped requests resumed with their whole KV cache read back from the tier.")

    def collectors(self) -> list[Any]:
        return [v for k, v in vars(self).items() if not k.startswith("_")]


_families_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = (
    weakref.WeakKeyDictionary())
_families_lock = threading.Lock()


def families(registry: CollectorRegistry | None) -> _Families:
    """The families of a registry (the default one for None), created on first use."""
    registry = REGISTRY if registry is None else registry
    with _families_lock:
        found = _families_by_registry.get(registry)
        if found is None:
            found = _families_by_registry[registry] = _Families(registry)
        return found


def _described(registry: CollectorRegistry | None) -> list[tuple[str, str]]:
    found = families(CollectorRegistry() if registry is None else registry)
    return [(m.name, m.type) for c in found.collectors() for m in c.describe()]


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
