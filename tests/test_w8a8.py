"""W8A8 with int8 activations (compressed-tensors `int-quantized`, dynamic symmetric
`input_activations` per token or per tensor): which CPUs run it, the kernel against the int8
product, and a tiny model's logits against a float model that quantizes its activations the
same way (tight) and against the float model itself (loose).

The choice is made from the CPU's flags and from oneDNN's own kernel (`kernel_exact`): each
machine type's flags are stubbed here with the kernel's verdict stubbed too, so every machine
exercises every choice; what runs for real (the kernel, the served model's logits) is this
process's path, unstubbed, which the suite's capped lanes (tests/test_capped_lanes.py) also run
as an AVX2 and an AVX-512 machine. Without VNNI oneDNN's int8 product is not exact, and there
W8A8 runs weight-only."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kserve_paged_engine.model_executor.model_loader import load_model
from kserve_paged_engine.model_executor.quantization import compressed_tensors
from kserve_paged_engine.model_executor.quantization.layouts import projections
from kserve_paged_kernels import int8_dynamic, quant_linear
from kserve_paged_kernels.cpu_native.isa import cpu_flags
from tests.helpers.compressed_tensors_checkpoints import PROMPT, write
from tests.helpers.int4_packing import read_checkpoint
from tests.helpers.tiny_models import CONFIGS, PagedSim, save_checkpoint

CPU = torch.device("cpu")
# (machine, flags) -> the VNNI flag W8A8 runs on, None: weight-only.
MACHINES = {
    "zen3_avx2": (frozenset({"avx2", "fma", "f16c"}), None),
    "alder_lake_avx_vnni": (frozenset({"avx2", "fma", "avx_vnni"}), "avx_vnni"),
    "ice_lake": (frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni"}), "avx512_vnni"),
    "cooper_lake_bf16": (frozenset({"avx512f", "avx512_vnni", "avx512_bf16"}), "avx512_vnni"),
    "sapphire_rapids_amx": (frozenset({"avx512f", "avx512_vnni", "avx512_bf16", "amx_int8",
                                       "avx_vnni"}), "avx512_vnni"),
    "zen5": (frozenset({"avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni"}), "avx512_vnni"),
}


@pytest.fixture(scope="module")
def w8a8_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    src, _ = save_checkpoint(CONFIGS["llama_gqa_llama3"], tmp_path_factory.mktemp("float"))
    return {s: write(src, tmp_path_factory.mktemp(s), s) for s in ("w8a8", "w8a8_tensor")}


def _pick(folder: Path, name: str) -> tuple[str, object, torch.Tensor]:
    """The served layout of projection `name` and its checkpoint weight (float)."""
    reader = read_checkpoint(compressed_tensors.CTReader, compressed_tensors.read_config, folder)
    pick = reader.picker(torch.float32, triton=False)
    kept = dict(projections(load_model(folder / "float", torch.float32, CPU)[0]))
    fmt, weight = pick(name, kept[name])
    return fmt, weight, kept[name].weight


QKV = "model.layers.0.self_attn.qkv_proj"


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_each_machine_type_gets_its_choice(w8a8_folders: dict[str, Path], machine: str,
                                           monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """The choice given an exact kernel there (as oneDNN's is on a CPU with VNNI); only the
    weight-only layout is read back here: the int8 kernel runs on this process's real path."""
    flags, flag = MACHINES[machine]
    assert int8_dynamic.vnni(flags) == flag
    monkeypatch.setattr(compressed_tensors, "cpu_flags", lambda: flags)
    monkeypatch.setattr(int8_dynamic, "kernel_exact", lambda: True)
    with caplog.at_level(logging.INFO, logger="kserve_paged_engine"):
        fmt, weight, want = _pick(w8a8_folders["w8a8"], QKV)
    if flag is None:
        assert isinstance(weight, quant_linear.Int8Weight), fmt
        torch.testing.assert_close(quant_linear.dequant(weight), want, atol=1e-6, rtol=0)
        assert "this CPU has no VNNI" in caplog.text
    else:
        assert isinstance(weight, int8_dynamic.W8A8Weight), fmt
        torch.testing.assert_close(weight.scales * 127, want.abs().amax(1), rtol=1e-6, atol=0)
        assert f"products on this CPU's {flag}" in caplog.text


def test_vnni_flags_without_an_exact_kernel_run_weight_only(
        w8a8_folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A CPU that has VNNI but whose oneDNN runs without it (ONEDNN_MAX_CPU_ISA) is not sent
    down the int8 path: the flags are not what decides the kernel's numbers."""
    monkeypatch.setattr(compressed_tensors, "cpu_flags", lambda: MACHINES["ice_lake"][0])
    monkeypatch.setattr(int8_dynamic, "kernel_exact", lambda: False)
    with caplog.at_level(logging.INFO, logger="kserve_paged_engine"):
        fmt, weight, want = _pick(w8a8_folders["w8a8"], QKV)
    assert isinstance(weight, quant_linear.Int8Weight), fmt
    torch.testing.assert_close(quant_linear.dequant(weight), want, atol=1e-6, rtol=0)
    assert "oneDNN's int8 product is not exact on this CPU" in caplog.text


def test_this_process_serves_an_exact_path(w8a8_folders: dict[str, Path]) -> None:
    """Unstubbed: our flag reads and oneDNN agree on VNNI (a whole-process cap caps both), and
    whichever layout this CPU gets reads back the checkpoint's weight."""
    assert int8_dynamic.kernel_exact() == (int8_dynamic.vnni(cpu_flags()) is not None)
    fmt, weight, want = _pick(w8a8_folders["w8a8"], QKV)
    layout = int8_dynamic.W8A8Weight if int8_dynamic.kernel_exact() else quant_linear.Int8Weight
    assert isinstance(weight, layout), fmt
    torch.testing.assert_close(quant_linear.dequant(weight), want, atol=1e-6, rtol=0)


def test_kernel_is_the_int8_product() -> None:
    """Per token and per tensor, odd shapes, a zero row: exact int32 sums scaled in fp32."""
    if not int8_dynamic.kernel_exact():
        pytest.skip("oneDNN's int8 product is not exact on this CPU (no VNNI), so W8A8 is "
                    "not served here: test_this_process_serves_an_exact_path checks that")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 72, generator=g)
    scale = w.abs().amax(1) / 127
    codes = (w / scale[:, None]).round().to(torch.int8)
    for per_token in (True, False):
        weight = int8_dynamic.pack_w8a8(codes, scale[:, None], per_token)
        for rows in (1, 3, 17, 64):
            x = torch.randn(rows, 72, generator=g) * 4
            x[0] = 0
            q, sx = int8_dynamic.quantize_rows(x, per_token)
            assert q.dtype == torch.int8 and not q[0].any()
            assert rows == 1 or int(q.abs().max()) == 127
            want = (q.double() @ codes.double().t()) * sx.double() * scale.double()
            got = quant_linear.matmul(x, weight)
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-6)


