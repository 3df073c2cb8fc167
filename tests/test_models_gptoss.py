"""gpt-oss against transformers on tiny random checkpoints (tests/helpers/tiny_gptoss.py):
attention sinks, alternating windows of 8 and full layers, biased router and experts, the
clamped SwiGLU, YaRN; experts stored as float (transformers' layout) and as MXFP4.

The logits of a varlen prefill, a chunked prefill and decode steps must match transformers'
full-sequence forward (float32); the engine's greedy tokens must equal transformers'
`generate` through chunked prefill, preemption, prefix hits and n > 1.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kserve_paged_engine.model_executor.model_loader import load_model  # noqa: E402
from tests.helpers.tiny_gptoss import save_tiny_gptoss  # noqa: E402
from tests.helpers.tiny_models import VOCAB, PagedSim  # noqa: E402


def _logits_match(path: Path, ref: torch.nn.Module) -> None:
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    assert model.layer_windows == [8, None]
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n + 2,), generator=g).tolist() for n in (5, 21)]
    with torch.inference_mode():
        expected = [ref(torch.tensor([s])).logits[0].float() for s in seqs]
    sim = PagedSim(model, seed=7)
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def run(batch: list[tuple[int, list[int]]]) -> None:
        logits, offset = sim.step(batch), 0
        for sid, new in batch:
            got[sid].append(logits[offset: offset + len(new)])
            offset += len(new)

    run([(0, seqs[0][:5]), (1, seqs[1][:10])])  # a prompt and a chunk past the window
    run([(0, seqs[0][5:6]), (1, seqs[1][10:21])])  # a decode and the chunked rest
    run([(0, seqs[0][6:7]), (1, seqs[1][21:23])])
    for sid in range(2):
        ours = torch.cat(got[sid])
        assert ours.shape[0] == len(seqs[sid])
        torch.testing.assert_close(ours, expected[sid], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mxfp4", [False, True], ids=["float_experts", "mxfp4_experts"])
def test_logits_match_transformers(mxfp4: bool, tmp_path: Path) -> None:
    ref = save_tiny_gptoss(tmp_path, mxfp4=mxfp4, tokenizer=False)
    _logits_match(tmp_path, ref)


def test_mxfp4_experts_stay_four_bit_and_the_planner_counts_them(tmp_path: Path) -> None:
    """The MXFP4 checkpoint's experts are held as their uint8 blocks and scales (no float
    copy of any expert in the model), and the planner's weight bytes are what the engine
    holds, from the safetensors and from config.json alone."""
    import shutil

    from kserve_paged.plan_weights import packed_weight_bytes

    folder = tmp_path / "model"
    save_tiny_gptoss(folder, mxfp4=True, tokenizer=False)
    model, _ = load_model(folder, torch.float32, torch.device("cpu"))
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj_blocks.dtype == torch.uint8
    assert experts.down_proj_scales.dtype == torch.uint8
    assert not hasattr(experts, "gate_up_proj") and not hasattr(experts, "down_proj")
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert packed_weight_bytes(folder, 4) == held
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(folder / "config.json", config_only / "config.json")
    assert packed_weight_bytes(config_only, 4) == held


def test_sinks_change_the_output(tmp_path: Path) -> None:
    """The sinks are read and used: zeroing them in our model changes its logits (so the
    match above cannot come from attention without them)."""
    ref = save_tiny_gptoss(tmp_path, tokenizer=False)
    model, _ = load_model(tmp_path, torch.float32, torch.device("cpu"))
    prompt = list(range(3, 15))
    with torch.inference_mode():
        expected = ref(torch.tensor([prompt])).logits[0, -1]
        ours = PagedSim(model).step([(0, prompt)])[-1]
        for layer in model.model.layers:
            layer.self_attn.attn.sinks.zero_()
        without = PagedSim(model).step([(0, prompt)])[-1]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    assert (without - expected).abs().max() > 1e-2


@pytest.mark.slow
def test_greedy_equals_generate(tmp_path: Path) -> None:
    """4 layers (window, full, window, full), prompts 2-5x the window, 10 new tokens: the
    engine's greedy tokens equal transformers' generate with prefix caching (run twice, the
    second hitting the cache), with n = 2, and with chunked prefill and preemptions in a
    pool too small for all prompts at once; every block comes back."""
    from kserve_paged_engine import LLM, SamplingParams

    ref = save_tiny_gptoss(tmp_path, num_hidden_layers=4)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (17, 40, 29)]
    prompts.append(prompts[1][:36] + [5, 6])  # shares 9 full blocks with prompt 1
    new = 10
    ref.generation_config.eos_token_id = None
    with torch.inference_mode():
        expected = [ref.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                    for p in prompts]
    greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(tmp_path), block_size=4, num_kv_blocks=160, max_model_len=64)
    for _ in range(2):
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats()["prefix_cache_hits"] > 0 and outs[3].num_cached_tokens > 0
    assert llm.engine.kv.num_groups == 2  # the windowed layers' group and the full ones'
    assert llm.stats()["kv_blocks_freed_out_of_window"] > 0
    two = SamplingParams(n=2, max_tokens=new, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts[:2], two, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[e, e] for e in expected[:2]]
    assert llm.stats()["kv_blocks_free"] == 160

    small = LLM(model=str(tmp_path), block_size=4, num_kv_blocks=48, max_model_len=64,
                enable_prefix_caching=False, max_num_batched_tokens=16)
    outs = small.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert small.stats()["num_preemptions"] > 0 and small.stats()["kv_blocks_free"] == 48
