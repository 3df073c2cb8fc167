"""The flags KServe's LLMInferenceService writes and vLLM users bring, beyond the engine's own:
served names, security, tracing, reasoning models, and vLLM's engine flags we honour or refuse
(kept apart from kserve_paged/args.py, which builds the parser around them)."""

from __future__ import annotations

import argparse
from typing import Any

from kserve_paged.flag_types import BoolFlag, fraction, json_object, parse_kv_transfer_config
from kserve_paged.openai.reasoning import REASONING_PARSERS
from kserve_paged_kernels.kv_formats import KV_CACHE_DTYPES


def add_gateway_flags(parser: argparse.ArgumentParser, d: dict[str, Any]) -> None:
    """The flags KServe's LLMInferenceService writes and vLLM users bring: served names,
    security, tracing, reasoning models, and the engine flags vLLM has and we honour."""
    engine = next(g for g in parser._action_groups if g.title == "engine")
    engine.add_argument("--gpu_memory_utilization", type=fraction,
                        default=d["gpu_memory_utilization"],
                        help="On CUDA, the share of device memory the engine may use (weights, "
                             "activations, KV cache); not read on CPU (--kv_cache_memory).")
    engine.add_argument("--enforce_eager", action=BoolFlag, default=d["enforce_eager"],
                        help="No CUDA graphs (steps run eagerly today, so nothing changes).")
    engine.add_argument("--kv_cache_dtype", default=d["kv_cache_dtype"], choices=KV_CACHE_DTYPES,
                        help="KV-cache storage: auto (the model's dtype), fp8 (= fp8_e4m3), "
                             "fp8_e5m2 (vLLM's values) or int8 (ours): one byte per element "
                             "with per-block scales, twice a bf16 cache's blocks "
                             "(docs/quantization.md).")
    engine.add_argument("--kv_transfer_config", type=parse_kv_transfer_config, default=None,
                        metavar="JSON",
                        help="vLLM's KV offloading config (OffloadingConnector, as KServe "
                             "renders spec.kvCacheOffloading): evicted prefix blocks go to "
                             "host memory on a GPU (cpu_bytes_to_use) and to the first fs "
                             "secondary tier, and come back on prefix hits. On CPU "
                             "cpu_bytes_to_use adds nothing; a CPU config without an fs tier "
                             "is refused.")
    served = parser.add_argument_group("served names, security, tracing")
    served.add_argument("--served_model_name", nargs="+", default=None, metavar="NAME",
                        help="Names the model answers to (vLLM's flag): the first is reported, "
                             "every one routes. Replaces --model_name.")
    served.add_argument("--disable_access_log_for_endpoints", default="",
                        metavar="PATH[,PATH...]",
                        help="Comma-separated paths whose requests are not access-logged "
                             "(probes such as /health,/metrics,/ping).")
    served.add_argument("--disable_uvicorn_access_log", action="store_true",
                        help="No access log at all (vLLM's older switch).")
    served.add_argument("--disable_log_requests", action="store_true",
                        help="Accepted for vLLM's command lines (KServe's gpt-oss sample "
                             "passes it): no request's prompt or options is logged anyway.")
    served.add_argument("--api_key", default=None,
                        help="Bearer token required on every inference, tokenizer and adapter "
                             "route (or $VLLM_API_KEY); health, readiness and metrics stay open.")
    served.add_argument("--model_control_key", default=None,
                        help="Bearer token of KServe's model repository routes (POST "
                             "/v2/repository/models/NAME/load and /unload), which are off (403) "
                             "without it (or $KSERVE_PAGED_MODEL_CONTROL_KEY); never the "
                             "--api-key. Unloading the model stops it until a restart.")
    served.add_argument("--ssl_ca_certs", default=None,
                        help="CA bundle: clients must present a certificate it signed (mTLS).")
    served.add_argument("--enable_ssl_refresh", action=BoolFlag, default=False,
                        help="Reload the certificate and key when their files change.")
    served.add_argument("--otlp_traces_endpoint", default=None, metavar="URL",
                        help="Export one span per request over OTLP (gRPC, or HTTP as "
                             "$OTEL_EXPORTER_OTLP_PROTOCOL says); off when unset.")
    served.add_argument("--collect_detailed_traces", default=None,
                        help="vLLM's detail switch (model, worker or all): the request span "
                             "then carries queue, prefill and decode times.")
    _add_chat_flags(parser)


def _add_chat_flags(parser: argparse.ArgumentParser) -> None:
    """How chat requests are read and answered: reasoning, template arguments, defaults."""
    chat = parser.add_argument_group("chat")
    chat.add_argument("--reasoning_parser", default=None, choices=REASONING_PARSERS,
                      help="Split a thinking model's output into message.reasoning and "
                           "message.content (openai_gptoss: gpt-oss' Harmony channels, on by "
                           "default for gpt-oss models; docs/harmony.md).")
    chat.add_argument("--default_chat_template_kwargs", type=json_object, default=None,
                      metavar="JSON",
                      help="Keyword arguments every chat template render gets (a request's "
                           "chat_template_kwargs override them), e.g. "
                           "'{\"enable_thinking\": false}'.")
    chat.add_argument("--generation_config", default="auto", choices=("auto", "vllm"),
                      help="auto: default sampling values from the model's "
                           "generation_config.json; vllm: vLLM's own defaults.")
