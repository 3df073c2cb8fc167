"""Beam search in the engine against transformers' generate(num_beams=k), float32, on a tiny
random Llama (the default model's tokenizer, an EOS id the beams actually reach)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kserve_paged_engine import LLM, SamplingParams
from kserve_paged_engine.frontend.default_model import ensure_default_model
from tests.helpers.tiny_models import copy_default_tokenizer, save_random

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_block_sharing import measure  # noqa: E402

PROMPTS = [list(range(100, 137)), [5, 17, 300, 41, 9000, 12, 77, 801, 3]]
NEW_TOKENS = 12
TOKENIZER_EOS = 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, torch.nn.Module, int]:
    """A saved random Llama with the default tokenizer; its second EOS id is a token the best
    beam of the first prompt takes at its fourth step, so hypotheses end by EOS too."""
    d = tmp_path_factory.mktemp("tiny_beam")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      eos_token_id=TOKENIZER_EOS, bos_token_id=1)
    save_random(cfg, d)
    copy_default_tokenizer(d)
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.inference_mode():
        free = ref.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=6, do_sample=False,
                            num_beams=2, pad_token_id=0, eos_token_id=None)
    eos = int(free[0, len(PROMPTS[0]) + 3])
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = [TOKENIZER_EOS, eos]
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d, ref, eos


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return LLM(model=str(tiny[0]), num_kv_blocks=128, max_model_len=256, dtype="float32")


def reference(ref, eos, prompt, k, max_new, length_penalty, early_stopping):
    with torch.inference_mode():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                           num_beams=k, num_return_sequences=k, pad_token_id=0,
                           eos_token_id=[TOKENIZER_EOS, eos], length_penalty=length_penalty,
                           early_stopping=early_stopping, output_scores=True,
                           return_dict_in_generate=True)
    return [(s[len(prompt):].tolist(), float(sc)) for s, sc in zip(out.sequences,
                                                                   out.sequences_scores)]


def assert_same(outs, refs, eos_ids):
    assert len(outs) == len(refs)
    for got, (tokens, score) in zip(outs, refs):
        n = len(got.token_ids)
        # transformers pads shorter hypotheses to the longest one's length, with the pad id or
        # (pad id 0 being falsy there) the first EOS id.
        assert tokens[:n] == got.token_ids and all(t == TOKENIZER_EOS for t in tokens[n:]), \
            (got, tokens)
        assert got.score == pytest.approx(score, abs=1e-4)
        assert got.finish_reason == ("stop" if got.token_ids[-1] in eos_ids else "length")


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("length_penalty,early_stopping",
                         [(1.0, False), (1.0, True), (2.0, "never"), (0.0, "never"),
                          (-0.5, False)])
def test_beam_search_equals_transformers(llm, tiny, k, length_penalty, early_stopping):
    _, ref, eos = tiny
    outs = llm.beam_search(PROMPTS, k, NEW_TOKENS, length_penalty=length_penalty,
                           early_stopping=early_stopping)
    for prompt, out in zip(PROMPTS, outs):
        want = reference(ref, eos, prompt, k, NEW_TOKENS, length_penalty, early_stopping)
        assert_same(out.outputs, want, {TOKENIZER_EOS, eos})
        assert [c.index for c in out.outputs] == list(range(k))
    stats = llm.stats()
    assert stats["kv_blocks_in_use"] == 0 and stats["kv_blocks_shared"] == 0


def test_some_hypotheses_end_by_eos_and_the_search_forks_and_copies(llm, tiny):
    copies = llm.engine.kv.num_cow_copies
    # No length reward: the short hypothesis that ends by EOS ranks first.
    out = llm.beam_search(PROMPTS[0], 2, NEW_TOKENS, length_penalty=0.0)[0]
    assert [c.finish_reason for c in out.outputs] == ["stop", "length"]
    assert llm.engine.kv.num_cow_copies > copies


def test_n_returns_the_best_of_the_beams(llm, tiny):
    four = llm.beam_search(PROMPTS[1], 4, NEW_TOKENS)[0].outputs
    two = llm.generate(PROMPTS[1], SamplingParams(n=2, best_of=4, use_beam_search=True,
                                                 max_tokens=NEW_TOKENS), use_tqdm=False)
    assert [c.token_ids for c in two[0].outputs] == [c.token_ids for c in four[:2]]
    assert two[0].outputs[0].text == llm.get_tokenizer().decode(four[0].token_ids,
                                                                skip_special_tokens=True)


def test_aborting_a_beam_search_midway_frees_every_block(llm):
    engine = llm.engine
    engine.add_request("beam", PROMPTS[0], SamplingParams(
        n=4, use_beam_search=True, max_tokens=40, ignore_eos=True))
    for _ in range(6):
        assert engine.step() == []  # results are final only
    assert len(engine.scheduler.requests) == 4 and engine.kv.stats()["kv_blocks_shared"] > 0
    engine.abort_request("beam")
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)
    assert engine.kv.stats()["kv_blocks_shared"] == 0


def test_a_failing_step_fails_the_whole_search_and_frees_its_blocks(llm):
    engine = llm.engine
    engine.add_request("doomed", PROMPTS[0], SamplingParams(
        n=3, use_beam_search=True, max_tokens=30, ignore_eos=True))
    engine.add_request("fine", PROMPTS[1], SamplingParams(max_tokens=30, temperature=0))
    for _ in range(4):
        engine.step()
    assert len([r for r in engine.scheduler.requests if r != "fine"]) == 3

    def fail(ids):
        if any(i != "fine" for i in ids):
            raise RuntimeError("injected")

    engine.fault_hook = fail
    try:
        outs = engine.step()
    finally:
        engine.fault_hook = None
    errors = [o for o in outs if o.error]
    # One error output under the user's id; the other request fails with it (same step).
    assert [o.request_id for o in errors if o.request_id == "doomed"] == ["doomed"]
    assert "injected" in errors[0].error
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_n_samples_fail_together_when_the_prompt_step_fails(llm):
    engine = llm.engine

    def fail(ids):
        raise RuntimeError("injected")

    engine.fault_hook = fail
    engine.add_request("n4", PROMPTS[0], SamplingParams(n=4, max_tokens=5))
    try:
        outs = engine.step()  # the first sample's prompt step: the other three never forked
    finally:
        engine.fault_hook = None
    assert [o.request_id for o in outs] == ["n4"]
    assert outs[0].finished and "injected" in outs[0].error
    assert [c.finish_reason for c in outs[0].outputs] == ["error"] * 4
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("prompt_len", [400, 390])
@pytest.mark.slow
def test_peak_blocks_shared_and_unshared_on_a_400_token_prompt(tiny, prompt_len):
    """Beam width 4 and n = 8 samples, 128 new tokens, block size 16, prefix caching off (all
    sharing is forking): the prompt is held once, each sequence adds only its own blocks."""
    llm = LLM(model=str(tiny[0]), num_kv_blocks=300, max_model_len=600, dtype="float32",
              enable_prefix_caching=False)
    prompt = [100 + (i * 37) % 40000 for i in range(prompt_len)]
    prompt_blocks = -(-prompt_len // 16)
    own = -(-(prompt_len + 127) // 16) - prompt_len // 16  # a sequence's blocks past the shared
    samples = measure(llm.engine, prompt, SamplingParams(n=8, max_tokens=128, seed=0,
                                                         ignore_eos=True), "n8")
    assert samples["peak_blocks_unshared"] == 8 * -(-(prompt_len + 127) // 16)
    # The full prompt blocks once, and each sample's own: a partial last prompt block is held
    # once until the samples write into it, then copied by seven of them.
    assert samples["peak_blocks_shared"] == prompt_len // 16 + 8 * own
    assert samples["cow_copies"] == (7 if prompt_len % 16 else 0)
    beams = measure(llm.engine, prompt, SamplingParams(n=4, use_beam_search=True,
                                                       max_tokens=128, ignore_eos=True), "b4")
    assert beams["peak_blocks_unshared"] == 4 * -(-(prompt_len + 127) // 16)
    # At most: the prompt once plus each beam's own history and one block copied this step.
    assert prompt_blocks < beams["peak_blocks_shared"] <= prompt_blocks + 4 * (own + 1)
    assert beams["cow_copies"] > 0 and beams["max_sequences"] == 4


def _beams_beside_a_long_request(tiny, **options) -> tuple[dict, int, object]:
    """A long request that arrived first grows until the beam search, arrived later, is
    preempted (on a small pool); the search then recomputes and must find the same beams."""
    llm = LLM(model=str(tiny[0]), max_model_len=160, dtype="float32", block_size=8, **options)
    engine = llm.engine
    engine.add_request("first", list(range(5, 65)), SamplingParams(max_tokens=60,
                                                                   ignore_eos=True))
    engine.add_request("beam", list(range(300, 340)), SamplingParams(
        n=4, use_beam_search=True, max_tokens=30, ignore_eos=True))
    results = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                results[out.request_id] = (out.error, [(c.token_ids, c.cumulative_logprob)
                                                       for c in out.outputs])
    assert not engine.has_unfinished_requests(), "the search stalled"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return results, engine.scheduler.num_preemptions, engine


@pytest.fixture(scope="module")
def unpressed(tiny) -> dict:
    results, preemptions, _ = _beams_beside_a_long_request(tiny, num_kv_blocks=100,
                                                           enable_prefix_caching=False)
    assert preemptions == 0
    return results


@pytest.mark.parametrize("options", [
    dict(num_kv_blocks=16, enable_prefix_caching=False),
    dict(num_kv_blocks=16, enable_prefix_caching=True),
    dict(num_kv_blocks=18, enable_prefix_caching=False, max_num_batched_tokens=16),
    dict(num_kv_blocks=100, enable_prefix_caching=False, max_num_seqs=2),
], ids=["no-prefix-cache", "prefix-cache", "chunked", "width-above-max-num-seqs"])
@pytest.mark.slow
def test_a_preempted_or_squeezed_beam_search_finds_the_same_beams(tiny, unpressed, options):
    """Preempted whole, the group is re-admitted whole, its beams sharing their common
    history again (with prefix caching off too, where a recompute used to need the beams'
    blocks unshared and never fit); with fewer sequence slots than beams it takes turns.
    Tokens must be equal; scores within float noise, since a chunked or recomputed prompt's
    attention runs over other chunk shapes (SDPA's sums in another order)."""
    results, preemptions, _ = _beams_beside_a_long_request(tiny, **options)
    assert results.keys() == unpressed.keys()
    for rid, (error, beams) in results.items():
        want_error, want_beams = unpressed[rid]
        assert error == want_error
        assert [tokens for tokens, _ in beams] == [tokens for tokens, _ in want_beams], rid
        for (_, score), (_, want) in zip(beams, want_beams):
            assert score == (want if want is None else pytest.approx(want, rel=1e-5)), rid
    assert (preemptions > 0) == (options["num_kv_blocks"] < 100)


def test_a_search_the_cache_can_never_hold_fails_with_a_reason_and_frees_its_blocks(tiny):
    llm = LLM(model=str(tiny[0]), max_model_len=160, dtype="float32", num_kv_blocks=16,
              block_size=8, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request("wide", list(range(300, 340)), SamplingParams(
        n=8, use_beam_search=True, max_tokens=100, ignore_eos=True))
    engine.add_request("other", list(range(5, 40)), SamplingParams(max_tokens=20,
                                                                   ignore_eos=True))
    finished = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert "cannot hold the 8 beams" in finished["wide"].error
    assert finished["other"].error is None and len(finished["other"].outputs[0].token_ids) == 20
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


DEFAULT_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def default_model():
    path = ensure_default_model(progress=lambda _: None)
    llm = LLM(model=str(path), num_kv_blocks=256, max_model_len=512, dtype="float32")
    return llm, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.slow  # about a minute per case on two CPU cores
@pytest.mark.parametrize("k,length_penalty,early_stopping",
                         [(2, 1.0, False), (4, 0.5, True), (8, 1.0, "never")])
@pytest.mark.slow
def test_default_model_beam_search_equals_transformers(default_model, k, length_penalty,
                                                       early_stopping):
    """The slower check, on SmolLM2 (float32): same hypotheses, order and scores."""
    llm, ref = default_model
    tok = llm.get_tokenizer()
    outs = llm.beam_search(DEFAULT_PROMPTS, k, 10, length_penalty=length_penalty,
                           early_stopping=early_stopping)
    for prompt, out in zip(DEFAULT_PROMPTS, outs):
        ids = tok.encode(prompt)
        with torch.inference_mode():
            hf = ref.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                              num_beams=k, num_return_sequences=k, eos_token_id=2,
                              pad_token_id=2, length_penalty=length_penalty,
                              early_stopping=early_stopping, output_scores=True,
                              return_dict_in_generate=True)
        want = [(s[len(ids):].tolist(), float(sc)) for s, sc in zip(hf.sequences,
                                                                    hf.sequences_scores)]
        assert_same(out.outputs, want, {2})
