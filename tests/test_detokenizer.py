"""Incremental detokenization (multi-byte characters, special tokens) and stop strings.

The tokenizer is a byte-level BPE trained here, offline, on a few multilingual sentences: with
a 400-entry vocabulary most non-ASCII characters span several tokens and some tokens span the
end of one character and the start of the next, which is what the detokenizer must get right.
"""

from __future__ import annotations

import random

import pytest
import tokenizers
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kserve_paged_engine.frontend.default_model import ensure_default_model
from kserve_paged_engine.frontend.detokenizer import IncrementalDetokenizer
from kserve_paged_engine.sampling_params import SamplingParams as SP

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Grüße aus München! Schöne Äpfel und Öl.",
    "日本語のテキストです。東京は大きい。",
    "中文文本测试，你好世界。",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "Emoji time: 😀😃😄 👍🏽 🇩🇪 👨‍👩‍👧",
    "Hello world, hello again. The end.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tok():
    from transformers import PreTrainedTokenizerFast

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=SPECIALS[0],
                                   additional_special_tokens=SPECIALS[1:])


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def dec(tok, ids: list[int], skip: bool = True) -> str:
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def stream(tok, ids: list[int], params: SP, prompt: str = "User: hi", chunks: int = 1,
           seed: int = 0) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed ids in random chunks of 1..chunks, collecting deltas; checks streaming invariants."""
    detok = IncrementalDetokenizer(tok, enc(tok, prompt), params)
    rng = random.Random(seed)
    deltas: list[str] = []
    i = 0
    while i < len(ids) and not detok.stopped:
        n = rng.randint(1, chunks)
        detok.update(ids[i:i + n])
        i += n
        deltas.append(detok.get_delta())
        # What a client has seen is never taken back.
        assert detok.output_text.startswith("".join(deltas))
    deltas.append(detok.get_delta(finished=True))
    assert "".join(deltas) == detok.output_text
    assert detok.get_delta(finished=True) == ""
    return detok, deltas


def test_tokenizer_splits_characters(tok) -> None:
    # The premise of the multi-byte tests: some tokens are not whole characters.
    pieces = [dec(tok, [i]) for i in enc(tok, "😀 日本 Grüße")]
    assert any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("text", CORPUS + [
    "Mixed: naïve café — 🤖 said 你好, Привет; done ✅.",
    "🇩🇪🇫🇷🇯🇵 flags and 👩🏾‍💻 sequences",
])
def test_incremental_text_matches_full_decode(tok, text: str) -> None:
    ids = enc(tok, text)
    detok = IncrementalDetokenizer(tok, enc(tok, "Prompt ends mid-word: 日本"), SP())
    for i in range(len(ids)):
        detok.update([ids[i]])
        full = dec(tok, ids[:i + 1])
        assert "\ufffd" not in detok.output_text
        if full.endswith("\ufffd"):
            # Held back: a character is incomplete; what is out is a clean prefix.
            assert full.startswith(detok.output_text)
        else:
            assert detok.output_text == full
    assert detok.output_text == text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(blacklist_characters="\ufffd", blacklist_categories=("Cs",)),
                    max_size=60),
       chunks=st.integers(1, 5), seed=st.integers(0, 1000))
def test_any_text_any_chunking(tok, text: str, chunks: int, seed: int) -> None:
    ids = enc(tok, text)
    detok, _ = stream(tok, ids, SP(), chunks=chunks, seed=seed)
    assert detok.output_text == dec(tok, ids) == text


def boundaries(tok, ids: list[int]) -> list[int]:
    """Character offsets in the decoded text where one token ends and the next begins."""
    return [len(dec(tok, ids[:i])) for i in range(1, len(ids))]


def test_stop_string_spanning_tokens(tok) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = enc(tok, text)
    b = next(b for b in boundaries(tok, ids) if b > 12 and text[b - 2:b + 2].isascii())
    stop = text[b - 2:b + 2]
    assert text.find(stop) == b - 2
    detok, deltas = stream(tok, ids, SP(stop=[stop]))
    assert detok.stopped and detok.stop_reason == stop
    assert detok.output_text == text[:b - 2]


def test_stop_string_at_the_start(tok) -> None:
    ids = enc(tok, "Hello world, hello again.")
    detok, deltas = stream(tok, ids, SP(stop=["Hello"]))
    assert detok.stopped and detok.output_text == "" and "".join(deltas) == ""
    detok, _ = stream(tok, ids, SP(stop=["Hello"], include_stop_str_in_output=True))
    assert detok.output_text == "Hello"


@pytest.mark.parametrize("chunks", [1, 4, 100])
def test_truncation_and_include_stop_str(tok, chunks: int) -> None:
    text = "Hello world, hello again. The end."
    ids = enc(tok, text)
    detok, _ = stream(tok, ids, SP(stop=["again"]), chunks=chunks)
    assert detok.output_text == "Hello world, hello "
    assert detok.stop_reason == "again"
    detok, _ = stream(tok, ids, SP(stop=["again"], include_stop_str_in_output=True),
                      chunks=chunks)
    # Text after the stop string in the same update is cut too.
    assert detok.output_text == "Hello world, hello again"
    # Later updates are ignored once stopped.
    detok.update(enc(tok, " more"))
    assert detok.output_text == "Hello world, hello again"


@pytest.mark.parametrize("chunks", [1, 3, 100])
def test_multiple_stop_strings_earliest_wins(tok, chunks: int) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = enc(tok, text)
    detok, _ = stream(tok, ids, SP(stop=["lazy", "fox", "quick brown"]), chunks=chunks)
    assert detok.stop_reason == "quick brown" and detok.output_text == "The "
    # Same start: the shorter one completed first.
    detok, _ = stream(tok, ids, SP(stop=["brown fox", "brown"], include_stop_str_in_output=True),
                      chunks=100)
    assert detok.stop_reason == "brown" and detok.output_text == "The quick brown"


def test_stop_string_with_multibyte_characters(tok) -> None:
    text = "日本語のテキストです。東京は大きい。"
    ids = enc(tok, text)
    detok, _ = stream(tok, ids, SP(stop=["東京"]))
    assert detok.output_text == "日本語のテキストです。"


def test_deltas_hold_back_possible_stop_prefix(tok) -> None:
    text = "Hello world, hello again. The end."
    ids = enc(tok, text)
    # "hello agx" never matches, but while "hello ag" is the tail it must not be streamed.
    detok = IncrementalDetokenizer(tok, [], SP(stop=["hello agx"]))
    seen = ""
    for i in ids:
        detok.update([i])
        seen += detok.get_delta()
        assert len(detok.output_text) - len(seen) <= len("hello agx") - 1
        if detok.output_text.endswith("hello ag"):
            assert not seen.endswith("h")
    seen += detok.get_delta(finished=True)
    assert seen == text and not detok.stopped


def no_substrings(stops: list[str]) -> bool:
    return all(a == b or a not in b for a in stops for b in stops)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), chunks=st.integers(1, 6), include=st.booleans(), seed=st.integers(0, 99))
def test_stop_strings_property(tok, data, chunks: int, include: bool, seed: int) -> None:
    text = data.draw(st.sampled_from(CORPUS + [" ".join(CORPUS)]))
    stops = data.draw(st.lists(
        st.one_of(
            st.builds(lambda a, n: text[a:a + n], st.integers(0, len(text) - 1),
                      st.integers(1, 6)),
            st.text(alphabet="abcdefo hT.", min_size=1, max_size=4)),
        min_size=1, max_size=3))
    stops = [s for s in stops if s]
    assume(stops and no_substrings(stops))
    ids = enc(tok, text)
    detok, deltas = stream(tok, ids, SP(stop=stops, include_stop_str_in_output=include),
                           chunks=chunks, seed=seed)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        assert detok.output_text == text and not detok.stopped
        return
    pos, stop = min(hits)
    assert detok.stopped and detok.stop_reason == stop
    assert detok.output_text == text[:pos + (len(stop) if include else 0)]


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok, skip: bool) -> None:
    ids = enc(tok, "<|im_start|>assistant\nHi 😀 there<|im_end|>\n<|im_start|>x")
    assert any(i in tok.all_special_ids for i in ids)
    detok, _ = stream(tok, ids, SP(skip_special_tokens=skip))
    assert detok.output_text == dec(tok, ids, skip=skip)
    assert ("<|im_end|>" in detok.output_text) is not skip


def test_stop_terminated_token_text_left_out(tok) -> None:
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    ids = enc(tok, "Hello world") + [eos]
    for include in (False, True):
        detok = IncrementalDetokenizer(
            tok, [], SP(skip_special_tokens=False, include_stop_str_in_output=include))
        detok.update(ids[:-1])
        detok.update(ids[-1:], stop_terminated=True)
        assert detok.output_text == "Hello world" + ("<|endoftext|>" if include else "")


def test_decode_window_stays_small(tok) -> None:
    """Each update decodes a bounded window, not the whole output (no O(n^2))."""

    class Counting:
        def __init__(self, inner) -> None:
            self.inner, self.longest, self.calls = inner, 0, 0

        def decode(self, ids, **kw):
            self.longest = max(self.longest, len(ids))
            self.calls += 1
            return self.inner.decode(ids, **kw)

    counting = Counting(tok)
    text = " ".join(CORPUS) * 20
    ids = enc(tok, text)
    detok = IncrementalDetokenizer(counting, enc(tok, "a long prompt " * 50),
                                   SP(stop=["never appears"]))
    deltas = []
    for i in ids:
        detok.update([i])
        deltas.append(detok.get_delta())
    deltas.append(detok.get_delta(finished=True))
    assert "".join(deltas) == detok.output_text == text
    assert counting.calls == 2 * len(ids)
    assert counting.longest <= 16, counting.longest
    assert len(detok._ids) < 300  # ids before the window are dropped


def test_smollm2_tokenizer() -> None:
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained(str(ensure_default_model(progress=lambda _: None)))
    text = "Grüße 😀 from 東京! <|im_end|> Привет 👨‍👩‍👧 done."
    ids = real.encode(text, add_special_tokens=False)
    for skip in (True, False):
        detok, _ = stream(real, ids, SP(skip_special_tokens=skip), chunks=3)
        assert detok.output_text == dec(real, ids, skip=skip)
    detok, _ = stream(real, ids, SP(stop=["Привет"]))
    assert detok.output_text == "Grüße 😀 from 東京!  "
