"""The offline LLM on the real default model, token for token against transformers (float32)."""

from __future__ import annotations

import pytest
import torch

from kserve_paged_engine import LLM, SamplingParams
from kserve_paged_engine.frontend.default_model import ensure_default_model

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "In a shocking finding, scientists discovered a herd of unicorns living in a remote, "
    "previously unexplored valley in the Andes Mountains. Even more surprising to the "
    "researchers was the fact that the unicorns spoke perfect English.",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog. " * 6 + "Summarize:",
]
NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(ensure_default_model(progress=lambda _: None))


@pytest.fixture(scope="module")
def reference(model_dir) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (batch of one: no padding effects)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                 dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # truly ignore EOS, as our ignore_eos does
    refs = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([tok.encode(p)])
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
            refs.append(out[0, ids.shape[1]:].tolist())
    return refs


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model=model_dir, num_kv_blocks=256, max_model_len=1024)


def assert_same(outs, reference) -> None:
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert out.outputs[0].token_ids == ref, f"prompt {i} differs from transformers"


@pytest.mark.slow
def test_greedy_equals_transformers_mixed_batch(llm, reference):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same(outs, reference)
    assert [len(o.prompt_token_ids) for o in outs] == [len(llm.get_tokenizer().encode(p))
                                                        for p in PROMPTS]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    text = outs[0].outputs[0].text
    assert text == llm.get_tokenizer().decode(reference[0], skip_special_tokens=True)
    stats = llm.stats()
    assert stats["num_running"] == 0 and stats["kv_blocks_in_use"] == 0


@pytest.mark.slow
def test_prefix_cache_hits_give_identical_outputs(llm, reference):
    # Run the prompts once (the cache may be cold when this test runs alone), then again:
    # every full block of each prompt now hits the cache.
    assert_same(llm.generate(PROMPTS, GREEDY, use_tqdm=False), reference)
    hits_before = llm.stats()["prefix_cache_hits"]
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same(outs, reference)
    assert llm.stats()["prefix_cache_hits"] > hits_before
    assert outs[7].num_cached_tokens > 0


@pytest.mark.slow
def test_prefix_caching_off_chunked_prefill_and_preemption(model_dir, reference):
    # Tiny token budget (chunked prefill), no prefix caching, and a pool too small for all
    # eight at once (preemption by recompute): still identical to transformers.
    llm = LLM(model=model_dir, num_kv_blocks=20, block_size=16, max_num_batched_tokens=24,
              enable_prefix_caching=False, max_model_len=320)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same(outs, reference)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] == 0
    assert stats["kv_blocks_free"] == 20


@pytest.mark.slow
def test_stop_strings_truncate_and_stop_tokens_finish(llm, reference):
    tok = llm.get_tokenizer()
    full = tok.decode(reference[0], skip_special_tokens=True)
    stop = full[5:9]
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                  stop=[stop]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full[:full.index(stop)]
    stop_id = reference[0][3]
    first = reference[0].index(stop_id)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                  stop_token_ids=[stop_id]),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference[0][:first + 1]
    assert out.outputs[0].stop_reason == stop_id
    assert out.outputs[0].finish_reason == "stop"


@pytest.mark.slow
def test_seed_reproduces_across_batch_compositions(llm):
    p = SamplingParams(max_tokens=16, temperature=1.5, top_p=0.95, seed=1234)
    alone = llm.generate(PROMPTS[6], p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=20, temperature=0.8) for _ in PROMPTS]
    mixed = llm.generate(PROMPTS[:6] + [PROMPTS[6]] + PROMPTS[7:],
                         others[:6] + [p] + others[7:], use_tqdm=False)
    assert mixed[6].outputs[0].token_ids == alone
    different = [llm.generate(PROMPTS[6], SamplingParams(max_tokens=16, temperature=1.5,
                                                         top_p=0.95, seed=s),
                              use_tqdm=False)[0].outputs[0].token_ids for s in (7, 99)]
    assert any(d != alone for d in different)


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids).startswith("<|im_start|>")


