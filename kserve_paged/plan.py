"""The capacity planner: size a deployment from a model's config.json, before any weights exist
(the command, ``kserve-paged plan``, is plan_cli.py).

What a platform engineer would otherwise guess: how much of the device the weights take, how
many KV blocks the engine will allocate at start-up, how many requests fit, and a floor on
decode time from memory bandwidth (every decode step reads all the weights and every running
sequence's KV once). The model's facts are the engine's own (its model built on the meta device,
engine/kserve_paged_engine/model_executor/model_facts.py) and the KV figures come from the engine's sizing rule
(engine/kserve_paged_engine/core/kv_sizing.py), so the planner derives nothing about a family itself.
docs/operations.md explains each figure; the figures are estimates except the KV block count,
which is exact given the free memory the engine will see.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.core.kv_groups import KVLayout
from kserve_paged_engine.core.kv_sizing import (
    CUDA_KV_FRACTION,
    kv_bytes_per_token,
    resolve_dtype,
    size_kv_cache,
)
from kserve_paged_engine.model_executor.model_facts import ModelFacts
from kserve_paged_engine.model_executor.tp_layout import TP_ARCHITECTURES, TPLayout
from kserve_paged_kernels import kv_formats

GiB = 1 << 30
MiB = 1 << 20
# What a process loses before the weights load: CUDA context, cuBLAS workspace and allocator
# slack on a GPU; the interpreter, torch and the tokenizer on CPU. Estimates (docs/operations.md).
RUNTIME_OVERHEAD = {"cuda": 1 * GiB, "cpu": 1 * GiB}
CPU_BANDWIDTH = 50e9  # bytes/s: a dual-channel DDR5 desktop; pass --memory_bandwidth for yours
PREFILL_MFU = 0.5  # share of peak FLOP/s a prefill reaches (estimate)


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    kind: str  # "cuda" or "cpu"
    memory: int  # bytes the driver reports as total (cpu: the memory the pod may use)
    bandwidth: float  # bytes/s
    flops: float  # dense bf16 FLOP/s (cpu: a rough figure)


# Total memory as nvidia-smi reports it; HBM bandwidth and dense bf16 peak from the datasheets
# (SXM parts for H100 and A100).
GPUS = {
    "h100-80gb": Device("h100-80gb", "cuda", 81559 * MiB, 3.35e12, 989e12),
    "h200": Device("h200", "cuda", 143771 * MiB, 4.8e12, 989e12),
    "a100-80gb": Device("a100-80gb", "cuda", 81920 * MiB, 2.039e12, 312e12),
    "l4": Device("l4", "cuda", 23034 * MiB, 300e9, 121e12),
}


def parse_device(text: str, bandwidth: float | None = None) -> Device:
    """``h100-80gb``, ``h200``, ``a100-80gb``, ``l4`` or ``cpu:<GiB>``."""
    if text.startswith("cpu:"):
        try:
            gib = float(text[4:])
        except ValueError:
            gib = -1.0
        if not gib > 0:
            raise ValueError(f"--gpu cpu:<GiB> needs a positive size, got {text!r}")
        return Device(text, "cpu", int(gib * GiB), bandwidth or CPU_BANDWIDTH, 2e12)
    if text not in GPUS:
        raise ValueError(f"--gpu must be one of {', '.join(GPUS)} or cpu:<GiB> (got {text!r})")
    device = GPUS[text]
    if bandwidth:
        device = Device(device.name, device.kind, device.memory, bandwidth, device.flops)
    return device


@dataclass(frozen=True, slots=True)
class Plan:
    device: Device
    tp: int
    dtype: torch.dtype
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    workload: tuple[int, int]
    weights_bytes: int  # per device
    activation_bytes: int  # per device, peak of one step (estimate)
    kv_bytes_per_token: int  # per device, the token held by every layer
    kv_bytes_per_block: int  # per device: one block id in every KV slot (engine's rule)
    layout: KVLayout  # which layers share a block table (Gemma's global and sliding groups)
    free_bytes: int  # what the engine sees free once the weights are loaded
    kv_blocks: int  # what the engine's sizing rule allocates
    recommended_blocks: int  # the above, less what the activation peak needs
    kv_cache_memory: float | int | None
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: quantized ones store a byte per element
    nnodes: int = 1  # pods the ranks span (multi-node: tp / nnodes devices per pod)
    num_params: int = 0  # the model's parameters (prefill FLOPs; weights_bytes may be packed)
    packed: bool = False  # weights_bytes is a quantized model's packed size (plan_weights.py)

    @property
    def devices_per_node(self) -> int:
        return self.tp // self.nnodes

    @property
    def fits(self) -> bool:
        return self.recommended_blocks >= self.blocks_per_sequence

    def blocks_to_hold(self, num_tokens: int) -> int:
        """Blocks one request of `num_tokens` holds at most (over all KV groups)."""
        return self.layout.blocks_to_hold(num_tokens, self.block_size,
                                          self.max_num_batched_tokens)

    @property
    def blocks_per_sequence(self) -> int:
        return self.blocks_to_hold(self.max_model_len)

    @property
    def max_full_length_sequences(self) -> int:
        return self.recommended_blocks // self.blocks_per_sequence

    @property
    def workload_sequences(self) -> int:
        """Requests of the workload's size that fit in the KV cache at once."""
        prompt, out = self.workload
        return self.recommended_blocks // self.blocks_to_hold(prompt + out)

    @property
    def batch(self) -> int:
        """Requests in flight per replica at this workload: KV room, capped by max_num_seqs."""
        return max(1, min(self.max_num_seqs, self.workload_sequences))

    def decode_step_seconds(self, batch: int) -> float:
        """Memory floor of one decode step: the weights plus every sequence's mid-request KV."""
        prompt, out = self.workload
        context = prompt + out / 2
        return (self.weights_bytes + batch * context * self.kv_bytes_per_token) / self.device.bandwidth

    def decode_tokens_per_second(self, batch: int) -> float:
        return batch / self.decode_step_seconds(batch)

    @property
    def prefill_seconds(self) -> float:
        """One workload prompt at PREFILL_MFU of the device's peak (2 FLOPs per parameter)."""
        params = (self.num_params / self.tp if self.num_params
                  else self.weights_bytes / self.dtype.itemsize)
        return 2 * params * self.workload[0] / (self.device.flops * PREFILL_MFU)

    @property
    def requests_per_second(self) -> float:
        """Throughput of one replica at full batch: batch requests per (prefill + decode)."""
        out = self.workload[1]
        return self.batch / (self.prefill_seconds + out * self.decode_step_seconds(self.batch))

    def server_flags(self) -> list[str]:
        dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(self.dtype, "float32")
        return [f"--dtype={dtype}", f"--max_model_len={self.max_model_len}",
                f"--block_size={self.block_size}", f"--num_kv_blocks={self.recommended_blocks}",
                f"--max_num_seqs={self.batch}",
                f"--max_num_batched_tokens={self.max_num_batched_tokens}",
                *([f"--tensor_parallel_size={self.tp}"] if self.tp > 1 else []),
                *([f"--nnodes={self.nnodes}"] if self.nnodes > 1 else []),
                *([f"--kv_cache_dtype={self.kv_cache_dtype}"]
                  if self.kv_cache_dtype != "auto" else [])]