def _fake_quant_inputs(model: torch.nn.Module, per_token: bool) -> None:
    """Each projection's input replaced by its int8 codes times their scales (`quantize_rows`),
    in float: the float model quantizing activations as W8A8 does."""
    def hook(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        x = args[0]
        q, s = int8_dynamic.quantize_rows(x.reshape(-1, x.shape[-1]), per_token)
        return ((q.float() * s).reshape(x.shape).to(x.dtype),)
    model.use_native_stack = False  # the one-call stack and the fused gate/up GEMM would
    for layer in model.model.layers:  # bypass the hooks
        layer.mlp._fused = None
    for _, linear in projections(model):
        linear.register_forward_pre_hook(hook)


@pytest.mark.parametrize("scheme", ["w8a8", "w8a8_tensor"])
def test_logits_against_float_with_the_same_activation_quantization(
        w8a8_folders: dict[str, Path], scheme: str) -> None:
    """This process's path: W8A8 against the float model quantizing its activations alike,
    or (without an exact int8 kernel) weight-only against the float model, tight either way."""
    folder = w8a8_folders[scheme]
    served, _ = load_model(folder, torch.float32, CPU)
    w8a8 = int8_dynamic.kernel_exact()
    layout = int8_dynamic.W8A8Weight if w8a8 else quant_linear.Int8Weight
    assert all(isinstance(m.quant, layout) for _, m in projections(served))
    plain, _ = load_model(folder / "float", torch.float32, CPU)
    mimic, _ = load_model(folder / "float", torch.float32, CPU)
    _fake_quant_inputs(mimic, per_token=scheme == "w8a8")
    got, want, float_logits = (PagedSim(m, seed=0).step([(0, PROMPT)])
                               for m in (served, mimic, plain))
    # Same quantization: the int32 sums are exact, so only fp32 rounding differs (2e-6 here).
    torch.testing.assert_close(got, want if w8a8 else float_logits, atol=1e-4, rtol=0)
    if not w8a8:
        return
    # Against the float model: the activations' rounding (half a step of max |row| / 127 a
    # value) moves these random logits by 3.5% (per token) and 4.7% (per tensor) of their
    # largest; bound: 6%.
    bound = 0.06 * float(float_logits.abs().max())
    torch.testing.assert_close(got, float_logits, atol=bound, rtol=0)
    assert not torch.equal(got, float_logits)


@pytest.mark.parametrize(("change", "strategy"), [
    ({}, "token"), ({"strategy": "tensor"}, "tensor"), ({"dynamic": False}, None),
    ({"symmetric": False}, None), ({"num_bits": 4}, None), ({"type": "float"}, None),
    ({"strategy": "group"}, None)])
def test_only_dynamic_symmetric_int8_activations_are_quantized(change: dict,
                                                               strategy: str | None) -> None:
    """Static scales, zero points and other widths keep float activations (weight-only)."""
    acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
            "dynamic": True} | change
    raw = {"quantization_config": {"format": "int-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8}, "input_activations": acts}}}}
    assert compressed_tensors.read_config(raw).dynamic_int8 == strategy
