"""Reasoning parsers (kserve_paged/openai/reasoning.py): the whole-output split and the streamed
split agree for every way of cutting the text into deltas."""

from __future__ import annotations

import pytest

from kserve_paged.openai.reasoning import ReasoningStream, split_reasoning

CASES = [  # parser, output, (reasoning, content)
    ("qwen3", "<think>\nplan it</think>\n\nThe answer.", ("\nplan it", "The answer.")),
    ("qwen3", "The answer without thinking.", (None, "The answer without thinking.")),
    ("qwen3", "  <think>a</think>b", ("a", "b")),
    ("qwen3", "<think>cut off while thin", ("cut off while thin", None)),
    ("qwen3", "<think></think>", ("", None)),
    ("qwen3", "a < b and <thinking> is not a tag", (None, "a < b and <thinking> is not a tag")),
    ("deepseek_r1", "weigh options</think>\n\nPick B.", ("weigh options", "Pick B.")),
    ("deepseek_r1", "<think>weigh</think>B", ("weigh", "B")),
    ("deepseek_r1", "never finished", ("never finished", None)),
    ("deepseek_r1", "x </thin y</think>z", ("x </thin y", "z")),
    ("qwen3", "", (None, None)),
]


@pytest.mark.parametrize(("parser", "text", "expected"), CASES)
def test_whole_output_split(parser: str, text: str, expected: tuple) -> None:
    split = split_reasoning(text, parser)
    assert (split.reasoning, split.content) == expected


def _streamed(parser: str, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    stream = ReasoningStream(parser)
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas), deltas


@pytest.mark.parametrize(("parser", "text", "expected"), CASES)
def test_every_two_and_one_character_cut_streams_the_same_split(parser: str, text: str,
                                                                expected: tuple) -> None:
    want_reasoning, want_content = (x or "" for x in expected)
    cuts = [[text[:i], text[i:j], text[j:]] for i in range(len(text) + 1)
            for j in range(i, min(len(text), i + 9) + 1)]
    cuts.append(list(text))  # one character at a time
    for pieces in cuts:
        reasoning, content, deltas = _streamed(parser, pieces)
        assert (reasoning, content) == (want_reasoning, want_content), pieces
        for r, c in deltas:  # a tag is never shown, not even half of one
            assert "</think>" not in r + c and not (r + c).endswith(("</", "</th"))


def test_reasoning_ends_when_the_answer_starts() -> None:
    stream = ReasoningStream("qwen3")
    assert stream.feed("<think>hm") == ("hm", "")
    assert not stream.reasoning_ended
    assert stream.feed("</thi") == ("", "")  # held back: could be the end tag
    assert stream.feed("nk>\n\nYes") == ("", "Yes")
    assert stream.reasoning_ended


def test_an_unknown_parser_is_named() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'.*qwen3, deepseek_r1"):
        split_reasoning("x", "r2")
