"""Issue 49: a step's work on a request's allowed_token_ids, logit_bias and bad words does not
grow with the client's lists (they are prepared once per request:
engine/kserve_paged_engine/sample/token_filters.py).

Counted, not timed: the Python bytecodes the engine runs to filter one row at a step after the
first (a tensor operation is one call whatever its size: the prepared row is O(vocabulary)
like the softmax after it). A loop over a list of 100k entries runs millions of them."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable

import torch

from kserve_paged_engine import SamplingParams
from kserve_paged_engine.sample.logits_processors import apply_penalties
from kserve_paged_engine.sample.token_filters import BadWordTrie, admit

VOCAB = 200_000
FEW, MANY = 10, 100_000
OUTPUT = [7, 8, 9] * 10  # the output so far ends "... 7 8 9"
SLACK = 50  # bytecodes: dict and list sizes change no count, but leave room for a branch


def engine_bytecodes(fn: Callable[[], object]) -> int:
    """Bytecodes executed in the engine package's Python while `fn()` runs."""
    count = 0

    def local(frame, event, arg):  # noqa: ANN001 - sys.settrace's signature
        nonlocal count
        if event == "opcode":
            count += 1
        return local

    def on_call(frame, event, arg):  # noqa: ANN001
        if "kserve_paged_engine" not in frame.f_code.co_filename:
            return None
        frame.f_trace_opcodes = True
        return local

    sys.settrace(on_call)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def step(params: SamplingParams, output: list[int]) -> torch.Tensor:
    return apply_penalties(torch.zeros(1, VOCAB), [params], [[1]], [output])[0]


def later_step_work(params: SamplingParams, output: list[int]) -> int:
    step(params, output)  # the first step prepares the lists
    return engine_bytecodes(lambda: step(params, output))


def random_words(count: int, rng: random.Random) -> list[list[int]]:
    """Three-token words of ids the output never holds."""
    return [[rng.randrange(1000, VOCAB) for _ in range(3)] for _ in range(count)]


def test_bad_words_cost_per_step_does_not_grow_with_their_number():
    rng = random.Random(0)
    work = {}
    for count in (FEW, MANY):
        p = SamplingParams(bad_words=["x"])
        # banned after "8 9", and always; then words that never match the output
        p.bad_words_token_ids = [[8, 9, 42], [5], *random_words(count, rng)]
        row = step(p, OUTPUT)
        assert torch.isinf(row).nonzero().flatten().tolist() == [5, 42]
        later = step(p, [8, 9, 1])
        assert later[5] == float("-inf") and later[42] == 0  # 42 only right after "8 9"
        work[count] = later_step_work(p, OUTPUT)
    assert work[MANY] <= work[FEW] + SLACK, work


def test_allowed_token_ids_and_logit_bias_cost_per_step_does_not_grow_with_them():
    rng = random.Random(1)
    work = {}
    for count in (FEW, MANY):
        allowed = [3, *rng.sample(range(10, VOCAB), count)]
        bias = {3: 5.0, **{t: -1.0 for t in rng.sample(range(10, VOCAB), count)}}
        p = SamplingParams(allowed_token_ids=allowed, logit_bias=bias)
        row = step(p, OUTPUT)
        assert row[3] == 5.0 and row[0] == float("-inf")
        assert torch.isfinite(row).sum().item() == len(set(allowed))
        work[count] = later_step_work(p, OUTPUT)
    assert work[MANY] <= work[FEW] + SLACK, work


class CountingTokenizer:
    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.calls += 1
        return [ord(c) for c in text.strip()]


def test_copies_of_a_requests_params_admit_and_prepare_once():
    """The prompts of one request and its n samples are copies of one SamplingParams: its bad
    words are tokenized once, and the first step of a second copy prepares nothing."""
    base = SamplingParams(bad_words=[f"w{i}" for i in range(200)], allowed_token_ids=[1, 2])
    first, second = base.with_max_tokens(4), base.with_max_tokens(8)
    tok = CountingTokenizer()
    admit(first, VOCAB, tok)
    calls = tok.calls
    admit(second, VOCAB, tok)
    assert calls > 0 and tok.calls == calls
    assert second.bad_words_token_ids is first.bad_words_token_ids
    output = [ord("w")]
    prepared_once = later_step_work(first, output)
    assert engine_bytecodes(lambda: step(second, output)) <= prepared_once + SLACK


def test_the_trie_bans_exactly_what_the_rule_bans():
    """The rule (logits_processors.py): a word's last token is banned when the output ends
    with the tokens before it. Random words over a small alphabet, so that many match."""
    rng = random.Random(2)
    for _ in range(200):
        words = [[rng.randrange(6) for _ in range(rng.randrange(2, 5))]
                 for _ in range(rng.randrange(1, 12))]
        output = [rng.randrange(8) for _ in range(rng.randrange(0, 6))]
        trie = BadWordTrie.of(words, vocab=6)
        assert trie is not None
        expected = {w[-1] for w in words
                    if len(output) >= len(w) - 1 and output[len(output) - len(w) + 1:] == w[:-1]}
        assert set(trie.banned(output)) == expected, (words, output)
