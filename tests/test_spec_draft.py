"""Speculative decoding with a draft model: its config checks, greedy outputs equal to plain
decoding (prefix cache, chunked prefill, preemption, n > 1, stops), the draft's distributions
driving rejection sampling, and no KV block left behind in either cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kserve_paged_engine.spec_decode import SpeculativeConfig
from tests.helpers.spec import (
    repetitive_prompts,
    run_recording_steps,
    sample_tokens,
)

OPTS = {"block_size": 4, "num_kv_blocks": 128, "max_model_len": 96}


def _truncate(src: str | Path, dst: Path, num_layers: int) -> str:
    """A layer-skip draft: the checkpoint's first layers, its embeddings, norm and head."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(src, local_files_only=True, dtype=torch.float32)
    hf.model.layers = hf.model.layers[:num_layers]
    hf.config.num_hidden_layers = num_layers
    hf.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src, local_files_only=True).save_pretrained(dst)
    return str(dst)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    """(target, draft): the tiny random Llama of test_spec_decode and its first layer."""
    from tests.helpers.tiny_models import CONFIGS, save_checkpoint, save_tokenizer

    target = tmp_path_factory.mktemp("draft-target")
    save_checkpoint(CONFIGS["llama_gqa_llama3"], target)
    save_tokenizer(target)
    return str(target), _truncate(target, tmp_path_factory.mktemp("draft-1layer"), 1)


def _spec(model: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


def _assert_no_leak(llm) -> None:
    engine = llm.engine
    draft = engine.spec.proposer
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert draft.kv.num_free_blocks == draft.kv.num_blocks and not draft._shadows
    assert engine.spec.num_draft_failures == 0


# ------------------------------------------------------------------ config


def test_config_takes_vllms_draft_model_spellings_and_refuses_bad_ones(models, tmp_path):
    target, draft = models
    cfg = SpeculativeConfig.from_json(json.dumps(_spec(draft, 4)))
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", draft, 4)
    short = SpeculativeConfig.from_json({"model": draft, "num_speculative_tokens": 2})
    assert short.method == "draft_model"  # vLLM's shorthand: a model and no method
    assert SpeculativeConfig.from_json({"model": "[ngram]", "num_speculative_tokens": 2,
                                        "prompt_lookup_max": 3}).method == "ngram"
    for bad, words in [({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
                       (_spec(str(tmp_path / "nowhere")), "does not exist"),
                       (_spec(draft, 17), "<= 16"),
                       ({**_spec(draft), "prompt_lookup_max": 3}, "for method ngram"),
                       ({"method": "ngram", "model": draft, "num_speculative_tokens": 2},
                        "for method draft_model")]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.from_json(bad)
    from kserve_paged_engine.config.engine import EngineConfig

    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        EngineConfig(tensor_parallel_size=2, speculative_config=_spec(draft))


def test_a_draft_of_another_vocabulary_or_tokenizer_is_refused_at_start_up(models, tmp_path):
    """Before the draft's weights are read (its folder holds none here)."""
    import tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    from kserve_paged_engine import LLM
    from tests.helpers.tiny_models import VOCAB, common_config

    target, _ = models
    other = tmp_path / "other-vocab"
    LlamaConfig(**common_config(vocab_size=VOCAB + 3, num_hidden_layers=1)).save_pretrained(other)
    with pytest.raises(ValueError, match=r"vocab_size \(100\) differs"):
        LLM(model=target, **OPTS, speculative_config=_spec(str(other)))
    renamed = tmp_path / "other-tokens"
    LlamaConfig(**common_config(num_hidden_layers=1)).save_pretrained(renamed)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"u{i}": i for i in range(VOCAB)},
                                                           unk_token="u0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="u0").save_pretrained(renamed)
    with pytest.raises(ValueError, match="tokenizer differs"):
        LLM(model=target, **OPTS, speculative_config=_spec(str(renamed)))


# ------------------------------------------------------------------ greedy: identical outputs


def test_the_target_drafting_for_itself_keeps_every_draft(models):
    """A deterministic check of the catch-up and rollback bookkeeping: the draft is the target,
    so every greedy draft is the target's own token and is kept, whatever the output length."""
    from kserve_paged_engine import LLM, SamplingParams

    target, _ = models
    prompts = repetitive_prompts()
    params = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
    want = LLM(model=target, **OPTS).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=target, **OPTS, speculative_config=_spec(target, 4))
    assert sample_tokens(llm.generate(prompts, params, use_tqdm=False)) == sample_tokens(want)
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    _assert_no_leak(llm)


def test_greedy_with_a_draft_model_equals_plain_decoding(models):
    """Token for token, logprobs included, over the repetitive workload: with the prefix cache
    (run twice), and with a 24-block pool (draft pool the same), a 16-token budget (chunked
    prefill of both models) and preemptions; a request under min_tokens decodes plainly in
    the same steps. Drafts were kept and rejected; no block leaks in either cache."""
    from kserve_paged_engine import LLM, SamplingParams

    target, draft = models
    prompts = repetitive_prompts()
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)
              for _ in prompts]
    params[2] = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2,
                               min_tokens=12)
    ref = LLM(model=target, **OPTS).generate(prompts, params, use_tqdm=False)
    cached = LLM(model=target, **OPTS, speculative_config=_spec(draft))
    for _ in range(2):
        outs, steps = run_recording_steps(cached, prompts, params)
        assert sample_tokens(outs) == sample_tokens(ref)
        for o, r in zip(outs, ref):
            assert [e[t].logprob for e, t in zip(o.outputs[0].logprobs,
                                                 o.outputs[0].token_ids)] == pytest.approx(
                [e[t].logprob for e, t in zip(r.outputs[0].logprobs, r.outputs[0].token_ids)],
                abs=1e-4)
    stats = cached.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert stats["prefix_cache_hits"] > 0
    assert any(s.spec_tokens and len(s.spec_tokens) < len(s.scheduled) for s in steps)
    _assert_no_leak(cached)

    small = LLM(model=target, block_size=4, num_kv_blocks=24, max_model_len=96,
                max_num_batched_tokens=16, speculative_config=_spec(draft))
    outs, steps = run_recording_steps(small, prompts, params)
    assert sample_tokens(outs) == sample_tokens(ref)
    stats = small.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert max(s.total_num_scheduled_tokens for s in steps) <= 16
    _assert_no_leak(small)


