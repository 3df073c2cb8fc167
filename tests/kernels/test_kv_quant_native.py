"""The native kernels of a quantized KV cache (csrc/kv_q8.c, csrc/paged_q8.c) against the
PyTorch reference (kernels/kserve_paged_kernels/kv_quant.py, kernels/kserve_paged_kernels/reference.py).

What holds on every machine type (AVX2-only, AVX-512 with or without BF16, AMX: the kernels
are one source over kp_vec.h, and test_isa.py runs this file at KSERVE_PAGED_ISA=avx2 too):
- the store writes the PyTorch store's codes and scales bit for bit (same fp32 operations,
  round to nearest even), growth, block restarts and skipped slots included;
- widening a code is exact: a context of one key returns that key's value, code * scale, for
  every code the store can write;
- attention equals dequantize-then-attend to fp32 summation order (2e-5 absolute on outputs
  of size ~1), decode rows (codes read directly) and prefill chunks (dequantized once in C).
"""

from __future__ import annotations

import pytest
import torch

import kserve_paged_kernels.cpu_kvq as cpu_kvq
from kserve_paged_kernels import AttentionMetadata, attend, cpu_native
from kserve_paged_kernels.kv_quant import QMAX, QuantKV, dequantize, storage_dtype, store_kv_quant
from kserve_paged_kernels.reference import paged_attention_ref
from kserve_paged_kernels.testing import make_case
from tests.helpers.span_cases import SPAN_CASES, span_case_id

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]



@pytest.fixture(autouse=True)
def _native_built() -> None:
    # gcc is part of the supported machine (README): a missing build must fail, not skip.
    assert cpu_native.load() is not None, "the native CPU kernels did not build"


def _codes(fmt: str) -> torch.Tensor:
    """Every finite code of the format the store can write (|value| <= its qmax)."""
    dtype = storage_dtype(fmt)
    if dtype == torch.int8:
        return torch.arange(-127, 128).to(torch.int8)
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    return codes[codes.float().isfinite() & (codes.float().abs() <= QMAX[dtype])]


@pytest.mark.parametrize("fmt", FORMATS)
def test_store_writes_the_pytorch_stores_codes_bit_for_bit(fmt: str) -> None:
    """Steps of scattered and consecutive slots (blocks restarted at offset 0, blocks that grow,
    a skipped slot, bf16 rows), then every code and every midpoint between two codes
    (ties to even) at scale 1."""
    g = torch.Generator().manual_seed(5)
    shape, dtype = (2, 24, 16, 3, 40), storage_dtype(fmt)
    ref, nat = QuantKV.zeros(shape, dtype), QuantKV.zeros(shape, dtype)
    for step in range(5):
        k = torch.randn(30, 3, 40, generator=g) * (1 + step) * torch.rand(30, 3, 1, generator=g) ** 3
        v = torch.randn(30, 3, 40, generator=g) * torch.randn(30, 3, 1, generator=g).exp()
        slots = (torch.randperm(24 * 16, generator=g)[:30] if step % 2
                 else torch.arange(step * 30, step * 30 + 30))
        slots[3] = -1
        if step == 4:
            k, v = k.bfloat16(), v.bfloat16()
        store_kv_quant(k, v, ref, slots)
        assert cpu_native.store_kv_q8(k, v, nat.data, nat.scales, slots)
        assert torch.equal(ref.data.view(torch.uint8), nat.data.view(torch.uint8)), step
        assert torch.equal(ref.scales, nat.scales), step
    values = _codes(fmt).float().sort().values
    x = torch.cat([values, (values[1:] + values[:-1]) / 2, torch.randn(500, generator=g) * 1e-3])
    x = torch.cat([torch.full((x.numel(), 1), QMAX[dtype]), x[:, None]], 1)  # scale 1 per row
    rows = x.view(-1, 1, 2)
    ref, nat = QuantKV.zeros((2, rows.shape[0], 1, 1, 2), dtype), QuantKV.zeros(
        (2, rows.shape[0], 1, 1, 2), dtype)
    store_kv_quant(rows, rows, ref, torch.arange(rows.shape[0]))
    cpu_native.store_kv_q8(rows, rows, nat.data, nat.scales, torch.arange(rows.shape[0]))
    assert bool((nat.scales == 1).all())
    assert torch.equal(ref.data.view(torch.uint8), nat.data.view(torch.uint8))


