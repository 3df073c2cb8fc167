"""The fused Triton ops (add + RMSNorm, RoPE + KV store, activation-and-multiply) against their
PyTorch definitions in kernels/reference.py. Without CUDA the kernels run in Triton's
interpreter, in one child process for the whole module (tests/kernels/interpreted.py says why);
the inputs are built and the results checked here.

Tolerances. Each kernel rounds where torch rounds (the residual sum, Llama's normed value
before the weight multiply, each RoPE product and sum, the activation before the multiply), so
what is left are float32 differences: the order of the mean-square sum (norm) and the last bit
of exp / rsqrt. fp32: atol 1e-5, rtol 1e-5 (values O(1); reordering a 100-term float32 sum
moves it by ~1e-7 relative). bf16: a float32 difference that straddles a rounding boundary
becomes one bf16 step, 2^-8 = 3.9e-3 relative, and Llama's norm rounds twice (normed value,
then the weight product), so rtol 8e-3 (2^-7), atol 1e-5; and at least 95% of the elements
must be bit-equal, so a rounding done in the wrong place (an fp32 result where torch rounds,
which moves most elements) fails even inside the bound. The residual sum, the RoPE rows and
the KV copies are bit-equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kserve_paged_kernels.reference import act_mul_ref, add_rms_norm_ref, rope_ref, store_kv_ref
from tests.kernels.interpreted import DEVICE, Call, run_calls

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-5, rtol=8e-3)}
EPS = 1e-6


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want.cpu(), **TOL[want.dtype])
    if want.dtype == torch.bfloat16:
        equal = (got.cpu() == want.cpu()).float().mean().item()
        assert equal >= 0.95, f"only {equal:.1%} bit-equal"


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=DEVICE)


# --- cases: each builds its inputs deterministically, so the child's calls and the checks
# --- below see the same tensors.

NORM_CASES = [(rows, hidden, gemma, dtype) for rows, hidden in [(1, 64), (5, 100)]
              for gemma in (False, True) for dtype in DTYPES]


def _norm_inputs(rows: int, hidden: int, gemma: bool, dtype: torch.dtype):
    x = _randn(rows, hidden, dtype=dtype, seed=hidden)
    residual = _randn(rows, hidden, dtype=dtype, seed=hidden + 1, scale=3.0)
    weight = _randn(hidden, dtype=dtype, seed=hidden + 2, scale=0.2) + (0 if gemma else 1)
    return x, residual, weight


def _strided_inputs():
    """Rows of a wider tensor (a view) and an fp32 weight over bf16 rows."""
    x = _randn(3, 80, dtype=torch.bfloat16, seed=7)[:, :48]
    return x, _randn(48, dtype=torch.float32, seed=8, scale=0.1) + 1


# (q heads, kv heads, head_dim): powers of two, and neither the head count nor half the
# head_dim a power of two (masked tiles).
ROPE_CASES = [(shape, dtype) for shape in [(4, 2, 16), (3, 1, 24)] for dtype in DTYPES]
ROPE_POSITIONS = [0, 39, 7, 3, 22, 1]
ROPE_SLOTS = [13, -1, 2, 19, -1, 6]  # two padding rows; the others in shuffled blocks


def _rope_inputs(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    width = (heads + 2 * kv_heads) * head_dim
    qkv = _randn(len(ROPE_POSITIONS), width, dtype=dtype, seed=head_dim)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(40).float(), inv_freq)
    cos, sin = angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)
    positions = torch.tensor(ROPE_POSITIONS, device=DEVICE)
    slots = torch.tensor(ROPE_SLOTS, device=DEVICE)
    cache = _randn(2, 5, 4, kv_heads, head_dim, dtype=dtype, seed=3)  # noise everywhere
    return qkv, positions, cos, sin, cache, slots


ACT_CASES = [(rows, inter, gelu, dtype) for rows, inter in [(3, 100), (2, 1500)]
             for gelu in (False, True) for dtype in DTYPES]


def _act_inputs(rows: int, inter: int, dtype: torch.dtype) -> torch.Tensor:
    return _randn(rows, 2 * inter, dtype=dtype, seed=inter, scale=2.0)


def _calls() -> dict[str, Call]:
    calls: dict[str, Call] = {}
    for case in NORM_CASES:
        x, residual, weight = _norm_inputs(*case)
        gemma = case[2]
        calls[f"norm{case}"] = ("kserve_paged_kernels.norm_triton", "add_rms_norm_triton",
                                (x, residual, weight, EPS), {"gemma": gemma})  # in place
        calls[f"norm-alone{case}"] = ("kserve_paged_kernels.norm_triton", "add_rms_norm_triton",
                                      (x, None, weight, EPS), {"gemma": gemma})
    x, weight = _strided_inputs()
    calls["norm-strided"] = ("kserve_paged_kernels.norm_triton", "add_rms_norm_triton",
                             (x, None, weight, 1e-5), {})
    for shape, dtype in ROPE_CASES:
        qkv, positions, cos, sin, cache, slots = _rope_inputs(*shape, dtype)
        heads, kv_heads, _ = shape
        calls[f"rope-store{shape}{dtype}"] = (
            "kserve_paged_kernels.rope_triton", "rope_store_triton",
            (qkv, positions, cos, sin, heads, kv_heads, cache, slots), {})
        calls[f"rope{shape}{dtype}"] = ("kserve_paged_kernels.rope_triton", "rope_store_triton",
                                        (qkv.clone(), positions, cos, sin, heads, kv_heads), {})
    qkv, positions, cos, sin, cache, slots = _rope_inputs(4, 2, 16, torch.float32)
    for name, args in {  # the layouts the RoPE kernel refuses (the caller then runs eager)
            "ok": (qkv, positions, cos, sin, 4, 2, cache, slots),
            "short-slots": (qkv, positions, cos, sin, 4, 2, cache, slots[:-1]),
            "no-slots": (qkv, positions, cos, sin, 4, 2, cache, None),
            "narrow-rows": (qkv[:, :100], positions, cos, sin, 4, 2, cache, slots),
            "cache-heads": (qkv, positions, cos, sin, 4, 2, cache[:, :, :, :1], slots),
            "column-stride": (torch.cat([qkv, qkv], 1)[:, ::2], positions, cos, sin, 4, 2,
                              None, None)}.items():
        calls[f"rope-usable-{name}"] = ("kserve_paged_kernels.rope_triton", "usable", args, {})
    for rows, inter, gelu, dtype in ACT_CASES:
        calls[f"act{(rows, inter, gelu, dtype)}"] = (
            "kserve_paged_kernels.act_triton", "act_mul_triton", (_act_inputs(rows, inter, dtype),),
            {"gelu": gelu})
    return calls


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    calls = _calls()
    out = run_calls(list(calls.values()), Path(tmp_path_factory.mktemp("fused")))
    return dict(zip(calls, out))


@pytest.mark.parametrize(("rows", "hidden", "gemma", "dtype"), NORM_CASES, ids=str)
def test_add_rms_norm_matches_reference(results: dict, rows: int, hidden: int, gemma: bool,
                                        dtype: torch.dtype) -> None:
    case = (rows, hidden, gemma, dtype)
    x, residual, weight = _norm_inputs(*case)
    want, want_sum = add_rms_norm_ref(x, residual, weight, EPS, gemma=gemma)
    got, (_, got_residual, *_) = results[f"norm{case}"]
    _close(got, want)
    assert torch.equal(got_residual, want_sum)  # updated in place to the exact sum
    alone, _ = results[f"norm-alone{case}"]
    _close(alone, add_rms_norm_ref(x, None, weight, EPS, gemma=gemma)[0])


def test_add_rms_norm_takes_strided_rows_and_promotes_to_an_fp32_weight(results: dict) -> None:
    x, weight = _strided_inputs()
    got, _ = results["norm-strided"]
    assert got.dtype == torch.float32  # torch's bf16 * fp32 multiply promotes
    _close(got, add_rms_norm_ref(x, None, weight, 1e-5)[0])


@pytest.mark.parametrize(("shape", "dtype"), ROPE_CASES, ids=str)
def test_rope_store_matches_reference(results: dict, shape: tuple[int, int, int],
                                      dtype: torch.dtype) -> None:
    heads, kv_heads, head_dim = shape
    qkv, positions, cos, sin, cache, slots = _rope_inputs(*shape, dtype)
    want_rows = rope_ref(qkv, positions, cos, sin, heads + kv_heads)
    tokens, q_end, k_end = qkv.shape[0], heads * head_dim, (heads + kv_heads) * head_dim
    want_cache = cache.clone()
    store_kv_ref(want_rows[:, q_end:k_end].reshape(tokens, kv_heads, head_dim),
                 want_rows[:, k_end:].reshape(tokens, kv_heads, head_dim), want_cache, slots)
    _, (got_rows, *_, got_cache, _) = results[f"rope-store{shape}{dtype}"]
    _, (rope_only, *_) = results[f"rope{shape}{dtype}"]
    assert torch.equal(got_rows, want_rows)  # q and k rotated in place, v untouched
    assert torch.equal(rope_only, want_rows)  # without a cache: the same rotation, no store
    # Stored slots hold the rotated k and the v; padding rows (-1) and other slots keep noise.
    assert torch.equal(got_cache, want_cache)


def test_rope_refuses_layouts_it_cannot_take(results: dict) -> None:
    verdicts = {k.removeprefix("rope-usable-"): v[0] for k, v in results.items()
                if k.startswith("rope-usable-")}
    assert verdicts == {"ok": True, "short-slots": False, "no-slots": False,
                        "narrow-rows": False, "cache-heads": False, "column-stride": False}


@pytest.mark.parametrize(("rows", "inter", "gelu", "dtype"), ACT_CASES, ids=str)
def test_act_mul_matches_reference(results: dict, rows: int, inter: int, gelu: bool,
                                   dtype: torch.dtype) -> None:
    got, _ = results[f"act{(rows, inter, gelu, dtype)}"]
    _close(got, act_mul_ref(_act_inputs(rows, inter, dtype), gelu=gelu))
