"""The engine's start-up decisions, each once: which model folder (for a packaged model, its GGUF
served 4-bit or its dense conversion), its stop ids, how big the KV
cache is and how long a request may be, and whether KV-cache events are published."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.config.kv_events import KVEventsConfig
from kserve_paged_engine.config.kv_tier import KVTierConfig, tier_plan
from kserve_paged_engine.core import kv_sizing
from kserve_paged_engine.core.block_hash import BlockHasher
from kserve_paged_engine.core.kv_event_publisher import ZmqEventPublisher
from kserve_paged_engine.core.kv_groups import KVLayout
from kserve_paged_engine.core.kv_sizing import KVCacheSize, kv_bytes_per_block, size_kv_cache
from kserve_paged_engine.core.kv_tier.disk import DiskTier, tier_folder
from kserve_paged_engine.core.kv_tier.host import HostTier
from kserve_paged_engine.core.kv_tier.identity import model_digest, tier_identity
from kserve_paged_engine.model_executor.model_facts import ModelFacts
from kserve_paged_engine.worker.kv_host_copy import make_copier
from kserve_paged_engine.worker.tp_tier import rank_kv_heads
from kserve_paged_kernels import kv_formats

logger = logging.getLogger("kserve_paged_engine")


def packaged_quantization(config: EngineConfig, device_type: str) -> tuple[str | None, str]:
    """(quantization, why) a packaged GGUF model is served with: `gguf` (its GGUF folder, the
    4-bit and int8 blocks kept) or what `--quantization` asks on the float32 conversion (None:
    dense). The one home of the default's rule: a model marked `gguf_by_default` is served
    4-bit unless --dtype names a dtype (dense, as the conversion) or --quantization another
    method; 4-bit needs the CPU and real weights, else it is served dense (under tensor
    parallelism each rank keeps its cut of the blocks)."""
    from kserve_paged_engine.frontend.default_model import DEFAULT_MODEL_ID, packaged_model

    model_id = config.model or DEFAULT_MODEL_ID
    if config.quantization is not None:
        return config.quantization, f"--quantization {config.quantization}"
    if not packaged_model(model_id).gguf_by_default:
        return None, f"{model_id} is served from its float32 conversion unless asked"
    blocker = (f"--dtype {config.dtype}" if config.dtype != "auto" else
               f"device {device_type}" if device_type != "cpu" else
               f"load_format {config.load_format}" if config.load_format != "auto" else None)
    if blocker is not None:
        return None, f"{blocker}: the dense float32 conversion"
    return "gguf", "no --dtype or --quantization: its GGUF, 4-bit"


def gguf_activations(requested: str, dtype: torch.dtype, quantization: str | None,
                     device_type: str) -> tuple[torch.dtype, str | None]:
    """The activation dtype of a GGUF served 4-bit under `--dtype auto`: `auto`'s own where our
    native quantized kernel takes it, else float32 where it does (PyTorch's packed int4 kernel,
    the other one, ran the default model 2-10x slower per token with bfloat16 activations than
    ours with float32, BENCHMARKS.md); an explicit dtype is kept. Returns (dtype, why or None)."""
    from kserve_paged_kernels import quant_linear

    if (requested != "auto" or quantization != "gguf" or device_type != "cpu"
            or quant_linear.native_for(dtype) or not quant_linear.native_for(torch.float32)):
        return dtype, None
    return torch.float32, (f"4-bit: our native int4 kernel takes float32 activations, not "
                           f"{str(dtype).removeprefix('torch.')}")


def resolve_model(config: EngineConfig, device_type: str) -> tuple[str, str | None]:
    """(folder or .gguf to load, the quantization it loads with): the default model, a packaged
    model's id provisioned and converted once (engine/kserve_paged_engine/frontend/default_model.py), or the path given."""
    from kserve_paged_engine.frontend.default_model import (
        DEFAULT_MODEL_ID,
        PACKAGED_MODELS,
        ensure_model,
    )
    from kserve_paged_engine.frontend.packaged_folders import FOLDER_MODELS, ensure_folder_model

    model = config.model
    if model is not None and model in FOLDER_MODELS and not os.path.exists(model):
        return str(ensure_folder_model(model, progress=logger.info)), config.quantization
    if model is not None and (model not in PACKAGED_MODELS or os.path.exists(model)):
        return str(model), config.quantization
    model_id = model or DEFAULT_MODEL_ID
    quantization, why = packaged_quantization(config, device_type)
    gguf = quantization == "gguf"
    logger.info("model %s: %s", model_id, why)
    return str(ensure_model(model_id, progress=logger.info, gguf_folder=gguf)), quantization


