"""A bf16 model on CPU through the native bf16 kernels (paged attention over the bf16 KV cache,
its prefill tiles where the head dim takes them, the fused norm, SiLU and KV store) against the
same model with the native library off (SDPA and eager bf16 ops), both measured against the
float32 model: prefill then decode steps over a shuffled paged cache, teacher-forced with the
float32 model's greedy tokens. The native path must be as close to float32 as the eager bf16
one (bf16 rounding differs in order, not in size), and both must pick the same greedy tokens
wherever float32's choice is wider than bf16 can blur (`_decided`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kserve_paged_engine.model_executor.layers import Linear
from kserve_paged_engine.model_executor.model_loader import load_model
from kserve_paged_kernels import cpu_native
from kserve_paged_kernels.cpu_native import ops, ops_gemma
from tests.helpers.tiny_models import CONFIGS, PagedSim, save_checkpoint

# Past Gemma's window of 8; 37 tokens: a prefill run for the bf16 tiles (head_dim 64 configs).
PROMPTS = {0: list(range(1, 38)), 1: list(range(40, 47))}
STEPS = 6


def _run(model, dtype: torch.dtype, forced: list[list[int]] | None = None  # noqa: ANN001
         ) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Logits of each sequence's last token per step, and the greedy tokens (or `forced`)."""
    sim = PagedSim(model, seed=3)
    sim.kv = [kv.to(dtype) for kv in sim.kv]
    logits = sim.step(list(PROMPTS.items()))
    ends = [len(PROMPTS[0]) - 1, len(PROMPTS[0]) + len(PROMPTS[1]) - 1]
    out = [logits[ends]]
    tokens = [forced[0] if forced else out[0].argmax(-1).tolist()]
    for i in range(STEPS):
        out.append(sim.step([(0, [tokens[-1][0]]), (1, [tokens[-1][1]])]))
        tokens.append(forced[i + 1] if forced else out[-1].argmax(-1).tolist())
    return out, [t.argmax(-1).tolist() for t in out]


def _counted(fn, calls: dict[str, int], name: str):  # noqa: ANN001, ANN202
    def wrapper(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        result = fn(*args, **kw)
        calls[name] += result is not None or name == "paged_rows"
        return result
    return wrapper


def _error(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max((a - r).abs().max().item() for a, r in zip(got, ref))


def _decided(ref: list[torch.Tensor], tokens: list[list[int]]) -> list[tuple[int, int]]:
    """The (step, sequence) positions whose float32 greedy token leads the runner-up by more
    than two bf16 steps at that logit's size. Below that, bf16 logits cannot order the two:
    on AVX2, ATen's bf16 kernels round the eager path's logits of two tokens 0.2 of a bf16
    step apart (in float32) to the same value, and argmax's tie-break picks the token, not the
    model. Greedy agreement is asserted where the model decides; the error bound everywhere."""
    out = []
    for step, logits in enumerate(ref):
        top = logits.float().topk(2, dim=-1).values
        for row, (first, second) in enumerate(top.tolist()):
            ulp = 2.0 ** (math.floor(math.log2(abs(first))) - 7) if first else 0.0
            if first - second > 2 * ulp:
                out.append((step, row))
    assert len(out) * 2 >= sum(len(t) for t in tokens), "too few decided positions to compare"
    return out


def _same_where_decided(a: list[list[int]], b: list[list[int]],
                        decided: list[tuple[int, int]]) -> None:
    differ = [(s, r, a[s][r], b[s][r]) for s, r in decided if a[s][r] != b[s][r]]
    assert not differ, f"greedy tokens differ where float32 decides: {differ}"


@pytest.mark.parametrize("name", ["llama_gqa_llama3", "llama_hd64_inter100",
                                  "gemma3_window_local_rope"])
def test_native_bf16_is_as_close_to_fp32_as_eager_bf16(name: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_native.load() is not None
    path, _ = save_checkpoint(CONFIGS[name], tmp_path)
    ref, tokens = _run(load_model(path, torch.float32, torch.device("cpu"))[0], torch.float32)
    model = load_model(path, torch.bfloat16, torch.device("cpu"))[0]
    calls = {"paged_rows": 0, "add_rms_norm": 0}
    for fn in calls:
        monkeypatch.setattr(cpu_native, fn, _counted(getattr(cpu_native, fn), calls, fn))
    stack = getattr(model, "native_stack", None)  # the one-call bf16 stack, where built
    if stack is not None:
        monkeypatch.setattr(stack, "run", _counted(stack.run, calls, "paged_rows"))
    native, native_tokens = _run(model, torch.bfloat16, tokens)
    assert calls["paged_rows"] > 0  # decode attention ran natively (per layer or in the stack)
    assert calls["add_rms_norm"] > 0 or name.startswith("gemma") or stack is not None
    monkeypatch.setattr(ops, "load", lambda: None)  # the fused ops' eager code
    monkeypatch.setattr(ops_gemma, "load", lambda: None)  # Gemma's too
    monkeypatch.setattr(cpu_native, "usable", lambda *a: False)  # gather + SDPA
    model.use_native_stack = False
    eager, eager_tokens = _run(model, torch.bfloat16, tokens)
    assert _error(native, ref) <= 1.25 * _error(eager, ref) + 0.05
    _same_where_decided(native_tokens, eager_tokens, _decided(ref, tokens))


@pytest.mark.parametrize("name", ["llama_gqa_llama3", "qwen2_tied", "gemma3_window_local_rope"])
def test_bf16_projections_on_the_native_gemm_pick_eager_bf16s_tokens(name: str,
                                                                     tmp_path: Path) -> None:
    """The projections through `Linear.pack()`'s choice (the native bf16 GEMM where
    `native_bf16_linear()` takes it, AVX512-BF16 without AMX; oneDNN's packed bf16 elsewhere)
    against the same model with every projection on plain F.linear in bf16: the same greedy
    tokens, and as close to the float32 model. Holds on every machine type (where the
    native GEMM is not chosen the two differ in packing only)."""
    path, _ = save_checkpoint(CONFIGS[name], tmp_path)
    ref, tokens = _run(load_model(path, torch.float32, torch.device("cpu"))[0], torch.float32)
    model = load_model(path, torch.bfloat16, torch.device("cpu"))[0]
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m._bf16_native == cpu_native.native_bf16_linear() for m in linears)
    packed, packed_tokens = _run(model, torch.bfloat16, tokens)
    for m in linears:
        m._packed, m._bf16_native = None, False  # forward falls back to F.linear
    plain, plain_tokens = _run(model, torch.bfloat16, tokens)
    _same_where_decided(packed_tokens, plain_tokens, _decided(ref, tokens))
    assert _error(packed, ref) <= 1.25 * _error(plain, ref) + 0.05
