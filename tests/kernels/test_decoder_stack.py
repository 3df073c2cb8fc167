"""The one-call native decoder stack (kernels/kserve_paged_kernels/csrc/decoder_stack.c) against the per-layer modules.

Both run the same kernels in the same order, so hidden states and the KV they write must be equal
bit for bit, on every tiny config of tests/test_models.py the stack takes (GQA and MHA, biases,
head_dim 24, 32 and 64, tied heads, sliding windows smaller than the prompts, Qwen3's per-head
q/k norm, an intermediate size that is not a multiple of the panel, Gemma 2 and 3's sandwich
norms, GeGLU, soft cap and local rotary base), over a prefill + chunked
prefill + decode sequence of steps (with head_dim 64 also prefill runs long enough for the
transposed-key path, one starting at an odd position). The transformers
comparison in test_models.py already runs through the stack; this shows the stack is what ran.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kserve_paged_engine.model_executor.attention import AttentionMetadata
from kserve_paged_engine.model_executor.model_loader import load_model
from kserve_paged_engine.model_executor.models.llama import LlamaForCausalLM
from kserve_paged_kernels import cpu_native
from tests.helpers.decoder_stack_runs import (
    Run,
    long_steps,
    mixed_steps,
    one_step_inputs,
    stack_and_modules,
)
from tests.helpers.tiny_models import CONFIGS, VOCAB, PagedSim, save_checkpoint, save_tokenizer


@pytest.fixture(autouse=True)
def _native_built() -> None:
    # The stack is in every level's build; gcc is part of the supported machine (README), so a
    # missing library must fail here, not skip.
    assert cpu_native.gemm_available(), "the native CPU kernels did not build"


# The families the stack declines, and the feature each answer must name: every other family
# of tests/test_models.py must get the stack, at every level.
DECLINED = {
    "mixtral_4x_top2": "mixture-of-experts",
    "qwen3_moe_4x_top2": "mixture-of-experts",
    "qwen3_moe_norm_topk": "mixture-of-experts",
}


def test_declined_families_are_served_families() -> None:
    assert set(DECLINED) <= set(CONFIGS)


@pytest.mark.parametrize("name", sorted(set(CONFIGS) - set(DECLINED)))
def test_stack_equals_per_layer_modules_bit_for_bit(name: str, tmp_path: Path) -> None:
    path, _ = save_checkpoint(CONFIGS[name], tmp_path)
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    assert model.native_stack is not None, model.native_stack_declined

    def run(m: LlamaForCausalLM) -> Run:
        sim = PagedSim(m, seed=3)
        logits = [sim.step(batch) for batch in mixed_steps(11)]
        if m.head_dim == 64:
            sim2 = PagedSim(m, seed=5)
            logits += [sim2.step(batch) for batch in long_steps(2)]
            sim.kv += sim2.kv
        return logits, sim.kv

    stacked, layered = stack_and_modules(model, run)
    for a, b in zip(stacked[0], layered[0], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(stacked[1], layered[1], strict=True):
        assert torch.equal(a, b)  # same K/V written, and the garbage slots left alone


@pytest.mark.parametrize("name", sorted(DECLINED))
def test_stack_declines_what_it_cannot_compute_and_says_why(name: str, tmp_path: Path,
                                                             caplog) -> None:
    path, _ = save_checkpoint(CONFIGS[name], tmp_path)
    with caplog.at_level("INFO", logger="kserve_paged_engine"):
        model, _ = load_model(path, torch.float32, torch.device("cpu"))
    assert model.native_stack is None
    assert DECLINED[name] in model.native_stack_declined
    assert DECLINED[name] in caplog.text  # logged at packing


@pytest.mark.parametrize(("name", "kv_cache_dtype"), [
    ("gemma2_window_softcap", "auto"), ("gemma3_window_local_rope", "auto"),
    ("gemma2_window_softcap", "int8")])
def test_stack_reads_each_layers_kv_group(name: str, kv_cache_dtype: str,
                                          tmp_path: Path) -> None:
    """In the engine, Gemma's sliding and global layers keep their K/V in separate KV groups,
    each with its own slots and block tables (engine/kserve_paged_engine/core/kv_groups.py); the stack gives each
    layer its group's. Prompts past the window, prefix-cache hits and out-of-window blocks
    freed, a float and an int8 cache (soft-capped scores over codes): the tokens and
    log-probabilities equal the per-layer modules' exactly."""
    from kserve_paged_engine import LLM, SamplingParams

    path, _ = save_checkpoint(CONFIGS[name], tmp_path)
    save_tokenizer(path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (25, 40, 31)]
    prompts.append(prompts[1][:36] + [5, 6])
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_kv_blocks=128,
              max_model_len=64, kv_cache_dtype=kv_cache_dtype)
    model = llm.engine.model
    assert model.native_stack is not None, model.native_stack_declined
    assert llm.engine.kv.num_groups > 1
    calls = []
    real_run = model.native_stack.run
    model.native_stack.run = lambda *a, **kw: calls.append(kw["groups"]) or real_run(*a, **kw)
    results = {}
    for use in (True, False):
        model.use_native_stack = use
        llm.reset_prefix_cache()
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        results[use] = [(o.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.logprobs])
                        for o in outs]
    assert calls and all(c is not None and len(set(c[0])) > 1 for c in calls)
    assert results[True] == results[False]