def activation_peak(model: ModelFacts, tokens: int, seqs: int, dtype_bytes: int, tp: int) -> int:
    """Largest step's live activations: hidden-size buffers (residual, normed input, attention
    and MLP outputs), q/k/v, the MLP's gate/up and its product, and the float32 logits of the
    sampling rows with the sampler's copies (processed logits, probabilities)."""
    h, hd = model.hidden_size, model.head_dim
    qkv = (model.num_heads + 2 * model.num_kv_heads) * hd // tp
    mlp = 3 * model.intermediate_size // tp
    return tokens * (4 * h + qkv + mlp) * dtype_bytes + 3 * seqs * model.vocab_size * 4


def check_tensor_parallel(model: ModelFacts, tp: int) -> None:
    """The engine's own rule (engine/kserve_paged_engine/model_executor/tp_layout.py): ValueError if it would
    refuse to shard this model over `tp` ranks."""
    if tp < 1:
        raise ValueError(f"--tensor_parallel_size must be >= 1 (got {tp})")
    if tp == 1:
        return
    if model.architecture not in TP_ARCHITECTURES:
        raise ValueError(f"--tensor_parallel_size {tp}: {model.architecture} is not sharded "
                         f"by this engine (tensor parallelism covers "
                         f"{', '.join(TP_ARCHITECTURES)})")
    TPLayout.of(model.num_heads, model.num_kv_heads, model.head_dim, model.intermediate_size,
                model.vocab_size, 0, tp)