@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize("fmt", FORMATS)
def test_one_key_reads_back_its_value_exactly_for_every_code(fmt: str, head_dim: int) -> None:
    """Decode rows (codes read directly) and the first row of a prefill chunk (dequantized
    once in C) over one key: the softmax weight is 1, so the output is code * scale exactly."""
    codes = _codes(fmt)
    n = -(-codes.numel() // head_dim)
    padded = codes.view(torch.uint8).repeat(2)[:n * head_dim].view(codes.dtype)
    kv = QuantKV.zeros((2, n + 1, 4, 1, head_dim), codes.dtype)
    kv.data.view(torch.uint8)[1, :n, 0, 0] = padded.view(torch.uint8).view(n, head_dim)
    kv.scales[1, :, 0] = torch.linspace(0.01, 3.0, n + 1)
    want = dequantize(kv)[1, :n, 0, 0]  # [n, head_dim]
    tables = torch.arange(n).view(n, 1).to(torch.int32)
    # n decode sequences of one key each, then a sequence of two rows over block 0
    tables = torch.cat([tables, torch.zeros(1, 1, dtype=torch.int32)])
    lens = torch.tensor([1] * n + [1, 2], dtype=torch.int32)
    seq = torch.tensor(list(range(n)) + [n, n])
    out = torch.empty(n + 2, 2, head_dim)
    query = torch.randn(n + 2, 2, head_dim)
    cpu_native.paged_rows_q8(query, kv.data, kv.scales, tables, lens, torch.arange(n + 2), seq,
                             0.125, out)
    assert torch.equal(out[:n], want[:, None].expand(n, 2, head_dim))
    assert torch.equal(out[n], dequantize(kv)[1, 0, 0, 0].expand(2, head_dim))


# (name, seq_lens, q_lens, heads, kv_heads, head_dim, block_size, window, softcap)
CASES = [
    ("decode_bs16_d64", [1, 17, 70, 33, 129], [1] * 5, 9, 3, 64, 16, None, None),
    ("decode_bs8_d128", [3, 40, 90], [1] * 3, 8, 2, 128, 8, None, None),
    ("decode_bs32_d40", [31, 64, 5], [1] * 3, 4, 1, 40, 32, None, None),
    ("mixed_bs16_d64", [50, 9, 37, 70], [12, 1, 37, 1], 6, 2, 64, 16, None, None),
    ("mixed_bs4_d32", [19, 1, 23], [19, 1, 4], 4, 4, 32, 4, None, None),
    ("window_softcap", [30, 1, 45], [1, 1, 20], 4, 2, 64, 16, 7, 30.0),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case_def", SPAN_CASES, ids=span_case_id)
def test_decode_spans_equal_dequantize_then_attend(case_def: tuple, fmt: str) -> None:
    seq_lens, heads, kv_heads, head_dim, bs = case_def
    c = make_case(seq_lens, [1] * len(seq_lens), num_heads=heads, num_kv_heads=kv_heads,
                  head_dim=head_dim, block_size=bs, seed=heads, wide_table=True)
    c.query.mul_(3)  # peaked softmax rows: a wrong key, scale or span rescale would show
    kv = QuantKV.zeros(tuple(c.kv_cache.shape), storage_dtype(fmt))
    n = c.kv_cache.shape[1] * bs
    flat = c.kv_cache.reshape(2, n, kv_heads, head_dim)
    store_kv_quant(flat[0], flat[1], kv, torch.arange(n))
    # every (block, head) its own scale, so a key read with another's scale would show
    kv.scales.mul_(torch.rand(kv.scales.shape, generator=torch.Generator().manual_seed(1)) + 0.5)
    meta = AttentionMetadata.build(c.block_tables, c.seq_lens, c.query_start_loc, backend="cpu")
    for window in (None, 300):  # a window that starts inside a block, across spans
        ref = paged_attention_ref(c.query, dequantize(kv), c.block_tables, c.seq_lens,
                                  c.query_start_loc, c.scale, window=window)
        out = attend(c.query, kv, meta, c.scale, window=window)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_native_attention_equals_dequantize_then_attend(case: tuple, fmt: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _, seq_lens, q_lens, heads, kv_heads, head_dim, bs, window, softcap = case
    c = make_case(seq_lens, q_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                  block_size=bs, seed=len(seq_lens) + bs)
    kv = QuantKV.zeros(tuple(c.kv_cache.shape), storage_dtype(fmt))
    n = c.kv_cache.shape[1] * bs
    flat = c.kv_cache.reshape(2, n, kv_heads, head_dim)
    store_kv_quant(flat[0], flat[1], kv, torch.arange(n))
    ref = paged_attention_ref(c.query, dequantize(kv), c.block_tables, c.seq_lens,
                              c.query_start_loc, c.scale, window=window, softcap=softcap)
    # The backend's native path: no PyTorch dequantizing pass may run.
    monkeypatch.setattr(cpu_kvq, "dequantize", lambda *a, **k: pytest.fail("dequantized"))
    meta = AttentionMetadata.build(c.block_tables, c.seq_lens, c.query_start_loc, backend="cpu")
    out = attend(c.query, kv, meta, c.scale, window=window, softcap=softcap)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    out16 = attend(c.query.bfloat16(), kv, meta, c.scale, window=window, softcap=softcap)
    torch.testing.assert_close(out16.float(), paged_attention_ref(
        c.query.bfloat16().float(), dequantize(kv), c.block_tables, c.seq_lens,
        c.query_start_loc, c.scale, window=window, softcap=softcap), atol=1e-2, rtol=1e-2)


def _stack_equals_modules_over_codes(model, fmt: str) -> None:  # noqa: ANN001
    """The one-call stack and the per-layer modules over a fresh `fmt` cache each: the same
    logits, codes and scales."""
    from tests.helpers.decoder_stack_runs import Run, mixed_steps, stack_and_modules
    from tests.helpers.tiny_models import PagedSim

    def run(m) -> Run:  # noqa: ANN001
        sim = PagedSim(m, seed=3)
        sim.kv = [QuantKV.zeros(tuple(kv.shape), storage_dtype(fmt)) for kv in sim.kv]
        return [sim.step(batch) for batch in mixed_steps(11)], sim.kv

    stacked, layered = stack_and_modules(model, run)
    for a, b in zip(stacked[0], layered[0], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(stacked[1], layered[1], strict=True):
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
        assert torch.equal(a.scales, b.scales)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ["llama_gqa_llama3", "mistral_window"])
def test_decoder_stack_over_codes_equals_per_layer_modules_bit_for_bit(
        name: str, fmt: str, tmp_path) -> None:  # noqa: ANN001
    """The one-call stack takes a quantized cache (float32 models): the same store and
    attention kernels as the per-layer modules, so the same codes, scales and logits."""
    from kserve_paged_engine.model_executor.model_loader import load_model
    from tests.helpers.tiny_models import CONFIGS, save_checkpoint

    path, _ = save_checkpoint(CONFIGS[name], tmp_path)
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    assert model.native_stack is not None, model.native_stack_declined
    _stack_equals_modules_over_codes(model, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_engine_greedy_tokens_equal_the_pytorch_paths(fmt: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine served by the native store and attention (and its one-call stack), then by
    the PyTorch store and dequantize-then-attend: the same greedy tokens (chunked prefill over
    partly filled blocks, an n=2 fork), log-probabilities to fp32 summation order."""
    import kserve_paged_kernels.dispatch as dispatch
    from tests.helpers.kv_quant_child import serve

    runs = []
    real_run = cpu_native.DecoderStack.run
    monkeypatch.setattr(cpu_native.DecoderStack, "run",
                        lambda *a, **k: (runs.append(1), real_run(*a, **k))[1])
    native = serve(fmt)
    assert runs, "the one-call stack did not take the quantized cache"
    monkeypatch.setattr(dispatch.cpu_native, "store_kv_q8", lambda *a, **k: None)
    monkeypatch.setattr(cpu_kvq.cpu_native, "kvq_usable", lambda *a, **k: False)
    monkeypatch.setattr(cpu_native.DecoderStack, "takes_cache",
                        lambda self, cache: isinstance(cache, torch.Tensor))
    torch_path = serve(fmt)
    assert native["tokens"] == torch_path["tokens"]
    for a, b in zip(native["logprobs"], torch_path["logprobs"]):
        assert a == pytest.approx(b, abs=1e-4)
    assert native["free"] == torch_path["free"]


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_bf16_stack_over_codes_equals_per_layer_modules_bit_for_bit(fmt: str, tmp_path) -> None:  # noqa: ANN001
    """Where the bf16 stack is built (AVX512-BF16 without AMX: test_decoder_stack_bf16.py
    says where), it widens q, k, v to fp32 and rounds the output once, as the per-layer
    modules do: the same logits, codes and scales. Elsewhere a bf16 model runs per layer."""
    from kserve_paged_engine.model_executor.model_loader import load_model
    from tests.helpers.tiny_models import CONFIGS, save_checkpoint

    path, _ = save_checkpoint(CONFIGS["llama_hd64_inter100"], tmp_path)
    model, _ = load_model(path, torch.bfloat16, torch.device("cpu"))
    if model.native_stack is None:
        assert not cpu_native.native_bf16_linear()
        return
    _stack_equals_modules_over_codes(model, fmt)
