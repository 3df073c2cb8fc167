"""The CPU-sensitive tests again as every lesser CPU, the whole process capped.

Why: a result on CPU depends on our native build, our own CPU-flag reads (VNNI, bf16, AMX),
oneDNN and ATen's kernels, and a test written on one machine type met its first AVX2 machine
in the field (W8A8 through oneDNN without VNNI is not the int8 product). So on any machine the
suite also runs, in a child process per level below the machine's own, the kernel tests,
quantized weights and KV, bf16, W8A8, the decoder stack and the model families with
`KSERVE_PAGED_ISA=<level>` and oneDNN's, ATen's and MKL's caps set alike
(kserve_paged_kernels/cpu_cap.py). An AVX-512 machine so proves AVX2; an AMX one proves AVX2,
AVX-512 and AVX512-BF16. A probe first checks that each party really runs capped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kserve_paged_kernels import cpu_cap
from kserve_paged_kernels.cpu_native import isa
from tests.helpers.cpu_flags import MACHINES

ROOT = Path(__file__).resolve().parents[1]
LESSER = [level.name for level in isa.available()[:-1]]

NATIVE_TESTS = ("tests/kernels/test_cpu_ops.py", "tests/kernels/test_gemm.py",
                 "tests/kernels/test_cpu_backend.py", "tests/kernels/test_lora_native.py",
                 "tests/kernels/test_decoder_stack.py", "tests/kernels/test_paged_bf16.py",
                 "tests/kernels/test_cpu_ops_bf16.py", "tests/kernels/test_gemma_bf16.py",
                 "tests/kernels/test_quant_gemm.py",
                 "tests/kernels/test_gemm_bf16.py", "tests/kernels/test_kv_quant_native.py",
                 "tests/kernels/test_attention_sinks.py", "tests/kernels/test_mxfp4.py")
# What differs by level is the native code (the GEMM, the attention paths, the fused ops, the
# stack): the CPU backend's torch-only cases (other dtypes, native off) do not change with it,
# and its decode-rows-only routing covers a subset of the all-rows one; the default run has them.
NATIVE_SELECTION = "not torch-decode and not native-decode and not bfloat16 and not float16"
AVX2_MUST_PASS = (
    "test_gemm.py::test_gemm_matches_matmul[90-40-11]",
    "test_gemm.py::test_gemm_silu_and_gelu_match_linear_then_activation[False-True-47-19-33]",
    "test_gemm.py::test_gemm_silu_and_gelu_match_linear_then_activation[True-True-47-19-33]",  # GELU
    "test_cpu_backend.py::test_long_prefill_runs_match_reference[16-9x3-128]",
    "test_cpu_backend.py::test_decode_rows_over_a_shared_prefix_match_reference[0]",
    "test_decoder_stack.py::test_stack_equals_per_layer_modules_bit_for_bit[llama_hd64_inter100]",
    "test_decoder_stack.py::test_stack_equals_per_layer_modules_bit_for_bit[mistral_window]",
    "test_decoder_stack.py::test_stack_equals_per_layer_modules_bit_for_bit[qwen3_qk_norm]",
    "test_paged_bf16.py::test_bf16_rows_equal_fp32_attention_over_the_same_values[h4x4-d72-bs16]",
    "test_quant_gemm.py::test_int4_matches_the_dequantized_weight[50-96-32-17]",
    "test_quant_gemm.py::test_int8_groups_match_the_dequantized_weight[113-160-32-3]",
    "test_quant_gemm.py::test_int4_with_bf16_rows_within_the_bf16_bound[97-192-64-17]",
    "test_quant_gemm.py::test_int8_with_bf16_rows_within_the_bf16_bound[40-72-72-8]",
    "test_gemm_bf16.py::test_gemm_bf16_is_the_fp32_product_rounded_once[97-160-13]",
    "test_gemma_bf16.py::test_gelu_mul_bf16_takes_every_bf16_gate",
    "test_gemma_bf16.py::test_gemma_norm_bf16_is_eager_bf16[residual-7-100]",
    "test_kv_quant_native.py::test_one_key_reads_back_its_value_exactly_for_every_code[fp8_e4m3-40]",
    "test_kv_quant_native.py::test_native_attention_equals_dequantize_then_attend[mixed_bs16_d64-int8]",
    "test_kv_quant_native.py::test_decoder_stack_over_codes_equals_per_layer_modules_bit_for_bit"
    "[mistral_window-fp8_e5m2]",
)



# Beyond the kernels: where oneDNN, ATen and our flag reads choose the numbers.
# The model families once each against transformers (chunked prefill and decode), the default
# model's GGUF path, and the quantized KV cache through the engine.
ENGINE_TESTS = ("tests/test_w8a8.py", "tests/test_bf16_native.py",
                "tests/kernels/test_decoder_stack_bf16.py", "tests/test_moe_native.py",
                "tests/test_gguf_quant.py", "tests/test_models.py::"
                "test_matches_transformers_prefill_chunked_decode",
                "tests/test_models_gptoss.py::test_logits_match_transformers")
LANE_MUST_PASS = ("test_w8a8.py::test_this_process_serves_an_exact_path",
                  "test_bf16_native.py::test_native_bf16_is_as_close_to_fp32_as_eager_bf16"
                  "[gemma3_window_local_rope]")

_PROBE = """
import json, torch
from kserve_paged_kernels import int8_dynamic
from kserve_paged_kernels.cpu_native import isa, loader
assert loader.load() is not None
print(json.dumps({"level": loader.loaded_level().name, "aten": torch.backends.cpu.get_cpu_capability(),
                  "vnni": int8_dynamic.vnni(isa.cpu_flags()), "int8_exact": int8_dynamic.kernel_exact(),
                  "bf16": sorted(f for f in isa.cpu_flags() if "bf16" in f)}))
