"""Speculative decoding: the n-gram proposer, the verification rules, lookahead slots in the
scheduler and KV manager, and the engine's outputs with speculation equal to those without."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kserve_paged_engine.spec_decode import SpeculativeConfig
from kserve_paged_engine.spec_decode.ngram import NgramProposer
from kserve_paged_engine.spec_decode.rejection import accept_greedy, rejection_sample
from tests.helpers.core import apply_step, make_request, make_scheduler
from tests.helpers.spec import (
    repetitive_prompts,
    run_recording_steps,
    sample_tokens,
    total_variation,
)

# ------------------------------------------------------------------ config and proposer


def test_config_parses_vllm_json_and_fills_the_lookup_window():
    cfg = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4, '
                                      '"prompt_lookup_max": 3}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 3, 3)
    both = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 2})
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)  # vLLM's default
    for bad, words in [('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
                       ('{"method": "ngram"}', "num_speculative_tokens"),
                       ('{"num_speculative_tokens": 2, "prompt_lookup_min": 4, '
                        '"prompt_lookup_max": 2}', "prompt_lookup_min"),
                       ('{"num_speculative_tokens": 2, "colour": 1}', "unknown keys"),
                       ("[1]", "JSON object"), ("{", "not valid JSON")]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.from_json(bad)


def test_ngram_proposes_what_followed_the_longest_latest_match():
    p = NgramProposer(num_speculative_tokens=3, min_n=1, max_n=3)
    # "7 8 9" recurs: what followed it is the draft.
    assert p.propose([1, 7, 8, 9, 4, 5, 6, 2, 7, 8, 9]) == [4, 5, 6]
    # The 2-gram "8 9" at the end matches twice; the 3-gram "3 8 9" once (earlier): longest.
    assert p.propose([3, 8, 9, 1, 2, 8, 9, 5, 3, 8, 9]) == [1, 2, 8]
    # Same n: the latest occurrence wins; the draft may be shorter than k at the end.
    assert p.propose([5, 1, 2, 5, 3, 5]) == [3, 5]
    assert p.propose([1, 2, 3, 4]) == []  # nothing recurs
    assert p.propose([1, 2, 3, 1], max_draft=1) == [2]
    assert NgramProposer(3, min_n=2, max_n=3).propose([4, 1, 2, 4]) == []  # only a 1-gram


def test_greedy_acceptance_keeps_the_matching_prefix_and_the_target_token():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all kept + bonus
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # second rejected: target's 9
    assert accept_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]


@pytest.mark.parametrize("draft_model", [False, True])
def test_rejection_sampling_outputs_follow_the_target_distribution(draft_model):
    """Vocabulary of 6, two positions. Whatever the draft (a fixed point mass, or drafts drawn
    from a different distribution q), the first appended token is distributed as p_0 and the
    second, given the first draft was kept, as p_1: total variation under 0.025 (0.04 for
    the second, about a third of the draws) over 12k draws with a fixed seed; the noise is
    about 0.01, a sampler that redraws from p instead of the residual is off by 0.2."""
    g = torch.Generator().manual_seed(1234)
    target = torch.tensor([[0.30, 0.05, 0.25, 0.10, 0.20, 0.10],
                           [0.05, 0.40, 0.05, 0.30, 0.10, 0.10],
                           [0.10, 0.10, 0.10, 0.10, 0.10, 0.50]])
    q = torch.tensor([[0.05, 0.50, 0.05, 0.20, 0.10, 0.10],
                      [0.30, 0.10, 0.30, 0.10, 0.10, 0.10]])
    n = 12_000
    first, second = Counter(), Counter()
    for _ in range(n):
        if draft_model:
            drafts = torch.multinomial(q, 1, generator=g).squeeze(1).tolist()
            out = rejection_sample(target, drafts, q, g)
        else:
            drafts = [0, 3]  # a point mass, as an n-gram draft
            out = rejection_sample(target, drafts, None, g)
        assert 1 <= len(out) <= 3
        assert out[:-1] == drafts[:len(out) - 1]  # only a prefix of drafts is ever kept
        first[out[0]] += 1
        if len(out) >= 2 and out[0] == drafts[0]:
            second[out[1]] += 1
    assert total_variation(first, target[0], n) < 0.025
    # Given token 0 was the kept draft, token 1 follows p_1.
    assert sum(second.values()) > 3000
    assert total_variation(second, target[1], sum(second.values())) < 0.04


def test_a_request_whose_drafts_miss_pauses_proposing_and_tries_again_later():
    """Two verified steps keeping nothing pause the request's proposals for PAUSE_MIN steps,
    then for twice as long after the next miss run; a kept draft resets the pause."""
    from kserve_paged_engine.spec_decode import decoder as d

    spec = d.SpecDecoder(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1))
    req = make_request("a", [5, 6, 5, 6], max_tokens=50)
    req.num_computed_tokens = 3
    spec.propose([req], lambda _: False)
    assert req.spec_token_ids == []  # a prompt's last chunk never carries drafts
    req.num_computed_tokens = 4
    req.output_token_ids.append(5)  # decoding: one output, not yet computed

    def proposals(steps: int) -> list[bool]:
        seen = []
        for _ in range(steps):
            spec.propose([req], lambda _: False)
            seen.append(bool(req.spec_token_ids))
        return seen

    assert proposals(1) == [True] and req.spec_token_ids == [6, 5]
    spec._record("a", 2, 0)
    spec._record("a", 2, 0)
    assert proposals(d.PAUSE_MIN + 1) == [False] * d.PAUSE_MIN + [True]
    spec._record("a", 2, 0)
    spec._record("a", 2, 0)
    assert proposals(2 * d.PAUSE_MIN + 1) == [False] * (2 * d.PAUSE_MIN) + [True]
    spec._record("a", 2, 1)  # a kept draft: the next miss run pauses for PAUSE_MIN again
    spec._record("a", 2, 0)
    spec._record("a", 2, 0)
    assert proposals(d.PAUSE_MIN + 1) == [False] * d.PAUSE_MIN + [True]
    assert spec.stats()["spec_decode_num_draft_tokens"] == 14
    assert spec.stats()["spec_decode_num_accepted_tokens_per_pos"] == [1, 0]
    # No proposals for a request that cannot speculate or is not decoding.
    req.sampling_params.min_tokens = 10
    assert proposals(1) == [False]


# ------------------------------------------------------------------ scheduler and KV slots


def test_drafts_take_lookahead_slots_in_the_budget_and_rejected_ones_roll_back():
    sched = make_scheduler(num_blocks=16, block_size=4, budget=64)
    req = make_request("a", list(range(10, 17)), max_tokens=20)  # 7 prompt tokens
    sched.add_request(req)
    out = sched.schedule()
    apply_step(sched, out, {"a": 50})  # prompt done, 8 tokens, 7 computed
    assert sched.kv.num_blocks_of("a") == 2
    req.spec_token_ids = [51, 52, 53, 54, 55]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 6} and out.spec_tokens == {"a": [51, 52, 53, 54, 55]}
    assert sched.kv.num_blocks_of("a") == 4  # positions 7..12: lookahead slots allocated
    free_before = sched.kv.num_free_blocks
    # Two drafts kept: 51, 52 (then the target's own 60). 3 drafts' slots roll back.
    apply_step(sched, out, {"a": 51}, verified={"a": [52, 60]})
    assert req.output_token_ids == [50, 51, 52, 60]
    assert req.num_computed_tokens == 10 and req.num_tokens == 11
    assert sched.kv.num_blocks_of("a") == 3 and sched.kv.num_free_blocks == free_before + 1
    # The block holding tokens 8..11 is cached only once those tokens are known: drafts
    # never. Block 1 (tokens 4..7) was cached at allocation, block 2 is not cached.
    blocks = sched.kv.req_blocks["a"]
    assert blocks[1].block_hash is not None and blocks[2].block_hash is None
    # Budget, max_tokens and max_model_len cut the drafts.
    req.spec_token_ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    req.sampling_params.max_tokens = 8  # 4 outputs: at most 4 more, so 3 drafts
    out = sched.schedule()
    assert out.spec_tokens == {"a": [1, 2, 3]} and out.num_scheduled_tokens == {"a": 4}
    apply_step(sched, out, {"a": 9}, verified={"a": []})  # first draft rejected
    assert req.num_computed_tokens == 11 and sched.kv.num_blocks_of("a") == 3


def test_a_preempted_speculating_request_drops_its_drafts():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    a = make_request("a", list(range(10, 16)), max_tokens=20)
    b = make_request("b", list(range(30, 36)), max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    apply_step(sched, out, {"a": 1, "b": 2})  # 2 blocks each, the pool full
    a.spec_token_ids = [3, 4, 5]
    b.spec_token_ids = [6, 7, 8]
    out = sched.schedule()  # a's lookahead needs a block: b (the later) is preempted
    assert out.preempted == ["b"] and "b" not in out.spec_tokens
    assert b.spec_token_ids == [] and b.num_computed_tokens == 0
    assert out.spec_tokens == {"a": [3, 4, 5]}


# ------------------------------------------------------------------ the engine, end to end

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from tests.helpers.tiny_models import CONFIGS, save_checkpoint, save_tokenizer

    path = tmp_path_factory.mktemp("tiny-spec")
    save_checkpoint(CONFIGS["llama_gqa_llama3"], path)
    save_tokenizer(path)
    return str(path)


class _Oracle:
    """A proposer that knows the plain greedy continuations and drafts them, every third
    position wrong: drafts are kept, partly kept and rejected in every pattern, whatever the
    tiny random model does (the real proposer is tested above and in the test before)."""

    def __init__(self, prompts, outputs) -> None:
        self.known = [(list(p), list(o)) for p, o in zip(prompts, outputs)]

    def propose(self, tokens: list[int], max_draft: int | None = None) -> list[int]:
        for prompt, out in self.known:
            if tokens[:len(prompt)] == prompt:  # once an output strays, its drafts are wrong
                done = len(tokens) - len(prompt)
                draft = out[done:done + min(3, max_draft or 3)]
                return [t + 1 if (done + j) % 3 == 2 else t for j, t in enumerate(draft)]
        return []


def _tokens_of(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_speculation_equals_plain_decoding_with_prefix_cache_and_preemption(tiny_model):
    """Token for token, logprobs included, over the repetitive workload: with the prefix cache
    (run twice, the second hitting it) and with a pool so small that requests are preempted
    and prompts are chunked. Drafts were kept, and a step mixed speculating and plain requests
    (a request under min_tokens does not speculate)."""
    from kserve_paged_engine import LLM, SamplingParams

    prompts = repetitive_prompts()
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)
              for _ in prompts]
    params[2] = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2,
                               min_tokens=12)
    plain = LLM(model=tiny_model, block_size=4, num_kv_blocks=128, max_model_len=96)
    ref = plain.generate(prompts, params, use_tqdm=False)

    cached = LLM(model=tiny_model, block_size=4, num_kv_blocks=128, max_model_len=96,
                 speculative_config=SPEC)
    for _ in range(2):
        outs, steps = run_recording_steps(cached, prompts, params)
        assert sample_tokens(outs) == sample_tokens(ref)
        for o, r in zip(outs, ref):
            got, want = o.outputs[0].logprobs, r.outputs[0].logprobs
            assert [list(e) for e in got] == [list(e) for e in want]
            assert [e[t].logprob for e, t in zip(got, o.outputs[0].token_ids)] == pytest.approx(
                [e[t].logprob for e, t in zip(want, r.outputs[0].token_ids)], abs=1e-4)
    stats = cached.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["prefix_cache_hits"] > 0
    assert any(s.spec_tokens and len(s.spec_tokens) < len(s.scheduled) for s in steps)
    assert stats["kv_blocks_in_use"] == 0

    small = LLM(model=tiny_model, block_size=4, num_kv_blocks=24, max_model_len=96,
                max_num_batched_tokens=16, speculative_config=SPEC)
    outs, steps = run_recording_steps(small, prompts, params)
    assert sample_tokens(outs) == sample_tokens(ref)
    stats = small.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["kv_blocks_free"] == 24
    assert max(s.total_num_scheduled_tokens for s in steps) <= 16


def _bench_workload_prompts(name: str, n: int) -> list[list[int]]:
    """The first n requests of the benchmark workload W1 (`random`) or W2 (`shared`, a long
    common prefix), cut to fit the tiny model: the first 40 and the last 16 prompt tokens (so
    W2's prompts still share their start and differ at the end), ids folded into its vocab."""
    import sys
    from pathlib import Path

    from tests.helpers.tiny_models import VOCAB

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from benchlib import load_workload

    prompts = []
    for r in load_workload(name, n):
        ids = r["prompt_token_ids"]
        ids = ids if len(ids) <= 56 else ids[:40] + ids[-16:]
        prompts.append([3 + t % (VOCAB - 3) for t in ids])
    return prompts


@pytest.mark.parametrize("workload", ["random", "shared"], ids=["W1", "W2"])
def test_greedy_speculation_equals_plain_decoding_on_the_benchmark_workloads(tiny_model,
                                                                             workload):
    """W1 and W2's prompts (cut to the tiny model): with speculation on, with the prefix cache
    and with a pool small enough to preempt, every output equals plain greedy decoding."""
    from kserve_paged_engine import LLM, SamplingParams

    prompts = _bench_workload_prompts(workload, 6)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    ref = LLM(model=tiny_model, block_size=4, num_kv_blocks=256, max_model_len=96).generate(
        prompts, params, use_tqdm=False)
    for options in (dict(num_kv_blocks=256), dict(num_kv_blocks=40,
                                                  max_num_batched_tokens=32)):
        llm = LLM(model=tiny_model, block_size=4, max_model_len=96, speculative_config=SPEC,
                  **options)
        assert sample_tokens(llm.generate(prompts, params, use_tqdm=False)) == sample_tokens(ref)
        stats = llm.stats()
        assert stats["spec_decode_num_draft_tokens"] > 0
        assert stats["kv_blocks_in_use"] == 0
        if options["num_kv_blocks"] == 40:
            assert stats["num_preemptions"] > 0
        else:
            assert workload == "random" or stats["prefix_cache_hits"] > 0


def test_speculation_keeps_stop_strings_stop_tokens_max_tokens_and_n(tiny_model):
    """Stops decided inside a run of kept drafts end the request where plain decoding ends it:
    a stop string, a stop token held back by min_tokens, max_tokens; n = 2 samples fork and
    speculate each."""
    from kserve_paged_engine import LLM, SamplingParams

    prompts = repetitive_prompts(3)
    plain = LLM(model=tiny_model, block_size=4, num_kv_blocks=128, max_model_len=96)
    spec = LLM(model=tiny_model, block_size=4, num_kv_blocks=128, max_model_len=96,
               speculative_config=SPEC)
    free = plain.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0,
                                                  ignore_eos=True), use_tqdm=False)
    words = free[0].outputs[0].text.split()
    stop_token = free[1].outputs[0].token_ids[3]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                             stop=[" ".join(words[6:8])], logprobs=1),
              SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_token],
                             min_tokens=5, logprobs=1),
              SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True, n=2)]
    want = plain.generate(prompts, params, use_tqdm=False)
    spec.engine.spec.proposer = _Oracle(prompts, [o.outputs[0].token_ids for o in free])
    got = spec.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in g.outputs] == [
            (c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in w.outputs]
    for g in got[:2]:  # a run cut at a stop keeps the logprobs of the tokens it keeps
        assert len(g.outputs[0].logprobs) == len(g.outputs[0].token_ids)
    assert want[0].outputs[0].finish_reason == "stop"
    assert len(want[0].outputs[0].token_ids) < 24
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0


def test_sampled_speculation_runs_seeded_and_keeps_drafts(tiny_model):
    """temperature > 0 goes through rejection sampling (its distribution is the unit test's):
    a seeded request gives the same output twice, and drafts are kept."""
    from kserve_paged_engine import LLM, SamplingParams

    prompts = repetitive_prompts(3)
    spec = LLM(model=tiny_model, block_size=4, num_kv_blocks=128, max_model_len=96,
               enable_prefix_caching=False, speculative_config=SPEC)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    spec.engine.spec.proposer = _Oracle(prompts, _tokens_of(spec.generate(prompts, greedy,
                                                                          use_tqdm=False)))
    params = SamplingParams(max_tokens=20, temperature=0.3, top_k=8, ignore_eos=True, seed=3)
    first = sample_tokens(spec.generate(prompts, params, use_tqdm=False))
    assert sample_tokens(spec.generate(prompts, params, use_tqdm=False)) == first
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0


def test_the_server_flag_is_parsed_and_served_outputs_are_unchanged(tiny_model):
    """--speculative_config through the server's parser into the engine: a completion served
    with n-gram speculation equals the offline engine's without it, and the spec-decode
    counters reach /metrics. A bad config is a usage error naming the key."""
    import asyncio
    import json

    from prometheus_client import generate_latest

    from kserve_paged import args as server_args
    from kserve_paged_engine import LLM, SamplingParams
    from kserve_paged_engine.config.engine import EngineConfig
    from kserve_paged_engine.frontend.llm_engine import LLMEngine
    from tests.helpers.server import build, client

    with pytest.raises(SystemExit):
        server_args.parse_args(["--speculative_config", '{"method": "ngram"}'])
    args = server_args.parse_args(["--speculative_config", json.dumps(SPEC)])
    assert args.speculative_config == SpeculativeConfig(**SPEC)
    opts = {"block_size": 4, "num_kv_blocks": 128, "max_model_len": 96}
    engine = LLMEngine(EngineConfig(**{**server_args.engine_kwargs(args), **opts,
                                       "model": tiny_model}))
    assert engine.spec is not None
    prompt = " ".join(f"t{t}" for t in repetitive_prompts(2)[1])
    want = LLM(model=tiny_model, **opts).generate(
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
    scrape = generate_latest(model.test_registry).decode()
    drafted = [line for line in scrape.splitlines()
               if line.startswith("vllm:spec_decode_num_draft_tokens_total{")]
    assert drafted and float(drafted[0].rsplit(" ", 1)[1]) > 0