@pytest.mark.parametrize("prompt, params, match", [
    ("", SamplingParams(), "empty"),
    ([], SamplingParams(), "empty"),
    ("hello " * 1100, SamplingParams(), "maximum context length"),
    ([10**9], SamplingParams(), "out of range"),
])
def test_bad_input_raises_and_leaves_nothing_allocated(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine prompt", prompt], params, use_tqdm=False)
    s = llm.stats()
    assert s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_blocks_in_use"] == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -3}, "top_k"),
])
def test_bad_sampling_params_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_unknown_architecture_is_a_clear_error(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(model=str(tmp_path))


@pytest.mark.slow
def test_stop_string_on_the_last_allowed_token_and_min_tokens(llm, reference):
    tok = llm.get_tokenizer()
    full = tok.decode(reference[0], skip_special_tokens=True)
    stop = full[5:9]
    k = next(k for k in range(1, NEW_TOKENS + 1)
             if stop in tok.decode(reference[0][:k], skip_special_tokens=True))
    # The stop string completes exactly on the max_tokens-th token: it is a stop, not a length.
    c = llm.generate(PROMPTS[0], SamplingParams(max_tokens=k, temperature=0, stop=[stop]),
                     use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    # Under min_tokens the stop string is not checked, as in vLLM.
    c = llm.generate(PROMPTS[0], SamplingParams(max_tokens=NEW_TOKENS, min_tokens=k + 3,
                                                temperature=0, stop=[stop]),
                     use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) >= k + 3
    assert c.token_ids == reference[0][:len(c.token_ids)]


@pytest.mark.slow
def test_logprobs_equal_transformers_log_softmax(llm, model_dir):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                              dtype=torch.float32).eval()
    for out in outs:
        c = out.outputs[0]
        ids = out.prompt_token_ids + c.token_ids
        with torch.inference_mode():
            logits = hf(torch.tensor([ids])).logits[0]
        n = len(out.prompt_token_ids)
        ref = torch.log_softmax(logits[n - 1:n - 1 + len(c.token_ids)].float(), dim=-1)
        assert len(c.logprobs) == len(c.token_ids)
        total = 0.0
        for j, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            assert entry[token].rank == 1  # greedy picks the most likely token
            assert entry[token].logprob == pytest.approx(ref[j, token].item(), abs=1e-4)
            top = ref[j].topk(3)
            assert set(entry) == set(top.indices.tolist())
            for tid, value in zip(top.indices.tolist(), top.values.tolist()):
                assert entry[tid].logprob == pytest.approx(value, abs=1e-4)
            total += entry[token].logprob
        assert c.cumulative_logprob == pytest.approx(total)


@pytest.mark.slow
def test_penalties_steer_generation(llm, reference):
    base = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    assert llm.generate(PROMPTS[2], base, use_tqdm=False)[0].outputs[0].token_ids == reference[2]
    penalized = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                               frequency_penalty=2.0)
    out = llm.generate(PROMPTS[2], penalized, use_tqdm=False)[0].outputs[0].token_ids
    assert out != reference[2]
    counts = {t: out.count(t) for t in set(out)}
    ref_counts = {t: reference[2].count(t) for t in set(reference[2])}
    assert max(counts.values()) < max(ref_counts.values())
    banned = reference[2][0]
    biased = SamplingParams(max_tokens=4, temperature=0, logit_bias={banned: -100})
    assert banned not in llm.generate(PROMPTS[2], biased, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.slow
def test_n_samples_share_the_prompt_blocks(llm, reference):
    bs = 16
    prompt = PROMPTS[7]  # the longest: several full blocks
    n_prompt = len(llm.get_tokenizer().encode(prompt))
    full_blocks = n_prompt // bs
    assert full_blocks >= 3
    engine = llm.engine
    engine.add_request("n8", prompt, SamplingParams(n=8, max_tokens=4, temperature=0,
                                                    ignore_eos=True))
    engine.step()  # the first sample computes the prompt; the other seven fork from it
    prompt_blocks = -(-n_prompt // bs)
    assert n_prompt % bs, "the prompt should end in a partial block"
    # The prompt once, its partial last block included: every block held by all eight.
    assert engine.kv.pool.num_used_blocks == prompt_blocks
    assert [b.ref_cnt for b in engine.kv.req_blocks["n8\x1f0"]] == [8] * prompt_blocks
    assert engine.kv.stats()["kv_blocks_shared"] == 7 * prompt_blocks
    copies = engine.kv.num_cow_copies
    engine.step()  # each writes its second token into the shared partial block: 7 copies
    assert engine.kv.num_cow_copies - copies == 7
    assert engine.kv.pool.num_used_blocks == prompt_blocks + 7 < 8 * full_blocks
    while engine.has_unfinished_requests():
        finals = [o for o in engine.step() if o.finished]
    assert len(finals) == 1 and finals[0].request_id == "n8"
    assert [c.index for c in finals[0].outputs] == list(range(8))
    assert all(c.token_ids == reference[7][:4] for c in finals[0].outputs)
    assert engine.kv.pool.num_used_blocks == 0


@pytest.mark.slow
def test_n_greedy_gives_identical_samples_and_seeds_differ(llm, reference):
    out = llm.generate(PROMPTS[0], SamplingParams(n=4, max_tokens=NEW_TOKENS, temperature=0,
                                                  ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    assert all(c.token_ids == reference[0] for c in out.outputs)
    sampled = llm.generate(PROMPTS[6], SamplingParams(n=3, max_tokens=12, temperature=1.5,
                                                      seed=5), use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1
    again = llm.generate(PROMPTS[6], SamplingParams(n=3, max_tokens=12, temperature=1.5,
                                                    seed=5), use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in sampled.outputs]
    llm.engine.add_request("gone", PROMPTS[0], SamplingParams(n=3, max_tokens=50))
    llm.engine.step()
    llm.engine.abort_request("gone")
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.pool.num_used_blocks == 0


@pytest.mark.slow
def test_prompt_logprobs_equal_transformers_and_skip_the_prefix_cache(model_dir):
    from transformers import AutoModelForCausalLM

    # A small budget splits the prompt into chunks: positions must line up across them.
    llm = LLM(model=model_dir, num_kv_blocks=64, max_model_len=512, max_num_batched_tokens=16)
    prompt = PROMPTS[4]
    llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)  # now cached
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # no prefix-cache read: cached positions have no logits
    ids = out.prompt_token_ids
    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                              dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        assert entry[ids[p]].logprob == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
        assert entry[ids[p]].rank == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
        for tid in ref[p - 1].topk(2).indices.tolist():
            assert tid in entry
    # The request may still populate the cache for others.
    again = llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0


def test_dummy_load_format_serves_a_model_shape_without_its_weights(tmp_path):
    """vLLM's `--load-format dummy`: config.json + tokenizer, random weights (benchmarks)."""
    from tests.helpers.tiny_models import tiny_default_folder

    tiny_default_folder(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runs = [LLM(model=str(tmp_path), load_format="dummy", seed=seed, dtype="float32",
                max_model_len=256, kv_cache_memory=8 << 20).generate(["Hello there"], params)
            for seed in (1, 1, 2)]
    ids = [r[0].outputs[0].token_ids for r in runs]
    assert len(ids[0]) == 6 and ids[0] == ids[1]  # the same seed draws the same weights
    assert ids[2] != ids[0]
    with pytest.raises(ValueError, match="load_format"):
        LLM(model=str(tmp_path), load_format="random")