def encoder_max_len(model_path: str) -> int | None:
    """The longest input a sentence-transformers model was trained on (`max_seq_length` of
    sentence_bert_config.json), its context window as vLLM reads it; None without one."""
    import json
    from pathlib import Path

    file = Path(model_path) / "sentence_bert_config.json"
    if not file.is_file():
        return None
    value = json.loads(file.read_text()).get("max_seq_length")
    return int(value) if value else None


def eos_ids(model_path: str, tokenizer: Any) -> tuple[int | None, list[int]]:
    """(EOS id, further ids that also end a request): the tokenizer's EOS first, then those of
    generation_config.json (Llama 3 lists several)."""
    ids: list[int] = []
    try:
        from transformers import GenerationConfig

        gen_eos = GenerationConfig.from_pretrained(model_path, local_files_only=True).eos_token_id
    except Exception:  # noqa: BLE001 - a folder without generation_config.json is fine
        gen_eos = None
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None:
        ids.append(int(tok_eos))
    for e in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
        if e is not None and int(e) not in ids:
            ids.append(int(e))
    if not ids:
        return None, []
    return ids[0], ids[1:]


def size_cache(config: EngineConfig, model: Any, draft_model: Any | None, dtype: torch.dtype,
               device: torch.device) -> KVCacheSize:
    """The engine's KV cache for its loaded model (one budget: a draft model's cache gets as
    many blocks, kept in the model's dtype), by the one sizing rule the capacity planner runs
    too; a quantized --kv-cache-dtype stores one byte per element plus its scales."""
    extra = 0
    if draft_model is not None:
        extra = kv_bytes_per_block(draft_model.num_layers, draft_model.num_kv_heads,
                                   draft_model.head_dim, config.block_size, dtype.itemsize)
    kv_memory = config.kv_cache_memory
    if device.type == "cuda" and kv_memory is None and config.num_kv_blocks is None:
        kv_memory = profiled_kv_memory(config, model, dtype, device)
        if kv_memory < 2:  # a budget in bytes: 0 or 1 would read as a fraction
            raise ValueError("the profile run leaves no device memory for the KV cache: lower "
                             "max_num_batched_tokens or raise gpu_memory_utilization")
    size = size_kv_cache(
        ModelFacts.of(model), dtype_bytes=kv_formats.element_bytes(config.kv_cache_dtype,
                                                                    dtype.itemsize),
        scale_bytes=kv_formats.scale_bytes(config.kv_cache_dtype), block_size=config.block_size,
        hybrid=not config.disable_hybrid_kv_cache_manager, tp=config.tensor_parallel_size,
        device_type=device.type, num_kv_blocks=config.num_kv_blocks,
        kv_cache_memory=kv_memory, free_bytes=lambda: kv_sizing.available_memory(device),
        extra_bytes_per_block=extra)
    if size.num_blocks < 1:
        raise ValueError(f"kv_cache_memory of {size.budget_bytes} bytes holds no KV block "
                         f"({size.budget_per_block} bytes each)")
    return size


def profiled_kv_memory(config: EngineConfig, model: Any, dtype: torch.dtype,
                       device: torch.device) -> int:
    """KV bytes by a profile run of the largest step (engine/kserve_paged_engine/worker/profile_run.py)."""
    from kserve_paged_engine.worker.profile_run import largest_step, profile_memory

    prof = profile_memory(largest_step(model, dtype, device, config.max_num_batched_tokens,
                                       config.max_num_seqs, config.block_size))
    budget = prof.kv_budget(config.gpu_memory_utilization)
    logger.info("profile run: %.2f GiB non-KV peak (torch %.2f, other %.2f) of %.2f GiB; "
                "gpu_memory_utilization %.2f leaves %.2f GiB for the KV cache",
                prof.non_kv_peak / 2**30, prof.torch_peak / 2**30, prof.non_torch / 2**30,
                prof.total / 2**30, config.gpu_memory_utilization, budget / 2**30)
    return budget


def longest_fit(layout: KVLayout, max_len: int, chunk: int, block_size: int,
                num_blocks: int) -> int:
    """The longest request (at most `max_len` tokens) a cache of `num_blocks` holds alone."""
    if layout.blocks_to_hold(max_len, block_size, chunk) <= num_blocks:
        return max_len
    lo, hi = 0, max_len  # blocks_to_hold grows with the length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if layout.blocks_to_hold(mid, block_size, chunk) <= num_blocks \
            else (lo, mid - 1)
    return lo


