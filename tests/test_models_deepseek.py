"""DeepSeek-V3 (multi-head latent attention on a paged latent cache, grouped MoE routing)
against transformers on tiny random checkpoints (tests/helpers/tiny_deepseek.py).

The latent cache's two attention paths, absorbed and expanded, each equal transformers and
each other through a varlen prefill, a chunked prefill and decodes over shuffled blocks full of
garbage; the engine's greedy tokens equal transformers' generate through chunked prefill,
preemption, prefix hits and n > 1; an int8 latent cache stays close; the planner gives MLA's
KV bytes per token and the engine allocates exactly that.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kserve_paged_engine.model_executor.model_loader import load_model  # noqa: E402
from kserve_paged_engine.model_executor.models.mla import MLAttention  # noqa: E402
from kserve_paged_kernels.kv_quant import QuantKV  # noqa: E402
from tests.helpers.tiny_deepseek import DEEPSEEK_CONFIGS, save_deepseek  # noqa: E402
from tests.helpers.tiny_models import VOCAB, PagedSim, save_tokenizer  # noqa: E402

ATOL = RTOL = 1e-4
MODES = ("absorbed", "expanded", "auto")


def _schedule(sim: PagedSim, seqs: list[list[int]]) -> list[torch.Tensor]:
    """test_models.py's steps: three prompts in one varlen batch (the third's first half), the
    third's second half chunked over its cached first half beside two decodes, then decodes.
    Every scheduled token's logits, per sequence."""
    got: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}

    def run(batch: list[tuple[int, list[int]]]) -> None:
        logits, offset = sim.step(batch), 0
        for sid, new in batch:
            got[sid].append(logits[offset: offset + len(new)])
            offset += len(new)

    run([(0, seqs[0][:5]), (1, seqs[1][:17]), (2, seqs[2][:16])])
    run([(0, seqs[0][5:6]), (1, seqs[1][17:18]), (2, seqs[2][16:33])])
    run([(0, seqs[0][6:7]), (1, seqs[1][18:19]), (2, seqs[2][33:34])])
    run([(1, seqs[1][19:20]), (0, seqs[0][7:8]), (2, seqs[2][34:35])])
    run([(2, seqs[2][35:36])])
    return [torch.cat(got[sid]) for sid in range(3)]


