"""Sampler semantics (greedy, temperature, top-k, top-p, min-p, min_tokens) and seed invariance."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kserve_paged_engine.sample.sampler import GREEDY_EPS, Sampler, make_generator
from kserve_paged_engine.sampling_params import SamplingParams as SP


def run(sampler: Sampler, logits: torch.Tensor, params: list[SP], gens=None, outs=None,
        eos=None) -> torch.Tensor:
    n = logits.shape[0]
    gens = gens if gens is not None else [None] * n
    outs = outs if outs is not None else [0] * n
    eos = eos if eos is not None else [None] * n
    before = logits.clone()
    tokens = sampler.sample(logits, params, gens, outs, eos)
    assert torch.equal(logits, before), "the sampler must not modify its input"
    assert tokens.dtype == torch.int64 and tokens.shape == (n,)
    return tokens


def repeated(row: torch.Tensor, n: int) -> torch.Tensor:
    return row.unsqueeze(0).expand(n, -1).contiguous()


def kept_set(row: torch.Tensor, sp: SP, slack: float = 0.0) -> set[int]:
    """Reference filter in float64: which tokens may be drawn (slack loosens the cut-offs)."""
    probs = torch.softmax(row.double() / sp.temperature, -1)
    vals, order = probs.sort(descending=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if 0 < sp.top_k < probs.numel():
        keep &= probs >= vals[sp.top_k - 1] * (1 - slack)
    masked = torch.where(keep, probs, 0.0)
    masked = masked / masked.sum()
    if sp.top_p < 1.0:
        svals = masked.sort(descending=True).values
        first = int((svals.cumsum(0) < min(1.0, sp.top_p + slack)).sum().clamp(max=len(svals) - 1))
        keep &= masked >= svals[first] * (1 - slack)
    if sp.min_p > 0:
        keep &= probs >= sp.min_p * probs.max() * (1 - slack)
    return set(keep.nonzero().squeeze(1).tolist())


def test_make_generator() -> None:
    assert make_generator(None) is None
    a, b = make_generator(7), make_generator(7)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    for seed in (-1, 2**70, 0):  # any int the API accepts
        assert make_generator(seed) is not None


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 5000)
    params = [SP(temperature=0.0) for _ in range(16)]
    assert torch.equal(run(Sampler(), logits, params), logits.argmax(-1))
    # Temperatures below GREEDY_EPS are greedy too.
    params = [SP(temperature=GREEDY_EPS / 2) for _ in range(16)]
    assert torch.equal(run(Sampler(), logits, params), logits.argmax(-1))


@pytest.mark.parametrize("k", [1, 5, 63, 64, 300, 2000, 5000])
def test_top_k_stays_in_top_k(k: int) -> None:
    # 5000 needs a full sort (past the candidate ladder); 64 and 300 sit at rung edges.
    torch.manual_seed(k)
    vocab = 8192
    row = torch.randn(vocab) * 0.5  # flat-ish, so the top k all get drawn sometimes
    sampler = Sampler(seed=1)
    allowed = set(row.topk(k).indices.tolist())
    seen: set[int] = set()
    for _ in range(8):
        tokens = run(sampler, repeated(row, 64), [SP(top_k=k) for _ in range(64)])
        seen |= set(tokens.tolist())
    assert seen <= allowed
    if k <= 5:
        assert seen == allowed


def constructed(probs: list[float], vocab: int) -> torch.Tensor:
    """Logits whose softmax puts ``probs`` on tokens 10, 11, ... and spreads the rest evenly."""
    rest = (1.0 - sum(probs)) / (vocab - len(probs))
    p = torch.full((vocab,), rest, dtype=torch.float64)
    p[10:10 + len(probs)] = torch.tensor(probs, dtype=torch.float64)
    return p.log().float()


def chi_square(counts: list[int], expected: list[float]) -> float:
    total = sum(counts)
    return sum((c - e * total) ** 2 / (e * total) for c, e in zip(counts, expected))


@pytest.mark.parametrize("vocab", [100, pytest.param(20000, marks=pytest.mark.slow)])
def test_top_p_nucleus_and_frequencies(vocab: int) -> None:
    head = [0.4, 0.2, 0.15, 0.1]
    row = constructed(head, vocab)
    # Mass 0.4+0.2+0.15 = 0.75 < 0.8, so the smallest set reaching 0.8 is the first four.
    sp = SP(top_p=0.8)
    sampler = Sampler(seed=1234)
    counts = [0] * 4
    n = 4000
    for _ in range(2):
        tokens = run(sampler, repeated(row, n), [sp] * n)
        assert set(tokens.tolist()) <= {10, 11, 12, 13}
        for t in tokens.tolist():
            counts[t - 10] += 1
    expected = [x / sum(head) for x in head]
    # 3 degrees of freedom: 16.3 is the 0.999 quantile; the seed is fixed, so this is stable.
    assert chi_square(counts, expected) < 16.3, counts


def test_top_p_on_flat_row_uses_full_sort() -> None:
    # The nucleus of a near-uniform row is thousands of tokens: past every candidate rung.
    torch.manual_seed(3)
    vocab = 8192
    row = torch.randn(vocab) * 0.1
    sp = SP(top_p=0.5)
    allowed = kept_set(row, sp, slack=1e-4)
    assert len(allowed) > 3000
    tokens = run(Sampler(seed=5), repeated(row, 256), [sp] * 256)
    assert set(tokens.tolist()) <= allowed
    assert len(set(tokens.tolist())) > 200


def test_min_p() -> None:
    probs = [0.3, 0.2, 0.1, 0.05, 0.02]
    row = constructed(probs, 1000)
    # min_p 0.3: keep prob >= 0.09 -> tokens 10, 11, 12 only.
    sp = SP(min_p=0.3)
    sampler = Sampler(seed=2)
    tokens = run(sampler, repeated(row, 3000), [sp] * 3000)
    assert set(tokens.tolist()) == {10, 11, 12}
    counts = [(tokens == t).sum().item() for t in (10, 11, 12)]
    assert chi_square(counts, [0.5, 1 / 3, 1 / 6]) < 13.8, counts  # 2 dof, 0.999 quantile


def test_temperature_changes_the_spread() -> None:
    row = constructed([0.5, 0.3], 50)
    sampler = Sampler(seed=9)
    n = 4000
    share = {}
    for temp in (0.5, 1.0, 2.0):
        tokens = run(sampler, repeated(row, n), [SP(temperature=temp)] * n)
        share[temp] = (tokens == 10).float().mean().item()
        expected = torch.softmax(row.double() / temp, -1)[10].item()
        sd = math.sqrt(expected * (1 - expected) / n)
        assert abs(share[temp] - expected) < 5 * sd, (temp, share[temp], expected)
    assert share[0.5] > share[1.0] > share[2.0]


def seeded_cases() -> list[SP]:
    return [
        SP(temperature=0.8, seed=11),
        SP(temperature=1.0, top_p=0.9, seed=12),
        SP(temperature=1.3, top_k=40, seed=13),
        SP(temperature=0.9, top_k=500, top_p=0.95, min_p=0.01, seed=14),
        SP(temperature=1.0, min_p=0.05, seed=15),
        SP(temperature=1.0, top_p=0.7, seed=16),  # used on a flat row below: full-sort path
    ]


@pytest.mark.parametrize("case", range(6))
def test_seed_reproduces_whatever_the_batch(case: int) -> None:
    vocab = 8192
    sp = seeded_cases()[case]
    torch.manual_seed(100 + case)
    scale = 0.05 if case == 5 else 3.0
    rows = [torch.randn(vocab) * scale for _ in range(6)]  # this request's logits, step by step

    alone = Sampler(seed=0)
    gen = make_generator(sp.seed)
    expected = [run(alone, row.unsqueeze(0), [sp], [gen]).item() for row in rows]

    others = [SP(temperature=0), SP(temperature=1.0), SP(top_k=3), SP(top_p=0.5, seed=99),
              SP(min_p=0.2), SP(temperature=0.7, top_p=0.9), SP(top_k=1000, seed=5)]
    for position in (0, 3, 7):
        batched = Sampler(seed=position + 1)
        gen = make_generator(sp.seed)
        other_gens = [make_generator(o.seed) for o in others]
        got = []
        for step, row in enumerate(rows):
            logits = torch.randn(8, vocab) * 3
            logits[position] = row
            params = list(others)
            params.insert(position, sp)
            gens = list(other_gens)
            gens.insert(position, gen)
            # Vary the batch from step to step too (other rows drop out).
            keep = [i for i in range(8) if i == position or (i + step) % 3]
            tokens = run(batched, logits[keep], [params[i] for i in keep],
                         [gens[i] for i in keep], [step] * len(keep))
            got.append(tokens[keep.index(position)].item())
        assert got == expected, (position, got, expected)


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    vocab = 300
    eos, stop = 7, 42
    logits = torch.zeros(2, vocab)
    logits[:, eos] = 50.0
    logits[:, stop] = 40.0
    logits[:, 100] = 30.0
    sampler = Sampler(seed=0)
    for temp in (0.0, 1.0):
        sp = SP(temperature=temp, min_tokens=3, stop_token_ids=[stop], max_tokens=10)
        params = [sp, sp]
        for done in range(5):
            tokens = run(sampler, logits, params, outs=[done, done], eos=[eos, eos]).tolist()
            if done < 3:
                assert tokens == [100, 100], (temp, done, tokens)
            else:
                assert tokens == [eos, eos], (temp, done, tokens)
    # EOS is suppressed under min_tokens even with ignore_eos; None means the model has none.
    sp = SP(temperature=0, min_tokens=2, ignore_eos=True)
    assert run(sampler, logits[:1], [sp], outs=[1], eos=[eos]).item() == stop
    assert run(sampler, logits[:1], [sp], outs=[1], eos=[None]).item() == eos


def test_mixed_batch() -> None:
    torch.manual_seed(21)
    vocab = 4096
    logits = torch.randn(12, vocab) * 2
    params = [
        SP(temperature=0), SP(top_k=1), SP(temperature=0.7, seed=1), SP(top_k=10),
        SP(top_p=0.6), SP(temperature=0, min_tokens=4, stop_token_ids=[5]), SP(min_p=0.5),
        SP(temperature=1.0), SP(temperature=0.9, top_p=0.8, seed=2), SP(temperature=0),
        SP(top_k=200, top_p=0.9, min_p=0.1), SP(temperature=2.0, seed=3),
    ]
    logits[5, 5] = 100.0  # banned while under min_tokens: the greedy row takes the runner-up
    gens = [make_generator(p.seed) for p in params]
    tokens = run(Sampler(seed=4), logits, params, gens).tolist()
    argmax = logits.argmax(-1).tolist()
    for i in (0, 1, 9):
        assert tokens[i] == argmax[i]
    second = logits[5].clone()
    second[5] = float("-inf")
    assert tokens[5] == int(second.argmax())
    for i, sp in enumerate(params):
        if sp.temperature > 0:
            assert tokens[i] in kept_set(logits[i], sp, slack=1e-4), i
    # The seeded rows match the same requests sampled on their own.
    for i in (2, 8, 11):
        alone = run(Sampler(seed=77), logits[i:i + 1], [params[i]],
                    [make_generator(params[i].seed)]).item()
        assert tokens[i] == alone


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31),
    vocab=st.sampled_from([70, 300, 5000]),
    temperature=st.floats(0.05, 3.0),
    top_k=st.sampled_from([0, 0, 1, 2, 50, 64, 100, 4999]),
    top_p=st.sampled_from([1.0, 1.0, 0.05, 0.5, 0.9, 0.99]),
    min_p=st.sampled_from([0.0, 0.0, 0.01, 0.3, 1.0]),
    scale=st.sampled_from([0.01, 1.0, 5.0]),
)
def test_draws_stay_in_the_reference_set(seed: int, vocab: int, temperature: float, top_k: int,
                                         top_p: float, min_p: float, scale: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, vocab, generator=gen) * scale
    sp = SP(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    tokens = run(Sampler(seed=seed), logits, [sp] * 4)
    for i in range(4):
        assert tokens[i].item() in kept_set(logits[i], sp, slack=1e-4)


def test_min_p_with_a_large_kept_set() -> None:
    # Thousands of tokens pass min-p: draws must reach past the first candidate rungs.
    torch.manual_seed(8)
    vocab = 4096
    row = torch.randn(vocab) * 0.3
    sp = SP(min_p=0.3)
    allowed = kept_set(row, sp, slack=1e-4)
    assert len(allowed) > 2000
    n = 1024
    tokens = run(Sampler(seed=3), repeated(row, n), [sp] * n).tolist()
    assert set(tokens) <= allowed
    probs = torch.softmax(row.double(), -1)
    probs[probs < sp.min_p * probs.max()] = 0
    probs /= probs.sum()
    top64 = set(probs.topk(64).indices.tolist())
    expected = 1 - probs[list(top64)].sum().item()
    share = sum(t not in top64 for t in tokens) / n
    assert abs(share - expected) < 5 * math.sqrt(expected * (1 - expected) / n), (share, expected)


def test_ties_at_the_cut_off_are_all_kept() -> None:
    # One strong token and 200 tied ones: top_k=2 keeps the whole tie (vLLM's rule), and top-p
    # must then see the tie's full mass although it runs past the first 64 candidates.
    vocab = 1000
    row = torch.full((vocab,), -30.0)
    row[500] = 5.0
    row[:200] = 0.0
    sp = SP(top_k=2, top_p=0.5)
    n = 2000
    tokens = run(Sampler(seed=6), repeated(row, n), [sp] * n)
    assert set(tokens.tolist()) <= {500, *range(200)}
    share = (tokens == 500).float().mean().item()
    expected = math.exp(5) / (math.exp(5) + 200)  # 0.426: the top token alone is under p
    assert abs(share - expected) < 5 * math.sqrt(expected * (1 - expected) / n), share
    assert len(set(tokens.tolist())) > 150