def test_draft_model_speculation_keeps_stops_max_tokens_n_and_aborts(models):
    """Stop strings, stop tokens after min_tokens, max_tokens and n = 2 end where plain
    decoding ends them; an abort mid-decode frees the request's draft KV at once."""
    from kserve_paged_engine import LLM, SamplingParams

    target, _ = models
    prompts = repetitive_prompts(3)
    plain = LLM(model=target, **OPTS)
    spec = LLM(model=target, **OPTS, speculative_config=_spec(target, 3))  # drafts are kept
    free = plain.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0,
                                                  ignore_eos=True), use_tqdm=False)
    words = free[0].outputs[0].text.split()
    stop_token = free[1].outputs[0].token_ids[4]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                             stop=[" ".join(words[6:8])]),
              SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_token],
                             min_tokens=2),
              SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True, n=2)]
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in g.outputs] == [
            (c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in w.outputs]
    assert want[0].outputs[0].finish_reason == "stop" and len(want[0].outputs[0].token_ids) < 24
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0
    _assert_no_leak(spec)

    engine = spec.engine
    engine.add_request("long", prompts[0], SamplingParams(max_tokens=40, temperature=0.0,
                                                          ignore_eos=True))
    while engine.spec.proposer.kv.num_free_blocks == engine.spec.proposer.kv.num_blocks:
        engine.step()  # until the draft holds blocks for it
    engine.abort_request("long")
    _assert_no_leak(spec)


def test_a_failing_draft_forward_costs_only_its_drafts(models):
    from kserve_paged_engine import LLM, SamplingParams

    target, draft = models
    prompts = repetitive_prompts(2)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = sample_tokens(LLM(model=target, **OPTS).generate(prompts, params, use_tqdm=False))
    llm = LLM(model=target, **OPTS, speculative_config=_spec(draft))
    runner = llm.engine.spec.proposer.runner
    calls = []

    def broken(out):
        calls.append(out)
        raise RuntimeError("draft boom")

    runner.execute = broken
    assert sample_tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert calls and llm.stats()["spec_decode_num_draft_tokens"] == 0
    assert llm.engine.spec.num_draft_failures == len(calls)
    llm.engine.spec.num_draft_failures = 0
    _assert_no_leak(llm)


# ------------------------------------------------------------------ sampling


def test_sampled_speculation_with_a_draft_model_is_seeded_and_keeps_drafts(models):
    """temperature > 0: the target drafting for itself has q = p, so rejection sampling keeps
    nearly every draft; a seeded request gives the same output twice."""
    from kserve_paged_engine import LLM, SamplingParams

    target, _ = models
    prompts = repetitive_prompts(3)
    llm = LLM(model=target, **OPTS, enable_prefix_caching=False,
              speculative_config=_spec(target, 3))
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, ignore_eos=True, seed=5)
    first = sample_tokens(llm.generate(prompts, params, use_tqdm=False))
    assert sample_tokens(llm.generate(prompts, params, use_tqdm=False)) == first
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] >= 0.9 * stats["spec_decode_num_draft_tokens"]
    _assert_no_leak(llm)