@pytest.mark.parametrize("name", sorted(DEEPSEEK_CONFIGS))
def test_absorbed_and_expanded_each_match_transformers(name: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    ref = save_deepseek(name, tmp_path)
    model, _ = load_model(tmp_path, torch.float32, torch.device("cpu"))
    assert (model.num_kv_heads, model.head_dim) == (1, model.kv_latent_dim // 2)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n + 3,), generator=g).tolist() for n in (5, 17, 33)]
    with torch.inference_mode():
        expected = [ref(torch.tensor([s])).logits[0].float() for s in seqs]

    calls = {"_absorbed": 0, "_expanded": 0}
    for path in calls:  # count which path each mode really took
        original = getattr(MLAttention, path)

        def counted(self, *args, _original=original, _path=path):  # noqa: ANN001, ANN202
            calls[_path] += 1
            return _original(self, *args)
        monkeypatch.setattr(MLAttention, path, counted)

    results = {}
    for mode in MODES:
        model.set_mla_mode(mode)
        before = dict(calls)
        results[mode] = _schedule(PagedSim(model, seed=7), seqs)
        took = {p: calls[p] - before[p] for p in calls}
        if mode != "auto":
            other = "_expanded" if mode == "absorbed" else "_absorbed"
            assert took[other] == 0 and took[f"_{mode}"] > 0, (mode, took)
        else:  # prefills expand, decodes absorb
            assert took["_absorbed"] > 0 and took["_expanded"] > 0, took
        for sid, ours in enumerate(results[mode]):
            torch.testing.assert_close(ours, expected[sid][: ours.shape[0]], atol=ATOL,
                                       rtol=RTOL, msg=lambda m, s=sid, md=mode: f"{md} seq {s}: {m}")
    for a, b in zip(results["absorbed"], results["expanded"], strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


@pytest.mark.slow  # the whole model's steps in Triton's interpreter
def test_absorbed_steps_in_the_triton_kernel_match_transformers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, triton_interpreter) -> None:  # noqa: ANN001
    """With the triton backend (interpreted without CUDA), a step whose sequences all absorb
    runs one Triton kernel over every row (kernels/kserve_paged_kernels/mla_triton.py): the
    same logits as transformers through the same schedule."""
    triton_interpreter.load("kserve_paged_kernels.triton_backend")
    triton_interpreter.load("kserve_paged_kernels.mla_triton")
    monkeypatch.setenv("KSERVE_PAGED_ATTENTION_BACKEND", "triton")
    ref = save_deepseek("deepseek_v3_yarn_qproj", tmp_path)  # 2 layers: the interpreter is slow
    model, _ = load_model(tmp_path, torch.float32, torch.device("cpu"))
    seqs = [list(range(3, 11)), list(range(20, 40)), list(range(40, 76))]
    with torch.inference_mode():
        expected = [ref(torch.tensor([s])).logits[0].float() for s in seqs]
    ran = []
    original = MLAttention._absorbed_triton

    def counted(self, *args):  # noqa: ANN001, ANN202
        ran.append(1)
        return original(self, *args)
    monkeypatch.setattr(MLAttention, "_absorbed_triton", counted)
    model.set_mla_mode("absorbed")
    got = _schedule(PagedSim(model, seed=7), seqs)
    assert len(ran) == 5 * model.num_layers  # every step, every layer
    for sid, ours in enumerate(got):
        torch.testing.assert_close(ours, expected[sid][: ours.shape[0]], atol=ATOL, rtol=RTOL)


def _garbage_int8(shape: tuple[int, ...], seed: int) -> QuantKV:
    """An int8 latent cache full of finite garbage codes and scales (a reused cache)."""
    kv = QuantKV.zeros(shape, torch.int8)
    g = torch.Generator().manual_seed(seed)
    kv.data.copy_(((torch.rand(shape, generator=g) * 2 - 1) * 127).round().to(torch.int8))
    kv.scales.copy_(torch.rand(kv.scales.shape, generator=g) * 10)
    return kv


def test_int8_latent_cache_stays_close_in_both_paths(tmp_path: Path) -> None:
    """The quantized cache holds the latent row as its two halves, one scale per block for
    each: logits within int8's tolerance of the float cache (the figure of
    tests/test_kv_quant_engine.py), absorbed and expanded equal over the same codes; the engine
    serves from it."""
    save_deepseek("deepseek_v3_mla", tmp_path)
    model, _ = load_model(tmp_path, torch.float32, torch.device("cpu"))
    seqs = [list(range(3, 39)), list(range(50, 86)), list(range(10, 46))]
    model.set_mla_mode("expanded")
    exact = _schedule(PagedSim(model, seed=7), seqs)
    quantized = {}
    for mode in ("absorbed", "expanded"):
        model.set_mla_mode(mode)
        sim = PagedSim(model, seed=7)
        sim.kv = [_garbage_int8(tuple(kv.shape), i) for i, kv in enumerate(sim.kv)]
        quantized[mode] = _schedule(sim, seqs)
    for q, e in zip(quantized["expanded"], exact, strict=True):
        err = (q - e).abs().max().item()
        assert 0 < err < 0.2, err
    for a, b in zip(quantized["absorbed"], quantized["expanded"], strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)

    # The engine allocates the int8 latent cache (codes and scales) at the same block shape
    # and serves from it: two samples forked over it, every block back.
    from kserve_paged_engine import LLM, SamplingParams

    save_tokenizer(tmp_path)
    llm = LLM(model=str(tmp_path), block_size=4, num_kv_blocks=16, max_model_len=32,
              kv_cache_dtype="int8")
    cache = llm.engine.runner.kv_caches[0]
    assert isinstance(cache, QuantKV) and tuple(cache.shape) == (2, 16, 4, 1, 24)
    out = llm.generate([seqs[0][:17]], SamplingParams(n=2, max_tokens=5, temperature=0.0,
                                                      ignore_eos=True), use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [5, 5]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids
    assert llm.stats()["kv_blocks_free"] == 16


def test_engine_greedy_through_chunks_preemption_prefix_hits_and_samples(tmp_path: Path
                                                                           ) -> None:
    """The engine over latent blocks: greedy tokens equal transformers' generate with a
    16-token step budget (chunked prefill) and too few blocks for all four (preemption), run
    twice (the second hitting the prefix cache, and a prompt sharing 6 blocks with another);
    n=3 greedy samples fork the prompt's blocks copy-on-write, beam search (width 3) equals
    transformers' beams; every block comes back."""
    from kserve_paged_engine import LLM, SamplingParams

    ref = save_deepseek("deepseek_v3_mla", tmp_path)
    save_tokenizer(tmp_path)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (25, 31, 18)]
    prompts.append(prompts[1][:24] + [5, 6])
    new = 8
    ref.generation_config.eos_token_id = None
    with torch.inference_mode():
        expected = [ref.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                    for p in prompts]
    greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    pool = 24
    llm = LLM(model=str(tmp_path), block_size=4, num_kv_blocks=pool, max_model_len=64,
              max_num_batched_tokens=16)
    assert llm.engine.runner.kv_caches[0].shape == (2, pool, 4, 1, 24)
    for _ in range(2):
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert outs[3].num_cached_tokens > 0
    samples = llm.generate([prompts[0]], SamplingParams(n=3, max_tokens=new, temperature=0.0,
                                                        ignore_eos=True), use_tqdm=False)[0]
    assert [c.token_ids for c in samples.outputs] == [expected[0]] * 3
    with torch.inference_mode():  # beams fork and prune latent blocks
        beams = ref.generate(torch.tensor([prompts[2]]), num_beams=3, num_return_sequences=3,
                             max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             pad_token_id=0)[:, len(prompts[2]):].tolist()
    out = llm.beam_search([prompts[2]], beam_width=3, max_tokens=6, ignore_eos=True)[0]
    assert [c.token_ids for c in out.outputs] == beams
    assert llm.stats()["kv_cow_copies"] > 0
    assert llm.stats()["kv_blocks_free"] == pool


def test_plan_gives_mla_kv_bytes_per_token(capsys: pytest.CaptureFixture[str]) -> None:
    """`kserve-paged plan` on DeepSeek-V3's config.json (tests/data/models/deepseek-v3, no
    weights): one latent of 512 + 64 values per token and layer, 61 layers, bf16: 70,272
    bytes per token, not the 61 x 2 x 128 heads x 192 of per-head K/V; 671B parameters (the
    MTP layer is not built); a tensor-parallel plan is refused, as the engine refuses it."""
    from kserve_paged.__main__ import main as cli_main
    from tests.helpers.manifests import REPO

    model = REPO / "tests" / "data" / "models" / "deepseek-v3"
    assert cli_main(["plan", "--model", str(model), "--gpu", "h200", "--dtype", "bfloat16",
                     "--max_model_len", "8192", "--block_size", "64"]) == 0
    out = capsys.readouterr().out
    per_token = 61 * (512 + 64) * 2
    assert f"KV per token {per_token} bytes per device ({per_token * 64} per block" in out
    assert "MLA latent cache of 576 values per token and layer" in out
    assert "671.03B parameters" in out
    with pytest.raises(SystemExit):
        cli_main(["plan", "--model", str(model), "--gpu", "h200", "--tensor_parallel_size", "8"])
    assert "DeepseekV3ForCausalLM is not sharded" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_weight_only_quantization_keeps_both_attention_paths(method: str, tmp_path: Path
                                                             ) -> None:
    """`--quantization int8|int4` quantizes kv_b_proj with every other projection; the absorbed
    path reads its weight (W_UK, W_UV), so it must read what the quantized weight stands for.
    Absorbed and expanded agree on the quantized model's logits."""
    from kserve_paged_engine import LLM, SamplingParams

    save_deepseek("deepseek_v3_mla", tmp_path)
    save_tokenizer(tmp_path)
    prompt = list(range(5, 30))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = {}
    for mode in ("absorbed", "expanded"):
        # A cache for the one prompt: the default (a share of this machine's memory) is
        # millions of 4-token blocks of this tiny latent, each built and prefaulted at start.
        llm = LLM(model=str(tmp_path), quantization=method, block_size=4, max_model_len=64,
                  num_kv_blocks=64)
        for layer in llm.engine.runner.model.model.layers:
            layer.self_attn.mode = mode
        outs[mode] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        llm.engine.close()
    assert len(outs["absorbed"].token_ids) == 6, outs["absorbed"]
    assert outs["absorbed"].token_ids == outs["expanded"].token_ids
