"""A quantized KV cache through the engine: a tiny random model's logits with int8 / fp8 KV
against the same model with float32 KV, the block count at the same --kv_cache_memory, the
planner, and the values refused.

What holds: not the same tokens. Quantized K/V move every attention output a little, so the
claim is a logits tolerance per format (TOLERANCE, below, with what was measured) and the
greedy token of most steps; these tiny random models attend sharply and amplify the error. The perplexity figures on the default model are bench/kv_quant_ppl.py's
(BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.model_executor.model_facts import describe_folder
from kserve_paged_engine.model_executor.model_loader import load_model
from kserve_paged_kernels.kv_quant import QMAX, QuantKV, storage_dtype
from tests.helpers.tiny_models import CONFIGS, PagedSim, save_checkpoint

# Max |logit error| (logits span about +-3 to +-5) and greedy choices kept of 18, with
# margin over what was measured (int8 0.10-0.13, 16-18 kept; fp8_e4m3 0.50-1.08, 15-16;
# fp8_e5m2 1.22-1.66, 14-16): these random models attend sharply, which amplifies.
TOLERANCE = {"int8": 0.2, "fp8_e4m3": 1.3, "fp8_e5m2": 2.0}
AGREE = {"int8": 16, "fp8_e4m3": 13, "fp8_e5m2": 12}
PROMPTS = {0: list(range(1, 30)), 1: list(range(40, 47))}


def _garbage(shape: tuple[int, ...], fmt: str, seed: int) -> QuantKV:
    """A quantized cache full of finite garbage codes and scales, as a reused cache holds."""
    kv = QuantKV.zeros(shape, storage_dtype(fmt))
    g = torch.Generator().manual_seed(seed)
    codes = (torch.rand(shape, generator=g) * 2 - 1) * QMAX[kv.dtype]
    kv.data.copy_(codes.round().to(kv.dtype) if kv.dtype == torch.int8 else codes.to(kv.dtype))
    kv.scales.copy_(torch.rand(kv.scales.shape, generator=g) * 10)
    return kv


def _run(model, fmt: str | None, forced: list[list[int]] | None = None  # noqa: ANN001
         ) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Last-token logits of two sequences over a prefill and 8 decode steps (teacher-forced
    with `forced`), with float32 KV (`fmt` None) or a quantized cache."""
    sim = PagedSim(model, seed=3)
    if fmt is not None:
        sim.kv = [_garbage(tuple(kv.shape), fmt, i) for i, kv in enumerate(sim.kv)]
    logits = sim.step(list(PROMPTS.items()))
    out = [logits[[len(PROMPTS[0]) - 1, len(PROMPTS[0]) + len(PROMPTS[1]) - 1]]]
    tokens = [forced[0] if forced else out[0].argmax(-1).tolist()]
    for i in range(8):
        out.append(sim.step([(0, [tokens[-1][0]]), (1, [tokens[-1][1]])]))
        tokens.append(forced[i + 1] if forced else out[-1].argmax(-1).tolist())
    return out, [t.argmax(-1).tolist() for t in out]


@pytest.mark.parametrize("name", ["llama_gqa_llama3", "gemma2_window_softcap"])
def test_tiny_model_logits_stay_close_to_float32_kv(name: str, tmp_path: Path) -> None:
    """Within each format's tolerance, greedy tokens nearly all the same, and the formats in
    the order of their precision: int8 (8 bits over the block's range) closer than fp8_e4m3
    (3 mantissa bits), closer than fp8_e5m2 (2)."""
    path, _ = save_checkpoint(CONFIGS[name], tmp_path)
    model = load_model(path, torch.float32, torch.device("cpu"))[0]
    ref, tokens = _run(model, None)
    errors = []
    for fmt in TOLERANCE:
        got, greedy = _run(model, fmt, forced=tokens)
        errors.append(max((a - r).abs().max().item() for a, r in zip(got, ref)))
        assert errors[-1] < TOLERANCE[fmt], f"{name} {fmt}: max |logit error| {errors[-1]:.4f}"
        same = sum(a == b for g, t in zip(greedy, tokens) for a, b in zip(g, t))
        assert same >= AGREE[fmt], f"{name} {fmt}: {same} of 18 greedy tokens"
    assert errors == sorted(errors), errors