def make_plan(model: ModelFacts, device: Device, *, max_model_len: int | None = None,
              tp: int = 1, dtype: str = "auto", block_size: int | None = None,
              workload: tuple[int, int] | None = None, max_num_seqs: int | None = None,
              max_num_batched_tokens: int | None = None,
              kv_cache_memory: float | int | None = None, kv_cache_dtype: str = "auto",
              packed_weights: int | None = None, nnodes: int = 1) -> Plan:
    """`packed_weights`: a quantized model's total weight bytes (plan_weights.py), else the
    parameters at the dtype; `nnodes`: pods the `tp` ranks span, tp / nnodes each."""
    defaults = EngineConfig()  # the engine's own defaults, checked by the same dataclass
    cfg = EngineConfig(block_size=block_size or defaults.block_size,
                       max_num_seqs=max_num_seqs or defaults.max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens
                       or defaults.max_num_batched_tokens,
                       max_model_len=max_model_len, kv_cache_memory=kv_cache_memory, dtype=dtype,
                       kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tp)
    check_tensor_parallel(model, tp)
    if nnodes < 1 or tp % nnodes:
        raise ValueError(f"--tensor_parallel_size {tp} must be a multiple of --nnodes {nnodes}")
    length = cfg.max_model_len or model.max_position_embeddings
    if length > model.max_position_embeddings:
        raise ValueError(f"max_model_len {length} exceeds the model's "
                         f"max_position_embeddings {model.max_position_embeddings}")
    torch_dtype = resolve_dtype(cfg.dtype, torch.device(device.kind))
    elem = torch_dtype.itemsize
    # Sharding as the engine does: weights split, each rank's KV heads (rank 0 holds the
    # most: 3 KV heads over 2 ranks are 2 + 1; replicated when fewer than the ranks).
    total = model.num_params * elem if packed_weights is None else packed_weights
    weights = -(-total // tp)
    rank = model.rank_share(tp)
    kv_elem = kv_formats.element_bytes(kv_cache_dtype, elem)  # 1 for a quantized cache
    scales = kv_formats.scale_bytes(kv_cache_dtype)  # per (K/V, layer, KV head) of a block
    per_token = kv_bytes_per_token(model.num_layers, rank.num_kv_heads, model.head_dim, kv_elem)
    free = device.memory - weights - RUNTIME_OVERHEAD[device.kind]
    seqs = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
    activation = activation_peak(model, cfg.max_num_batched_tokens, seqs, elem, tp)

    size = size_kv_cache(  # the engine's start-up sizing, given what will be free
        rank, dtype_bytes=kv_elem, scale_bytes=scales, block_size=cfg.block_size,
        hybrid=not cfg.disable_hybrid_kv_cache_manager, tp=tp, device_type=device.kind,
        num_kv_blocks=None, kv_cache_memory=kv_cache_memory, free_bytes=lambda: max(free, 0))
    blocks = size.num_blocks if free > 0 else 0
    room = max(free - activation, 0) // size.budget_per_block
    if workload is None:
        workload = (min(512, length * 3 // 4), min(128, max(1, length // 4)))
    if sum(workload) > length:
        raise ValueError(f"--workload {workload[0]}:{workload[1]} is longer than "
                         f"max_model_len {length}")
    return Plan(device, tp, torch_dtype, cfg.block_size, length, cfg.max_num_seqs,
                cfg.max_num_batched_tokens, workload, weights, activation, per_token,
                size.bytes_per_block, size.layout, free, int(blocks), int(min(blocks, room)),
                kv_cache_memory, kv_cache_dtype, nnodes, model.num_params,
                packed_weights is not None)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def render(plan: Plan, model: ModelFacts) -> str:
    d = plan.device
    single, full = plan.decode_tokens_per_second(1), plan.decode_tokens_per_second(plan.batch)
    lines = [
        f"model        {model.architecture}, {model.num_params / 1e9:.2f}B parameters, "
        f"{model.num_layers} layers, " + (
            f"MLA latent cache of {model.kv_latent_dim} values per token and layer"
            if model.kv_latent_dim else f"{model.num_kv_heads} KV heads x {model.head_dim}"),
        f"device       {d.name} x {plan.tp} ({_gib(d.memory)}, {d.bandwidth / 1e9:.0f} GB/s each)"
        + (f", {plan.devices_per_node} per pod x {plan.nnodes} pods" if plan.nnodes > 1 else ""),
        f"dtype        {str(plan.dtype).removeprefix('torch.')}",
        f"weights      {_gib(plan.weights_bytes)} per device"
        + (f" ({plan.weights_bytes} bytes, quantized: packed size)" if plan.packed else ""),
        f"activations  {_gib(plan.activation_bytes)} peak per step (estimate, "
        f"{plan.max_num_batched_tokens} tokens, {min(plan.max_num_seqs, plan.max_num_batched_tokens)}"
        " sampled rows)",
        f"free after weights  {_gib(plan.free_bytes)} per device "
        f"(runtime overhead {_gib(RUNTIME_OVERHEAD[d.kind])})",
        f"KV per token {plan.kv_bytes_per_token} bytes per device "
        f"({plan.kv_bytes_per_block} per block of {plan.block_size}"
        f"{'' if plan.kv_cache_dtype == 'auto' else ', ' + plan.kv_cache_dtype + ' with scales'})",
        f"KV blocks    {plan.kv_blocks} by the engine's sizing rule "
        f"({_kv_rule(plan)}); {plan.recommended_blocks} leaving room for the activations",
        f"sequences    {plan.max_full_length_sequences} at the full max_model_len "
        f"{plan.max_model_len}; {plan.workload_sequences} of the workload "
        f"{plan.workload[0]}:{plan.workload[1]}",
        f"decode floor {single:.0f} tok/s for one sequence, {full:.0f} tok/s at batch "
        f"{plan.batch} (memory bandwidth bound)",
        f"throughput   ~{plan.requests_per_second:.2f} requests/s per replica at batch "
        f"{plan.batch} (prefill at {PREFILL_MFU:.0%} of peak + decode floor)",
    ]
    if not plan.fits:
        lines.append("DOES NOT FIT: not one max_model_len sequence fits; use more devices, "
                     "a shorter max_model_len or a larger device")
    lines.append("flags        " + " ".join(plan.server_flags()))
    lines.append("resources    " + json.dumps(resources(plan)))
    lines.append(f"autoscaling  KEDA target {keda_target(plan)} on "
                 "sum(vllm:num_requests_running + vllm:num_requests_waiting) (docs/operations.md)")
    return "\n".join(lines)


def _kv_rule(plan: Plan) -> str:
    mem = plan.kv_cache_memory
    if mem is not None:
        return f"--kv_cache_memory {mem}"
    if plan.device.kind == "cuda":
        return f"{CUDA_KV_FRACTION:.0%} of the free memory"
    return "25% of the free memory, at most 4 GiB"


def resources(plan: Plan) -> dict[str, dict[str, str]]:
    """Pod requests and limits: the GPU count, and host memory for loading the weights (they
    pass through host memory) or, on CPU, weights + KV cache + activations + overhead."""
    if plan.device.kind == "cuda":
        host = math.ceil(plan.weights_bytes * plan.devices_per_node / GiB) + 8
        gpus = str(plan.devices_per_node)  # per pod: a multi-node layout's pods are alike
        return {"requests": {"cpu": "4", "memory": f"{host}Gi", "nvidia.com/gpu": gpus},
                "limits": {"memory": f"{host + 16}Gi", "nvidia.com/gpu": gpus}}
    need = (plan.weights_bytes + plan.recommended_blocks * plan.kv_bytes_per_block
            + plan.activation_bytes + RUNTIME_OVERHEAD["cpu"])
    memory = f"{math.ceil(need / GiB) + 1}Gi"
    return {"requests": {"cpu": "4", "memory": memory}, "limits": {"memory": memory}}


def keda_target(plan: Plan) -> int:
    """Requests in flight per replica to scale at: 80% of what one replica runs at once, so a
    new replica is asked for before the queue builds (tests/test_autoscaling.py)."""
    return max(1, int(0.8 * plan.batch))