def log_cache(size: KVCacheSize, config: EngineConfig, model: Any, max_len: int) -> None:
    tp, bs, layout = config.tensor_parallel_size, config.block_size, size.layout
    per_request = layout.blocks_to_hold(max_len, bs, config.max_num_batched_tokens)
    groups = layout.group_windows
    kind = "" if config.kv_cache_dtype == "auto" else f" ({config.kv_cache_dtype}, scaled)"
    logger.info("KV cache%s: %d blocks of %d tokens x %d layers, %.1f MiB%s; %d concurrent "
                "sequences of max_model_len %d (%d blocks each%s)", kind, size.num_blocks, bs,
                layout.group_size, size.num_blocks * size.bytes_per_block / 2**20,
                f" per rank x {tp} ranks ({model.num_kv_heads} KV heads on rank 0)"
                if tp > 1 else "", size.num_blocks // per_request, max_len, per_request,
                f" over {len(groups)} KV groups, windows {groups}" if len(groups) > 1 else "")


def kv_event_publisher(config: EngineConfig, hasher: BlockHasher, device: torch.device
                       ) -> ZmqEventPublisher | None:
    """The publisher of KV-cache events, when --kv_events_config switches them on (the cache
    manager then records them)."""
    cfg = config.kv_events_config
    if not isinstance(cfg, KVEventsConfig) or not cfg.publishes:
        return None
    if not config.enable_prefix_caching:
        logger.warning("KV-cache events are on but prefix caching is off: nothing is cached, "
                       "so only AllBlocksCleared will ever be published")
    if hasher.algo != "sha256_cbor" or hasher.seed is None:
        logger.info("KV-cache events announce %s block hashes (PYTHONHASHSEED %s): a router "
                    "that recomputes vLLM's keys from prompts needs sha256_cbor and the "
                    "seed (docs/operations.md)", hasher.algo,
                    "unset" if hasher.seed is None else "set")
    return ZmqEventPublisher(cfg, medium="GPU" if device.type == "cuda" else "CPU")


def warm_up_and_capture(config: EngineConfig, runner: Any, device: torch.device, *,
                   tp: bool) -> None:
    """On CUDA, before readiness and after the KV cache is sized and allocated: the warm-up
    that compiles every Triton variant (not under tensor parallelism: its forward needs every
    rank), then CUDA graphs for decode steps (off with `enforce_eager` and under tensor
    parallelism); both count in the time to ready."""
    why = ("--enforce_eager" if config.enforce_eager else
           "not on CUDA" if device.type != "cuda" else
           "tensor parallelism" if tp else None)
    if device.type == "cuda" and not tp and runner.attention_backend != "cpu":
        warm_up(config, runner)
    if why is None:
        from kserve_paged_engine.worker.cuda_graphs import CudaCapture

        why = runner.capture_graphs(config.max_num_seqs, CudaCapture())
    if why is not None and device.type == "cuda":
        logger.info("decode runs eagerly (no CUDA graphs): %s", why)


def warm_up(config: EngineConfig, runner: Any) -> Any:
    """Compile every Triton variant serving will launch, before readiness
    (engine/kserve_paged_engine/worker/warmup.py); returns its report."""
    from kserve_paged_engine.worker.warmup import warm_up as run

    return run(runner.model, runner.kv_caches, runner.max_blocks_per_seq, runner.device,
               runner.attention_backend, max_num_batched_tokens=config.max_num_batched_tokens,
               max_num_seqs=config.max_num_seqs, max_model_len=runner.max_model_len,
               num_groups=runner.layout.num_groups)


def log_dtype(requested: str, dtype: torch.dtype, device: torch.device,
              reason: str | None = None) -> None:
    """The dtype chosen (and why, for `auto`) and, on CPU, the kernels it takes."""
    from kserve_paged_kernels import cpu_dtype
    from kserve_paged_kernels.cpu_native import isa

    why = ""
    if reason is not None:
        why = f" ({reason})"
    elif requested == "auto":
        why = (f" ({cpu_dtype.describe(isa.cpu_flags())})" if device.type == "cpu"
               else " (the checkpoint's dtype; float32 checkpoints in bfloat16)")
    logger.info("dtype %s -> %s%s", requested, str(dtype).removeprefix("torch."), why)
    if device.type == "cpu":
        logger.info("CPU kernels for %s: %s", str(dtype).removeprefix("torch."),
                    cpu_dtype.kernels_taken(dtype))