def _tiny_stack(tmp_path: Path):
    path, _ = save_checkpoint(CONFIGS["llama_gqa_llama3"], tmp_path)
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    return model


def test_position_past_the_rotary_table_raises(tmp_path: Path) -> None:
    model = _tiny_stack(tmp_path)
    ids, pos, kv, meta = one_step_inputs(model, [0, 1], [0, 1])
    pos = torch.tensor([0, model.max_position_embeddings])
    with torch.inference_mode(), pytest.raises(IndexError, match="rotary table"):
        model(ids, pos, kv, meta)


def test_slot_past_the_cache_raises_and_writes_nothing(tmp_path: Path) -> None:
    model = _tiny_stack(tmp_path)
    ids, pos, kv, meta = one_step_inputs(model, [0, 1], [0, 8 * 4])
    with torch.inference_mode(), pytest.raises(IndexError, match="KV slot"):
        model(ids, pos, kv, meta)
    assert all(not c.any() for c in kv)


def test_attention_rows_follow_seq_lens_and_reject_bad_lengths() -> None:
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(5, dtype=torch.int64),
        block_tables=torch.zeros(2, 4, dtype=torch.int32),
        seq_lens=torch.tensor([7, 3], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32),
        max_seq_len=7, max_query_len=3)
    assert meta.rows(6) is None  # a padding token: the stack does not apply
    row_lens, seq_idx = meta.rows(5)
    assert row_lens.tolist() == [6, 7, 1, 2, 3] and row_lens.dtype == torch.int32
    assert seq_idx.tolist() == [0, 0, 1, 1, 1]
    meta = AttentionMetadata(
        slot_mapping=meta.slot_mapping, block_tables=meta.block_tables,
        seq_lens=torch.tensor([1, 3], dtype=torch.int32),
        query_start_loc=meta.query_start_loc, max_seq_len=3, max_query_len=3)
    with pytest.raises(ValueError, match="q_len 2 > seq_len 1"):
        meta.rows(5)