"""


def lane_environment(level: str) -> dict[str, str]:
    """This environment as a CPU of `level`: the libraries' caps replaced, not inherited (the
    suite itself may run under another cap)."""
    return {**os.environ, "KSERVE_PAGED_ISA": level, **cpu_cap.library_environment(level)}


def test_the_cap_tables_name_the_same_levels() -> None:
    assert list(cpu_cap.LIBRARY_CAPS) == list(isa.BY_NAME)


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_under_a_cap_every_machine_shows_the_flags_of_the_capped_level(
        machine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each machine type seen, capped at each level it has: our reads see that level's CPU
    (no VNNI, bf16 or AMX above it) and choose that level."""
    flags = frozenset(MACHINES[machine][0].split())
    monkeypatch.setattr(isa, "machine_flags", lambda: flags)
    for level in isa.available(flags):
        monkeypatch.setenv("KSERVE_PAGED_ISA", level.name)
        seen = isa.cpu_flags()
        assert isa.current() == level
        assert seen <= flags and level.needs <= seen
        assert all(f.startswith(cpu_cap.SIMD_PREFIXES) for f in flags - seen)
        upto = isa.LEVELS[:isa.LEVELS.index(level) + 1]
        allowed = frozenset().union(*(lv.needs for lv in upto))
        assert {f for f in seen if f.startswith(cpu_cap.SIMD_PREFIXES)} <= allowed


def test_the_cap_leaves_what_the_user_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KSERVE_PAGED_ISA", "avx2")
    environ = {cpu_cap.ONEDNN: "AVX512_CORE"}
    assert cpu_cap.apply(environ) == {cpu_cap.ATEN: "avx2", cpu_cap.MKL: "AVX2"}
    assert environ[cpu_cap.ONEDNN] == "AVX512_CORE"
    monkeypatch.setenv("KSERVE_PAGED_ISA", "auto")
    assert cpu_cap.apply({}) == {}


@pytest.mark.skipif(not LESSER, reason="this CPU's best level is the lowest: the suite ran it")
@pytest.mark.parametrize("level", LESSER)
def test_a_capped_process_runs_as_the_lesser_cpu(level: str) -> None:
    """`KSERVE_PAGED_ISA` alone caps our build, our flag reads, ATen and oneDNN (seen through
    its int8 product): the package sets the libraries' variables at import."""
    env = {k: v for k, v in os.environ.items() if k not in (cpu_cap.ONEDNN, cpu_cap.ATEN,
                                                            cpu_cap.MKL)}
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT,
                          env={**env, "KSERVE_PAGED_ISA": level}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    needs = isa.BY_NAME[level].needs
    assert seen["level"] == level
    assert seen["aten"] == cpu_cap.LIBRARY_CAPS[level][cpu_cap.ATEN].upper()
    assert seen["vnni"] == ("avx512_vnni" if "avx512_vnni" in needs else None)
    assert seen["int8_exact"] == (seen["vnni"] is not None)
    assert seen["bf16"] == sorted(f for f in needs if "bf16" in f)


@pytest.mark.slow  # a child pytest per level: minutes on two cores
@pytest.mark.skipif(not LESSER, reason="this CPU's best level is the lowest: the suite ran it")
@pytest.mark.parametrize("level", LESSER)
def test_cpu_sensitive_tests_pass_as_each_lesser_cpu(level: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:randomly", "-p", "no:cacheprovider",
         "-k", NATIVE_SELECTION, *NATIVE_TESTS, *ENGINE_TESTS], cwd=ROOT,
        env=lane_environment(level), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    must = (*LANE_MUST_PASS, *(AVX2_MUST_PASS if level == "avx2" else ()))
    for test in must:
        assert f"{test} PASSED" in proc.stdout, test