def kv_tier(config: EngineConfig, hasher: BlockHasher, model_path: str, dtype: torch.dtype,
            device: torch.device, layout: KVLayout, model: Any) -> DiskTier | HostTier | None:
    """The second KV tier --kv_transfer_config asks for (the cache manager's and runner's): host
    memory (on a GPU) above a disk folder named by everything the bytes depend on besides the
    block hash (the model's content, dtype, KV cache dtype, layout, block size, hash algorithm
    and seed: engine/kserve_paged_engine/core/kv_tier/identity.py), so another model's or
    checkpoint's blocks never match; either one alone."""
    cfg = config.kv_transfer_config
    if not isinstance(cfg, KVTierConfig):
        return None
    bs = config.block_size
    kv_dtype = kv_formats.canonical(config.kv_cache_dtype)  # a quantized cache: its scales too
    ranks = rank_kv_heads(model)  # tensor parallelism: a file holds every rank's heads
    block_bytes = kv_bytes_per_block(layout.group_size, sum(ranks), model.head_dim, bs,
                                     kv_formats.element_bytes(kv_dtype, dtype.itemsize),
                                     kv_formats.scale_bytes(kv_dtype))
    plan = tier_plan(cfg, device.type, block_bytes, tensor_parallel=len(ranks) > 1)
    tier: DiskTier | HostTier | None = None
    if plan.fs is not None:
        identity, fmt = tier_identity(
            model_digest(model_path, config.load_format, config.seed),
            str(dtype).removeprefix("torch."), kv_dtype, config.quantization, bs,
            layout.group_size, model.layout.num_kv_heads if len(ranks) > 1
            else model.num_kv_heads, model.head_dim, hasher.algo, hasher.root, len(ranks))
        tier = DiskTier(tier_folder(plan.fs.root_dir, identity), block_bytes,
                        plan.fs.capacity_bytes, bs, keep_files=hasher.seed is not None,
                        policy=cfg.eviction_policy, fmt=fmt)
        logger.info("KV tier: %s, %d blocks of %.2f MiB (%d already there)", tier.folder,
                    tier.capacity_blocks, block_bytes / 2**20, tier.num_blocks)
    if plan.host_bytes is not None:
        tier = HostTier(block_bytes, plan.host_bytes, bs, cfg.eviction_policy, tier,
                        pin=device.type == "cuda", copier=make_copier(device))
        logger.info("KV tier: host memory, %d blocks of %.2f MiB%s", tier.capacity_blocks,
                    block_bytes / 2**20, " (pinned)" if tier.host.is_pinned() else "")
    assert tier is not None
    return tier


def cache_and_length(config: EngineConfig, model: Any, draft_model: Any | None,
                     dtype: torch.dtype, device: torch.device, encoder: bool, model_path: str
                     ) -> tuple[KVLayout, int, int]:
    """(KV layout, KV blocks, max_model_len): the blocks by the sizing rule
    (engine/kserve_paged_engine/core/kv_sizing.py), max_model_len capped to the longest request
    the cache holds alone."""
    if encoder and config.num_kv_blocks is None and config.kv_cache_memory is None:
        # Nothing outlives a step: room for one step's tokens, a partial block per seq.
        config = dataclasses.replace(config, num_kv_blocks=-(
            -config.max_num_batched_tokens // config.block_size) + config.max_num_seqs)
    size = size_cache(config, model, draft_model, dtype, device)
    max_len = (config.max_model_len or encoder_max_len(model_path)
               or model.max_position_embeddings)
    fits = longest_fit(size.layout, max_len, config.max_num_batched_tokens,
                       config.block_size, size.num_blocks)
    if fits < max_len:
        logger.warning("max_model_len %d exceeds the KV cache (%d blocks of %d tokens hold "
                       "one request of %d tokens): capping it", max_len,
                       size.num_blocks, config.block_size, fits)
        max_len = fits
    model.check_max_model_len(max_len)
    log_cache(size, config, model, max_len)
    return size.layout, size.num_blocks, max_len


def warm_up_requests(engine: Any, prefill_tokens: int) -> None:
    """Run a tiny request and one prefill of `prefill_tokens` through `engine` (an LLMEngine)
    end to end, so the first user request pays no first-call costs (the CPU GEMMs' kernels for
    many rows are made at their first use). LLMEngine.warmup forgets what they leave."""
    from kserve_paged_engine.pooling_params import PoolingParams
    from kserve_paged_engine.sampling_params import SamplingParams

    long = max(4, min(prefill_tokens, engine.config.max_num_batched_tokens,
                      engine.max_model_len - 2))
    for i, prompt in enumerate(([1, 2, 3, 4], [1 + t % 7 for t in range(long)])):
        rid = f"__warmup_{i}__"
        if engine.pooling is not None:
            engine.add_request(rid, prompt, pooling_params=PoolingParams(task=engine.job))
        else:
            engine.add_request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