def test_no_stack_without_native_projections(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KSERVE_PAGED_ONEDNN", "0")  # no packing at all
    model = _tiny_stack(tmp_path)
    assert model.native_stack is None
    assert model.native_stack_declined == "a projection is not on the native GEMM"


def test_stack_rejects_weights_it_cannot_run(tmp_path: Path) -> None:
    model = _tiny_stack(tmp_path)
    layer = model.model.layers[0]
    good = {"in_norm": layer.input_layernorm.weight.detach(),
            "post_norm": layer.post_attention_layernorm.weight.detach(),
            "qkv_w": layer.self_attn.qkv_proj._packed, "qkv_b": None,
            "o_w": layer.self_attn.o_proj._packed, "o_b": None,
            "gate_up_w": layer.mlp._fused, "gate_up_b": None,
            "down_w": layer.mlp.down_proj._packed, "down_b": None}
    kwargs = dict(hidden=model.hidden_size, heads=model.num_heads, kv_heads=model.num_kv_heads,
                  head_dim=model.head_dim, inter=layer.mlp.intermediate_size, eps=1e-5,
                  scale=0.25)
    args = (model.model.norm.weight.detach(), model.rotary_emb.cos, model.rotary_emb.sin)
    cpu_native.DecoderStack([good], *args, **kwargs)  # the valid layer is accepted
    with pytest.raises(ValueError, match="qkv_w is not a packed"):
        cpu_native.DecoderStack([{**good, "qkv_w": layer.self_attn.qkv_proj.weight}], *args,
                                **kwargs)
    with pytest.raises(ValueError, match="o_b is not a contiguous fp32"):
        cpu_native.DecoderStack([{**good, "o_b": torch.zeros(3)}], *args, **kwargs)
    qk = {"q_norm": torch.ones(model.head_dim), "k_norm": torch.ones(model.head_dim)}
    cpu_native.DecoderStack([{**good, **qk}] * 2, *args, **kwargs, windows=[None, 8])
    with pytest.raises(ValueError, match="q_norm must be given for every layer"):
        cpu_native.DecoderStack([{**good, **qk}, good], *args, **kwargs)
    with pytest.raises(ValueError, match="k_norm is not a contiguous fp32"):
        cpu_native.DecoderStack([{**good, **qk, "k_norm": torch.ones(3)}], *args, **kwargs)
    with pytest.raises(ValueError, match="one positive window"):
        cpu_native.DecoderStack([good], *args, **kwargs, windows=[0])


def test_stack_takes_what_the_per_layer_path_takes(tmp_path: Path) -> None:
    """int32 positions and slots, int64 and strided block tables: converted, not refused."""
    model = _tiny_stack(tmp_path)
    ids, pos, kv, meta = one_step_inputs(model, list(range(6)), list(range(6)))
    wide = torch.zeros(1, 16, dtype=torch.int64)
    wide[0, ::2] = meta.block_tables[0].long()
    variants = {"int32": (pos.int(), meta.slot_mapping.int(), meta.block_tables),
                "strided": (pos, meta.slot_mapping, wide[:, ::2])}
    with torch.inference_mode():
        expected = model(ids, pos, [c.clone() for c in kv], meta)
        for name, (p, slots, tables) in variants.items():
            m = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=meta.seq_lens,
                                  query_start_loc=meta.query_start_loc,
                                  max_seq_len=meta.max_seq_len, max_query_len=meta.max_query_len)
            assert torch.equal(model(ids, p, [c.clone() for c in kv], m), expected), name


def test_kv_binding_follows_a_new_shape_at_the_same_address(tmp_path: Path) -> None:
    """A cache viewed with another block size (same storage address) is bound again."""
    model = _tiny_stack(tmp_path)
    stack = model.native_stack
    kv = [torch.zeros(2, 8, 4, model.num_kv_heads, model.head_dim)
          for _ in range(model.num_layers)]
    stack._bind_kv(kv)
    assert (stack._struct.num_blocks, stack._struct.block_size) == (8, 4)
    views = [c.view(2, 2, 16, model.num_kv_heads, model.head_dim) for c in kv]
    assert views[0].data_ptr() == kv[0].data_ptr()
    stack._bind_kv(views)
    assert (stack._struct.num_blocks, stack._struct.block_size) == (2, 16)
