"""Draft-model speculation's distributions: sampled drafts verified by rejection sampling give
the target's distribution (a small vocabulary, counted), and the draft gate that pauses a
draft model which does not pay for the whole batch."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.helpers.spec import (
    total_variation,
)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory) -> tuple[Path, Path]:
    """A 2-layer target and a different 1-layer draft over a vocabulary of 8."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.helpers.tiny_models import common_config, randomise

    paths = []
    for layers, seed in ((2, 0), (1, 9)):
        path = tmp_path_factory.mktemp(f"vocab8-{layers}")
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_config(LlamaConfig(**common_config(
            vocab_size=8, num_hidden_layers=layers, tie_word_embeddings=False))).eval()
        randomise(hf, seed)
        hf.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]


def _probs(path: Path, contexts: list[list[int]], temperature: float) -> torch.Tensor:
    """transformers' next-token distributions after each context (all of one length)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        logits = hf(torch.tensor(contexts)).logits[:, -1]
    return torch.softmax(logits / temperature, dim=-1)


@pytest.mark.slow
def test_draft_model_rejection_sampling_outputs_follow_the_target(small_vocab):
    """Vocabulary of 8, k = 2: the proposer draws each draft from q, the draft model's own
    temperature-scaled distribution (checked against transformers), and rejection sampling
    with that q makes the first appended token follow the target's p_0 and the second, given
    the first draft was kept, p_1 (total variation under 0.03 / 0.05 over 6k draws; the noise
    is about 0.015). The first draft is kept at the rate sum(min(p_0, q_0)) that Leviathan et
    al.'s test gives (0.02: reading the drafts as point masses, also unbiased, keeps fewer).
    """
    from kserve_paged_engine.core.request import Request
    from kserve_paged_engine.model_executor.model_loader import load_model
    from kserve_paged_engine.sampling_params import SamplingParams
    from kserve_paged_engine.spec_decode.draft_model import DraftModelProposer
    from kserve_paged_engine.spec_decode.rejection import rejection_sample

    target_path, draft_path = small_vocab
    temp, ctx = 0.7, [1, 5, 2, 7]
    draft, _ = load_model(draft_path, torch.float32, torch.device("cpu"))
    proposer = DraftModelProposer(draft, 2, 1200, 4, torch.float32, torch.device("cpu"),
                                  max_num_batched_tokens=4096, max_num_seqs=512,
                                  max_model_len=32)
    q0 = _probs(draft_path, [ctx], temp)[0]
    q1 = _probs(draft_path, [ctx + [a] for a in range(8)], temp)
    p0 = _probs(target_path, [ctx], temp)[0]
    p1 = _probs(target_path, [ctx + [a] for a in range(8)], temp)
    p2 = _probs(target_path, [ctx + [a, b] for a in range(8) for b in range(8)], temp)
    g = torch.Generator().manual_seed(11)
    params = SamplingParams(max_tokens=10, temperature=temp)
    first, second, drafted = Counter(), Counter(), Counter()
    kept = 0
    n = 0
    for batch in range(12):
        reqs = [Request(f"r{batch}-{i}", ctx[:-1], params, output_token_ids=ctx[-1:])
                for i in range(500)]
        drafts, q = proposer.propose([(r, 2) for r in reqs], lambda _: g)
        proposer.release_all()
        for r in reqs:
            d, qr = drafts[r.request_id], q[r.request_id]
            assert len(d) == 2 and qr.shape == (2, 8)
            torch.testing.assert_close(qr[0], q0, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(qr[1], q1[d[0]], atol=1e-4, rtol=1e-4)
            drafted[d[0]] += 1
            out = rejection_sample(torch.stack([p0, p1[d[0]], p2[8 * d[0] + d[1]]]), d, qr, g)
            first[out[0]] += 1
            kept += len(out) >= 2
            if len(out) >= 2 and out[0] == d[0]:
                second[(out[0], out[1])] += 1
            n += 1
    assert proposer.kv.num_free_blocks == proposer.kv.num_blocks
    assert total_variation(drafted, q0, n) < 0.03  # drafts are drawn from q
    assert total_variation(first, p0, n) < 0.03
    assert kept / n == pytest.approx(float(torch.minimum(p0, q0).sum()), abs=0.02)
    a = max(range(8), key=lambda t: sum(c for (x, _), c in second.items() if x == t))
    given = Counter({b: c for (x, b), c in second.items() if x == a})
    assert sum(given.values()) > 800
    assert total_variation(given, p1[a], sum(given.values())) < 0.05


def test_the_draft_gate_pauses_a_losing_draft_for_the_whole_batch_and_probes_again():
    """The gate's arithmetic on given times: a window of draft steps whose kept drafts do not
    buy back the draft's time pauses drafting for PAUSE_MIN steps, a second losing window for
    twice that; a winning window resets the pause length and drafting goes on."""
    from kserve_paged_engine.spec_decode.draft_gate import PAUSE_MIN, WINDOW, DraftGate

    gate = DraftGate()

    def window(kept_per_request: float) -> None:
        for _ in range(WINDOW):
            assert gate.open()
            gate.record(draft_seconds=0.3, step_seconds=0.4, kept_per_request=kept_per_request)

    window(2.0)  # cost 0.3 / 0.1 = 3 a step, gain 2: losing
    assert [gate.open() for _ in range(PAUSE_MIN)] == [False] * PAUSE_MIN
    window(2.5)
    assert [gate.open() for _ in range(2 * PAUSE_MIN)] == [False] * (2 * PAUSE_MIN)
    window(3.5)  # gain above the cost: no pause, and the next pause is short again
    assert gate.open() and gate.pause == 0 and gate.next_pause == PAUSE_MIN
    assert gate.num_paused_steps == 3 * PAUSE_MIN
    gate.record(draft_seconds=0.5, step_seconds=0.5, kept_per_request=0.0)  # no time left: ignored
    assert gate._steps == 0


