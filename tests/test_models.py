"""Our paged Llama-family model against transformers on tiny random checkpoints.

Each checkpoint is saved with `save_pretrained` and loaded back through our loader. Sequences of
different lengths run in one varlen batch over a paged cache with shuffled block ids: a prefill,
a chunked prefill (second half of a prompt over the cached first half) and decode steps. Every
scheduled token's logits must match transformers' full-sequence forward (float32, atol 1e-4).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


from kserve_paged_engine.model_executor.model_loader import load_model  # noqa: E402
from tests.helpers.tiny_models import (  # noqa: E402
    CONFIGS,
    VOCAB,
    PagedSim,
    save_checkpoint,
    save_tokenizer,
)

ATOL = 1e-4
RTOL = 1e-4


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_transformers_prefill_chunked_decode(name: str, tmp_path: Path) -> None:
    path, ref = save_checkpoint(CONFIGS[name], tmp_path)
    model, config = load_model(path, torch.float32, torch.device("cpu"))
    assert model.num_layers == config.num_hidden_layers
    assert model.head_dim == (getattr(config, "head_dim", None)
                              or config.hidden_size // config.num_attention_heads)

    g = torch.Generator().manual_seed(1)
    prompt_lens, decode_steps = [5, 17, 33], 3
    seqs = [torch.randint(0, VOCAB, (n + decode_steps,), generator=g).tolist()
            for n in prompt_lens]
    with torch.inference_mode():
        expected = [ref(torch.tensor([s])).logits[0].float() for s in seqs]

    sim = PagedSim(model, seed=7)
    got: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}

    def run(batch: list[tuple[int, list[int]]]) -> None:
        logits = sim.step(batch)
        offset = 0
        for sid, new in batch:
            got[sid].append(logits[offset: offset + len(new)])
            offset += len(new)

    half = prompt_lens[2] // 2
    # Step 1: two whole prompts and the first half of the third, in one varlen batch.
    run([(0, seqs[0][:5]), (1, seqs[1][:17]), (2, seqs[2][:half])])
    # Step 2: two decodes plus the chunked second half on top of the cached first half.
    run([(0, seqs[0][5:6]), (1, seqs[1][17:18]), (2, seqs[2][half:33])])
    # Steps 3-5: decodes (sequence 2 joins decoding a step later than the others).
    run([(0, seqs[0][6:7]), (1, seqs[1][18:19]), (2, seqs[2][33:34])])
    run([(1, seqs[1][19:20]), (0, seqs[0][7:8]), (2, seqs[2][34:35])])
    run([(2, seqs[2][35:36])])

    for sid in range(3):
        ours = torch.cat(got[sid])
        torch.testing.assert_close(ours, expected[sid][: ours.shape[0]], atol=ATOL, rtol=RTOL,
                                   msg=lambda m, sid=sid: f"{name} seq {sid}: {m}")
        assert ours.shape[0] == len(seqs[sid])
        assert ours.dtype == torch.float32


def test_tied_head_shares_storage(tmp_path: Path) -> None:
    path, _ = save_checkpoint(CONFIGS["qwen2_tied"], tmp_path)
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("name", ["llama_gqa_llama3", "gemma3_window_local_rope"])
def test_bfloat16_load_runs(name: str, tmp_path: Path) -> None:
    path, ref = save_checkpoint(CONFIGS[name], tmp_path)
    model, _ = load_model(path, torch.bfloat16, torch.device("cpu"))
    assert model.lm_head.weight.dtype == torch.bfloat16
    sim = PagedSim(model)
    sim.kv = [kv.to(torch.bfloat16) for kv in sim.kv]
    tokens = list(range(1, 22))  # past the Gemma config's window of 8
    logits = sim.step([(0, tokens)])
    with torch.inference_mode():
        expected = ref(torch.tensor([tokens])).logits[0]
    assert logits.dtype == torch.float32
    # bfloat16 through 2 layers: loose, but catches layout bugs.
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("name", ["gemma2_window_softcap", "gemma3_window_local_rope"])
def test_gemma_float32_norms_take_the_native_kernels(name: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """In float32 on CPU every Gemma norm runs on the native RMSNorm with `1 + weight` kept at
    packing: transformers' values to float rounding, the residual updated in place; Gemma 3's
    q/k norm runs in place on the fused qkv rows (so its RoPE is native too). In bfloat16 the
    same fp32 `1 + weight` is kept (for Gemma's bf16 kernels: the next test)."""
    from kserve_paged_engine.model_executor.models.gemma import GemmaRMSNorm
    from kserve_paged_kernels import cpu_native

    assert cpu_native.gemm_available(), "the native CPU kernels did not build"
    path, _ = save_checkpoint(CONFIGS[name], tmp_path)
    model, config = load_model(path, torch.float32, torch.device("cpu"))
    norms = [m for m in model.modules() if isinstance(m, GemmaRMSNorm)]
    assert len(norms) >= 4 * config.num_hidden_layers + 1
    assert all(n.offset_weight is not None for n in norms)
    calls: list[int] = []
    real = cpu_native.gemma_add_rms_norm  # in fp32, the native RMSNorm (the same order)
    monkeypatch.setattr(cpu_native, "gemma_add_rms_norm",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(3)
    norm = model.model.layers[0].pre_feedforward_layernorm
    with torch.no_grad():
        norm.weight.copy_(torch.randn(norm.weight.shape, generator=g))
    norm.pack()
    x, residual = (torch.randn(5, config.hidden_size, generator=g) for _ in range(2))
    want_sum = x + residual
    with torch.inference_mode():
        got, summed = norm(x, residual)
    assert calls and summed is residual
    torch.testing.assert_close(summed, want_sum, rtol=0, atol=0)
    torch.testing.assert_close(got, norm._norm(want_sum), rtol=1e-5, atol=1e-6)

    attn = model.model.layers[0].self_attn
    if attn.q_norm is not None:
        qkv = torch.randn(3, attn.q_size + 2 * attn.kv_size, generator=g)
        q = qkv[:, :attn.q_size].reshape(-1, attn.head_dim)
        with torch.inference_mode():
            want_q = attn.q_norm._norm(q)
            assert attn._norm_heads_(qkv)
        torch.testing.assert_close(qkv[:, :attn.q_size].reshape(-1, attn.head_dim), want_q,
                                   rtol=1e-5, atol=1e-6)

    bf16, _ = load_model(path, torch.bfloat16, torch.device("cpu"))
    assert all(m.offset_weight.dtype == torch.float32
               for m in bf16.modules() if isinstance(m, GemmaRMSNorm))


@pytest.mark.parametrize("name", ["gemma2_window_softcap", "gemma3_window_local_rope"])
def test_gemma_bfloat16_takes_the_native_kernels(name: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """In bfloat16 on CPU (per-layer modules: the bf16 stack declines Gemma) every Gemma norm,
    Gemma 3's q/k norm with the RoPE after it, and the GELU-and-multiply run on the native
    kernels, each rounded as transformers' Gemma rounds: the logits are the torch ops' (those
    kernels declined) and as close to transformers' bf16 as those are."""
    from kserve_paged_kernels import cpu_native

    path, ref = save_checkpoint(CONFIGS[name], tmp_path)
    model, config = load_model(path, torch.bfloat16, torch.device("cpu"))
    assert model.native_stack is None
    qk = config.model_type == "gemma3_text"
    names = ["gemma_add_rms_norm", "gelu_mul"] + (["gemma_qk_norm_inplace", "rope_inplace"]
                                                  if qk else [])
    real = {n: getattr(cpu_native, n) for n in names}
    calls = dict.fromkeys(names, 0)

    def run(native: bool) -> torch.Tensor:
        for n in names:
            monkeypatch.setattr(cpu_native, n, (lambda *a, n=n, **k: calls.__setitem__(
                n, calls[n] + 1) or real[n](*a, **k)) if native else (lambda *a, **k: None))
        sim = PagedSim(model)
        sim.kv = [kv.to(torch.bfloat16) for kv in sim.kv]
        return torch.cat([sim.step([(0, list(range(1, 22)))]), sim.step([(0, [5])])])

    ours = run(True)
    layers = config.num_hidden_layers
    assert calls == {"gemma_add_rms_norm": 2 * (4 * layers + 1), "gelu_mul": 2 * layers,
                     **({"gemma_qk_norm_inplace": 2 * layers, "rope_inplace": 2 * layers}
                        if qk else {})}
    eager = run(False)
    torch.testing.assert_close(ours, eager, rtol=0.02, atol=0.02)  # equal here, bit for bit
    with torch.inference_mode():
        expected = ref.to(torch.bfloat16)(torch.tensor([list(range(1, 22)) + [5]])).logits[0]
    agree = (ours.argmax(-1) == expected.argmax(-1)).float().mean()
    assert agree >= (eager.argmax(-1) == expected.argmax(-1)).float().mean() - 0.05


# --- greedy decoding through the engine, past the sliding window -----------------------------


@pytest.mark.parametrize("name", ["gemma2_window_softcap", "gemma3_window_local_rope",
                                  "mistral_window", "phi3_window_mha", "mixtral_4x_top2",
                                  "qwen3_moe_4x_top2"])
@pytest.mark.slow
def test_greedy_equals_generate_past_the_window(name: str, tmp_path: Path) -> None:
    """Prompts 3-5x the window, 12 new tokens: the engine's greedy tokens equal transformers'
    generate with prefix caching on (run twice, the second run hitting the cache) and off
    with chunked prefill and preemptions."""
    from kserve_paged_engine import LLM, SamplingParams

    path, ref = save_checkpoint(CONFIGS[name], tmp_path)
    save_tokenizer(path)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (25, 40, 31, 18)]
    prompts.append(prompts[1][:36] + [5, 6])  # shares 9 full blocks with prompt 1
    new = 12
    ref.generation_config.eos_token_id = None
    with torch.inference_mode():
        expected = [ref.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                    for p in prompts]
    greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)

    cached = LLM(model=str(path), block_size=4, num_kv_blocks=128, max_model_len=64)
    for _ in range(2):
        outs = cached.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert cached.stats()["prefix_cache_hits"] > 0
    assert outs[4].num_cached_tokens > 0
    # Blocks left the requests as they fell out of the window: every layer's (Mistral, Phi-3)
    # or the sliding layers' own KV groups' (Gemma; its global layers keep theirs).
    windows = cached.engine.model.layer_windows
    all_slide = all(w is not None for w in windows)
    mixed = len(set(windows)) > 1
    assert cached.engine.kv.num_groups == (len(windows) if mixed else 1)  # 1 layer each
    freed = cached.stats()["kv_blocks_freed_out_of_window"]
    assert (freed > 0) == any(w is not None for w in windows)
    assert cached.stats()["kv_blocks_free"] == 128  # nothing leaked

    # A pool too small for all five at once (blocks hold one layer's K/V per KV group for
    # Gemma, every layer's for the others).
    pool = 40 if mixed else 16 if all_slide else 30
    plain = LLM(model=str(path), block_size=4, num_kv_blocks=pool, max_model_len=64,
                enable_prefix_caching=False, max_num_batched_tokens=16)
    outs = plain.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = plain.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_free"] == pool
    if mixed:  # and with one block table for every layer, as before KV groups
        shared = LLM(model=str(path), block_size=4, num_kv_blocks=32, max_model_len=64,
                     max_num_batched_tokens=16, disable_hybrid_kv_cache_manager=True)
        outs = shared.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert shared.engine.kv.num_groups == 1
        assert shared.stats()["kv_blocks_freed_out_of_window"] == 0


def test_samples_fork_from_a_table_whose_blocks_left_the_window(tmp_path: Path) -> None:
    """n > 1 on a model whose every layer slides: the samples fork after a prompt longer than
    the window, whose leading blocks are already back in the pool; greedy samples all equal
    transformers' generate, and every block comes back."""
    from kserve_paged_engine import LLM, SamplingParams

    path, ref = save_checkpoint(CONFIGS["mistral_window"], tmp_path)
    save_tokenizer(path)
    prompt = torch.randint(2, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    ref.generation_config.eos_token_id = None
    with torch.inference_mode():
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10,
                                do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(model=str(path), block_size=4, num_kv_blocks=64, max_model_len=64)
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=10, temperature=0.0,
                                                ignore_eos=True), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [expected] * 3
    stats = llm.stats()
    assert stats["kv_blocks_freed_out_of_window"] > 0 and stats["kv_blocks_in_use"] == 0


def test_moe_experts_run_grouped_by_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sparse layer's experts are one gate/up and one down matmul per expert that got tokens,
    however many tokens there are; top-k picks and weights match a direct computation."""
    import kserve_paged_engine.model_executor.models.moe as moe

    torch.manual_seed(0)
    layer = moe.SparseMoE(hidden=16, inter=8, num_experts=4, top_k=2, renormalize=True)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(200, 16)
    calls: list[int] = []
    real = moe.F.linear
    monkeypatch.setattr(moe.F, "linear", lambda a, w, b=None: (calls.append(a.shape[0]),
                                                               real(a, w, b))[1])
    with torch.no_grad():
        out = layer(x)
    # The router over all 200 tokens, then 4 experts x (gate/up, down) over their own tokens.
    assert calls[0] == 200 and len(calls) == 1 + 2 * 4 and sum(calls[1:]) == 2 * 2 * 200
    monkeypatch.undo()
    with torch.no_grad():
        probs = torch.softmax(x @ layer.gate.weight.T, dim=-1)
        w, idx = probs.topk(2, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        expected = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(2):
                e = int(idx[t, j])
                g, u = (layer.experts_gate_up[e] @ x[t]).chunk(2)
                expected[t] += w[t, j] * (layer.experts_down[e] @ (torch.nn.functional.silu(g) * u))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_gemma_kv_groups_with_samples_beams_and_speculation(tmp_path: Path) -> None:
    """A Gemma 3 with its sliding layers in their own KV groups, prompts past the window: n = 2
    greedy samples (forks), beam search and n-gram speculation give what one shared table
    gives (greedy: transformers' tokens), under a small pool, and every block comes back."""
    from kserve_paged_engine import LLM, SamplingParams

    path, ref = save_checkpoint(CONFIGS["gemma3_window_local_rope"], tmp_path)
    save_tokenizer(path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (21, 30)]
    passage = torch.randint(3, VOCAB, (22,), generator=g).tolist()
    prompts.append(passage + [2] + passage[:11])  # its answer repeats it: drafts are found
    new = 10
    ref.generation_config.eos_token_id = None
    with torch.inference_mode():
        expected = [ref.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                    for p in prompts]
    two = SamplingParams(n=2, max_tokens=new, temperature=0.0, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}
    kw = dict(model=str(path), block_size=4, max_model_len=64, max_num_batched_tokens=16)
    shared = LLM(num_kv_blocks=48, disable_hybrid_kv_cache_manager=True, **kw)
    beams_shared = [[c.token_ids for c in o.outputs]
                    for o in shared.beam_search(prompts[:2], 2, new)]
    for llm in (LLM(num_kv_blocks=40, **kw), LLM(num_kv_blocks=40, speculative_config=spec,
                                                  **kw)):
        assert llm.engine.kv.num_groups == 4
        outs = llm.generate(prompts, two, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[e, e] for e in expected]
        beams = [[c.token_ids for c in o.outputs] for o in llm.beam_search(prompts[:2], 2, new)]
        assert beams == beams_shared
        one = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0,
                                                   ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in one] == expected
        stats = llm.stats()
        assert stats["kv_blocks_freed_out_of_window"] > 0
        assert stats["kv_blocks_free"] == 40 and stats["kv_blocks_in_use"] == 0
    assert stats.get("spec_decode_num_accepted_tokens", 0) > 0
