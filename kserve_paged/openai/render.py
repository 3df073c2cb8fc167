"""Engine outputs -> OpenAI response pieces: finish reasons, usage, log-probabilities, and the
completions choices (whole, or one streamed chunk's worth)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openai.types import CompletionUsage

from kserve_paged.logprobs import Entry, TokenText, completion_logprobs, prompt_logprobs_json
from kserve_paged.openai.errors import APIError
from kserve_paged.openai.schemas import CompletionBody
from kserve_paged_engine.outputs import CompletionOutput, RequestOutput

_FINISH_REASONS = {"stop", "length"}


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> CompletionUsage:
    return CompletionUsage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens,
                           prompt_tokens_details={"cached_tokens": cached})


def check_output(out: RequestOutput) -> None:
    if out.error is not None or any(c.finish_reason == "error" for c in out.outputs):
        status = out.error_status or 500
        raise APIError(status, out.error if status < 500 else f"generation failed: {out.error}")


def finish_reason(completion: CompletionOutput) -> str | None:
    reason = completion.finish_reason
    return reason if reason in _FINISH_REASONS else (None if reason is None else "stop")


def new_entries(completion: CompletionOutput, delta: bool) -> tuple[list[int], list[Entry]]:
    """The completion's token ids (all, or this step's) with their log-probability entries."""
    ids = list(completion.delta_token_ids) if delta else list(completion.token_ids)
    entries: list[Entry] = list(completion.logprobs or [])
    if len(entries) < len(completion.token_ids):  # an engine that returned none
        entries += [None] * (len(completion.token_ids) - len(entries))
    return ids, entries[len(completion.token_ids) - len(ids):len(completion.token_ids)]


def total_usage(finals: list[RequestOutput]) -> CompletionUsage:
    """Prompt tokens once per prompt, completion tokens of every sample (as vLLM counts)."""
    return usage(sum(len(o.prompt_token_ids) for o in finals),
                 sum(len(c.token_ids) for o in finals for c in o.outputs),
                 sum(o.num_cached_tokens for o in finals))


@dataclass(slots=True)
class ChoiceState:
    """What one streamed choice has sent so far."""

    started: bool = False
    done: bool = False
    offset: int = 0  # text offset of the next legacy logprobs entry


class CompletionRender:
    """Builds one completions choice (whole, or one streamed chunk's worth) from an output."""

    def __init__(self, body: CompletionBody, text: TokenText,
                 prompt_texts: list[str] | None) -> None:
        self.body = body
        self.text = text
        self.prompt_texts = prompt_texts

    @property
    def echo(self) -> bool:
        return self.prompt_texts is not None

    def piece(self, prompt_index: int, out: RequestOutput, c: CompletionOutput,
              state: ChoiceState, delta: bool) -> dict[str, Any]:
        body = self.body
        first = not state.started
        state.started = True
        echo_now = self.prompt_texts is not None and first
        prefix = self.prompt_texts[prompt_index] if self.prompt_texts is not None and first else ""
        text = prefix + (c.delta_text if delta else c.text)
        choice: dict[str, Any] = {"index": prompt_index * body.n + c.index, "text": text,
                                  "logprobs": None}
        if body.logprobs is not None:
            parts = []
            if echo_now:
                entries = list(out.prompt_logprobs or [])
                entries += [None] * (len(out.prompt_token_ids) - len(entries))
                part, _ = completion_logprobs(out.prompt_token_ids, entries, body.logprobs,
                                              self.text, 0)
                parts.append(part)
                state.offset = len(prefix)
            ids, entries = new_entries(c, delta)
            part, state.offset = completion_logprobs(ids, entries, body.logprobs, self.text,
                                                     state.offset)
            parts.append(part)
            choice["logprobs"] = {key: [v for p in parts for v in p[key]] for key in parts[0]}
        if body.prompt_logprobs is not None and first:
            choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
        return choice