def test_llm_serves_with_an_int8_cache_without_leaking(tmp_path: Path) -> None:
    """The engine path: sized, allocated as QuantKV, copy-on-write (n=2) and prefix hits, and
    every block back at the end."""
    from kserve_paged_engine import LLM, SamplingParams
    from tests.helpers.tiny_models import save_tokenizer

    path, _ = save_checkpoint(CONFIGS["llama_gqa_llama3"], tmp_path)
    save_tokenizer(path)
    llm = LLM(model=str(path), block_size=4, num_kv_blocks=64, max_model_len=64,
              kv_cache_dtype="int8", max_num_batched_tokens=10)
    caches = llm.engine.runner.slot_caches
    assert all(isinstance(c, QuantKV) and c.dtype == torch.int8 for c in caches)
    params = SamplingParams(max_tokens=6, temperature=0.8, n=2, seed=1, ignore_eos=True)
    prompt = list(range(5, 23))
    for _ in range(2):
        outs = llm.generate([prompt, prompt[:13]], params, use_tqdm=False)
        assert all(len(c.token_ids) == 6 for o in outs for c in o.outputs)
    assert llm.stats()["prefix_cache_hits"] > 0
    assert llm.stats()["kv_blocks_free"] == 64


def _plan(kv_cache_dtype: str, dtype: str):  # noqa: ANN202
    from kserve_paged.plan import make_plan, parse_device
    from tests.helpers.manifests import REPO

    facts = describe_folder(REPO / "tests" / "data" / "models" / "llama-3-8b")
    return make_plan(facts, parse_device("h100-80gb"), max_model_len=8192, dtype=dtype,
                     kv_cache_memory=20 << 30, kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_e5m2"])
def test_block_count_doubles_against_bf16_and_quadruples_against_fp32(fmt: str) -> None:
    """At one --kv_cache_memory, by the planner (the engine's sizing rule): the scales (4
    bytes per 16 x 128 codes of Llama-3-8B) take 0.2% of a block, so x2 and x4 to within it;
    its bytes per token are one per element."""
    quant, bf16, fp32 = _plan(fmt, "bfloat16"), _plan("auto", "bfloat16"), _plan("auto",
                                                                                 "float32")
    assert 1.99 * bf16.kv_blocks <= quant.kv_blocks <= 2 * bf16.kv_blocks
    assert 3.98 * fp32.kv_blocks <= quant.kv_blocks <= 4 * fp32.kv_blocks
    assert quant.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2
    assert f"--kv_cache_dtype={fmt}" in quant.server_flags()


def test_engine_start_up_sizing_counts_one_byte_and_the_scales(tmp_path: Path) -> None:
    from kserve_paged_engine.frontend import startup

    path, _ = save_checkpoint(CONFIGS["llama_gqa_llama3"], tmp_path)
    model = load_model(path, torch.float32, torch.device("cpu"))[0]

    def size(fmt: str) -> int:
        config = EngineConfig(kv_cache_memory=1 << 20, kv_cache_dtype=fmt)
        return startup.size_cache(config, model, None, torch.float32, torch.device("cpu"))

    plain, quant = size("auto"), size("int8")
    # 2 layers x 2 KV heads x 16 dims x 16 tokens x (K, V): 4 bytes each, or 1 + the scales.
    assert plain.bytes_per_block == 2 * 2 * 16 * 16 * 2 * 4
    assert quant.bytes_per_block == 2 * 2 * 16 * 16 * 2 + 2 * 2 * 2 * 4
    assert 3.9 * plain.num_blocks <= quant.num_blocks <= 4 * plain.num_blocks


def test_bad_values_are_refused_before_anything_loads() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        EngineConfig(kv_cache_dtype="fp4")
    # Each tensor-parallel rank quantizes its own heads (tests/test_tp_features.py).
    assert EngineConfig(kv_cache_dtype="int8", tensor_parallel_size=2).tensor_parallel_size == 2
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"


def test_triton_engine_path_reads_the_same_codes_as_the_cpu_path(gpu_path) -> None:  # noqa: ANN001
    """The same requests served on the Triton backend (its kernel multiplies codes by scales
    as it loads them; interpreted without CUDA) and on the CPU backend (dequantized blocks):
    the same store, so the same codes, and fp32 attention either way; greedy tokens equal,
    log-probabilities to summation order. int8 only (the interpreter is slow): fp8 reads are
    the kernel tests' (tests/kernels/test_triton_backend.py)."""
    from tests.helpers.kv_quant_child import serve

    fmt = "int8"
    triton = gpu_path.call("tests.helpers.kv_quant_child", "serve", kv_cache_dtype=fmt)
    cpu = serve(fmt)
    assert (triton["backend"], cpu["backend"]) == ("triton", "cpu")
    assert triton["tokens"] == cpu["tokens"]
    for a, b in zip(triton["logprobs"], cpu["logprobs"]):
        assert a == pytest.approx(b, abs=1e-4)
    assert triton["free"] == cpu["free"] == 64
