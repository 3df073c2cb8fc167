"""Engine options: the one dataclass LLM, AsyncLLM and the server build; the engine hands each
part its share (the scheduler its SchedulerConfig, the runner its sizes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kserve_paged_engine.config.kv_events import KVEventsConfig
from kserve_paged_engine.config.kv_tier import NO_TIER, KVTierConfig
from kserve_paged_engine.config.multi_node import NodeLayout
from kserve_paged_engine.config.quantization import method_error
from kserve_paged_engine.config.scheduler import SchedulerConfig
from kserve_paged_engine.config.speculative import SpeculativeConfig
from kserve_paged_kernels.kv_formats import canonical

# vLLM's --runner and --convert (its old --task is gone).
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
# --prefix_caching_hash_algo (engine/kserve_paged_engine/core/block_hash.py computes each).
HASH_ALGOS = ("sha256", "sha256_cbor")

SCHEDULING_POLICIES = ("fcfs", "priority")
# auto: the folder's weights. dummy: random weights drawn at load (benchmarks of a model shape
# without its checkpoint, as vLLM's --load-format dummy); the folder needs only config.json
# and a tokenizer.
LOAD_FORMATS = ("auto", "dummy")
# Where the engine runs (vLLM's --device values it supports): a device type, or auto
# (core/kv_sizing.resolve_device: cuda when a GPU is visible, else cpu).
DEVICE_TYPES = ("cpu", "cuda")
DEVICES = ("auto", *DEVICE_TYPES)


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None
    dtype: str = "auto"  # auto: engine/kserve_paged_engine/core/kv_sizing.resolve_dtype (CPU: by native bf16)
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: float | int | None = None  # bytes (>1) or fraction of free memory (<=1)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's own limit
    enable_prefix_caching: bool = True
    # One block table for every layer even when global and sliding-window layers mix (Gemma
    # 2/3), as vLLM's --disable-hybrid-kv-cache-manager: nothing leaves the window while a
    # request runs (engine/kserve_paged_engine/core/kv_groups.py).
    disable_hybrid_kv_cache_manager: bool = False
    # How prefix-cache blocks are keyed, as vLLM's --prefix-caching-hash-algo (engine/kserve_paged_engine/core/block_hash.py;
    # the root key comes from PYTHONHASHSEED). sha256 is vLLM's default; sha256_cbor is the one a
    # router outside the pod can recompute (llm-d's precise prefix-cache scorer).
    prefix_caching_hash_algo: str = "sha256"
    scheduling_policy: str = "fcfs"
    seed: int = 0
    load_format: str = "auto"
    # KV-cache events for cache-aware routers (engine/kserve_paged_engine/core/kv_events.py): a KVEventsConfig, or its
    # JSON / dict form as vLLM's --kv-events-config takes it. None: off.
    kv_events_config: KVEventsConfig | str | dict[str, Any] | None = None
    # A second KV tier under the pool (engine/kserve_paged_engine/core/kv_tier/disk.py): a KVTierConfig, or vLLM's
    # --kv-transfer-config JSON / dict (OffloadingConnector). None: evicted blocks are gone.
    kv_transfer_config: KVTierConfig | str | dict[str, Any] | None = None
    # Multi-LoRA (engine/kserve_paged_engine/lora/): adapters active in one step, their largest rank, and how many
    # stay loaded in memory (an LRU; None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Tensor parallelism (engine/kserve_paged_engine/distributed/): the model sharded over this many ranks, one
    # process each (the engine's and N-1 workers), GPUs 0..N-1 on CUDA.
    tensor_parallel_size: int = 1
    # vLLM's --enable-expert-parallel: a mixture of experts' experts spread whole over the
    # tensor-parallel ranks, tokens sent to their owners (all-to-all), instead of each expert
    # cut (model_executor/moe_layout.py). At tensor_parallel_size 1, or for a dense model, it
    # changes nothing, as in vLLM (one rank holds every expert).
    enable_expert_parallel: bool = False
    # Multi-node tensor parallelism (config/multi_node.py): the pods the ranks span and this
    # one's place; None: every rank in this pod.
    multi_node: NodeLayout | None = None
    # Speculative decoding (engine/kserve_paged_engine/spec_decode/): a SpeculativeConfig, or vLLM's
    # --speculative-config JSON / dict. None: off.
    speculative_config: SpeculativeConfig | str | dict[str, Any] | None = None
    # vLLM's --gpu-memory-utilization: on CUDA, the share of the device's memory the engine
    # (weights, activations and KV cache) may use; an explicit kv_cache_memory wins. Not read
    # on CPU, where kv_cache_memory sizes the cache.
    gpu_memory_utilization: float = 0.9
    # vLLM's --enforce-eager: no CUDA graphs. Steps run eagerly today, so it changes nothing
    # until graph capture exists (kept so vLLM command lines run unchanged).
    enforce_eager: bool = False
    # vLLM's --kv-cache-dtype (kernels/kserve_paged_kernels/kv_formats.py): auto (the model's dtype), fp8 (=
    # fp8_e4m3), fp8_e5m2, or int8 (ours): one-byte codes with per-block scales
    # (kernels/kserve_paged_kernels/kv_quant.py), twice the blocks of a bf16 cache at the same memory.
    kv_cache_dtype: str = "auto"
    # vLLM's --quantization (engine/kserve_paged_engine/model_executor/quantization/layouts.py): gguf keeps a GGUF's 4-bit
    # projections packed; int4/int8 (ours) quantize a float checkpoint at load. None: float.
    quantization: str | None = None
    # Compile each structured-output grammar in a worker process killed after this many
    # seconds (engine/kserve_paged_engine/sample/grammar_worker.py); None: in a thread, unbounded (offline use).
    max_grammar_compile_s: float | None = None
    # The model's one job, as vLLM's --runner (auto, generate, pooling) and --convert (auto,
    # none, embed, classify) choose it; auto: from the checkpoint (engine/kserve_paged_engine/model_executor/model_job.py).
    runner: str = "auto"
    convert: str = "auto"

    def __post_init__(self) -> None:
        self._check_device()
        bs = self.block_size
        if not isinstance(bs, int) or bs < 1 or bs > 256 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two from 1 to 256 (got {bs})")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1 (got {self.num_kv_blocks})")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 (got {self.kv_cache_memory})")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1 (got {self.max_num_seqs})")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1 (got {self.max_num_batched_tokens})")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 (got {self.max_model_len})")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1] "
                             f"(got {self.gpu_memory_utilization})")
        if self.max_grammar_compile_s is not None and not 0 < self.max_grammar_compile_s < 1e6:
            raise ValueError("max_grammar_compile_s must be a positive number of seconds "
                             f"(got {self.max_grammar_compile_s})")
        canonical(self.kv_cache_dtype)  # ValueError naming the values for any other
        quantization_error = method_error(self.quantization)
        if quantization_error is not None:
            raise ValueError(quantization_error)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS} "
                             f"(got {self.load_format!r})")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS} "
                             f"(got {self.prefix_caching_hash_algo!r})")
        if isinstance(self.kv_events_config, (str, dict)):
            self.kv_events_config = KVEventsConfig.from_json(self.kv_events_config)
        self._check_kv_tier()
        if isinstance(self.speculative_config, (str, dict)):
            self.speculative_config = SpeculativeConfig.from_json(self.speculative_config)
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1 (got {self.max_loras}, "
                             f"{self.max_lora_rank})")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1 (got {self.tensor_parallel_size})")
        if self.tensor_parallel_size > 1:
            self._check_shardable()
        if self.multi_node is not None:
            self.multi_node.ranks_per_node(self.tensor_parallel_size)
        if self.runner not in RUNNERS or self.convert not in CONVERTS:
            raise ValueError(f"runner must be one of {RUNNERS} and convert one of {CONVERTS} "
                             f"(got {self.runner!r}, {self.convert!r})")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES} "
                             f"(got {self.scheduling_policy!r})")

    def _check_kv_tier(self) -> None:
        """--kv-transfer-config parsed, and refused before the model loads when it leaves no
        tier this engine builds."""
        if isinstance(self.kv_transfer_config, (str, dict)):
            self.kv_transfer_config = KVTierConfig.from_json(self.kv_transfer_config)
        if self.kv_transfer_config is not None:
            cfg = self.kv_transfer_config
            if not cfg.fs_tiers and not (cfg.host_bytes(1) and (self._on_gpu()
                                                                    or cfg.host_on_cpu)):
                raise ValueError(NO_TIER)  # a host tier needs a GPU
            if self.tensor_parallel_size > 1 and not cfg.fs_tiers:
                raise ValueError("kv_transfer_config at tensor_parallel_size > 1 needs an fs "
                                 "secondary tier: the host-memory tier is built at "
                                 "tensor_parallel_size 1 only")

    def _check_device(self) -> None:
        """`device` refused before anything loads when it names no device of this machine
        (torch would fail later, deep in loading, in its own words). torch.cuda is asked at
        call time, as resolve_device asks it: the tests' stand-in CUDA device patches it."""
        name = self.device
        kind, colon, index = name.partition(":") if isinstance(name, str) else ("", "", "")
        if name != "auto" and (kind not in DEVICE_TYPES or colon and not index.isdigit()):
            raise ValueError(f"--device {name!r} must be one of {', '.join(DEVICES)} "
                             "(or cuda:N)")
        if kind != "cuda":
            return
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA device is available here "
                             "(torch.cuda.is_available() is False); use --device cpu, or "
                             "auto (cpu where no GPU is visible)")
        if index and int(index) >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: {torch.cuda.device_count()} CUDA device(s) "
                             "visible here")

    def _on_gpu(self) -> bool:
        """Whether the engine will run on CUDA (`device` auto: whether CUDA is there)."""
        if self.device == "auto":
            import torch

            return torch.cuda.is_available()
        return self.device.startswith("cuda")

    def _check_shardable(self) -> None:
        """What tensor parallelism does not shard: a draft model."""
        spec = self.speculative_config
        if isinstance(spec, SpeculativeConfig) and spec.method == "draft_model":
            raise ValueError("a draft model is not sharded: speculative_config method "
                             "draft_model needs tensor_parallel_size 1")

    def scheduler_config(self, chunked_prefill: bool = True) -> SchedulerConfig:
        """`chunked_prefill` False: the model computes a prompt whole (encoders)."""
        return SchedulerConfig(max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens,
                               policy=self.scheduling_policy, max_loras=self.max_loras,
                               chunked_prefill=chunked_prefill)