def test_drafts_after_rollbacks_equal_those_of_a_fresh_draft_cache(models):
    """The draft's KV after catch-up and rollback is what computing the context afresh gives:
    at every step each request's drafts, and for sampled requests the distributions q they
    were drawn from, equal those of a second proposer that holds nothing for it (its cache is
    emptied before each proposal; its draws use copies of the requests' generators)."""
    from kserve_paged_engine import LLM, SamplingParams

    target, draft = models
    llm = LLM(model=target, **OPTS, speculative_config=_spec(draft))
    proposer = llm.engine.spec.proposer
    fresh = LLM(model=target, **OPTS, speculative_config=_spec(draft)).engine.spec.proposer
    inner = proposer.propose
    checked = []

    def compare(batch, generator_of):
        states = {r.request_id: generator_of(r).get_state() for r, _ in batch}
        drafts, q = inner(batch, generator_of)
        copies = {rid: torch.Generator().set_state(s) for rid, s in states.items()}
        fresh.release_all()
        again, q_again = fresh.propose(batch, lambda r: copies[r.request_id])
        assert again == drafts and q.keys() == q_again.keys()
        for rid in q:
            torch.testing.assert_close(q[rid], q_again[rid], atol=1e-5, rtol=1e-4)
        checked.append((sum(map(len, drafts.values())), len(q)))
        return drafts, q

    proposer.propose = compare
    prompts = repetitive_prompts()
    params = [SamplingParams(max_tokens=20, temperature=0.0 if i % 2 else 0.9, seed=i,
                             ignore_eos=True) for i in range(len(prompts))]
    llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    assert len(checked) > 5 and sum(c for c, _ in checked) == stats[
        "spec_decode_num_draft_tokens"]
    assert any(n for _, n in checked)  # sampled requests' q were compared
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    _assert_no_leak(llm)


def test_the_server_flag_takes_a_draft_model_and_serves_unchanged_outputs(models):
    """--speculative_config with a draft model through the server's parser into the engine;
    a served completion equals the offline one without speculation. A missing draft folder
    is a usage error."""
    import asyncio

    from kserve_paged import args as server_args
    from kserve_paged_engine import LLM, SamplingParams
    from kserve_paged_engine.config.engine import EngineConfig
    from kserve_paged_engine.frontend.llm_engine import LLMEngine
    from kserve_paged_engine.spec_decode.draft_model import DraftModelProposer
    from tests.helpers.server import build, client

    target, draft = models
    with pytest.raises(SystemExit):
        server_args.parse_args(["--speculative_config", json.dumps(_spec("/nowhere/at/all"))])
    args = server_args.parse_args(["--speculative_config", json.dumps(_spec(draft))])
    engine = LLMEngine(EngineConfig(**{**server_args.engine_kwargs(args), **OPTS,
                                       "model": target}))
    assert isinstance(engine.spec.proposer, DraftModelProposer)
    prompt = " ".join(f"t{t}" for t in repetitive_prompts(2)[1])
    want = LLM(model=target, **OPTS).generate(
        [prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    app, model = build(engine=engine)
    asyncio.run(model.start_engine())
    try:
        async def main():
            async with client(app) as c:
                r = await c.post("/openai/v1/completions", json={
                    "model": "m", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True})
                return r.status_code, r.json()
        status, body = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        model.stop_engine()
    assert status == 200, body
    assert body["choices"][0]["text"] == want
    assert engine.spec.stats()["spec_decode_num_draft_tokens"] > 0


@pytest.mark.slow
def test_a_draft_that_never_pays_stops_drafting_for_the_whole_batch(models, tmp_path):
    """A draft as large as the target with other random weights: its k passes cost about k
    target steps and it is almost never right, so the gate pauses drafting for the batch;
    greedy outputs stay those of plain decoding and no block is left behind."""
    from kserve_paged_engine import LLM, SamplingParams
    from tests.helpers.tiny_models import CONFIGS, save_checkpoint, save_tokenizer

    target, _ = models
    other = tmp_path / "other-draft"
    save_checkpoint(CONFIGS["llama_gqa_llama3"], other, seed=7)
    save_tokenizer(other)
    prompts = repetitive_prompts()
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    want = LLM(model=target, **{**OPTS, "max_model_len": 128}).generate(prompts, params,
                                                                         use_tqdm=False)
    llm = LLM(model=target, **{**OPTS, "max_model_len": 128},
              speculative_config=_spec(str(other), 3))
    assert sample_tokens(llm.generate(prompts, params, use_tqdm=False)) == sample_tokens(want)
    stats = llm.stats()
    assert stats["spec_decode_draft_paused_steps"] > 0
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"] / 2
    _assert_no_leak(llm)
