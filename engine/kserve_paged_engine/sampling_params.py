"""Per-request sampling options, validated when made so bad input fails before it is queued."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

from kserve_paged_engine import limits as L
from kserve_paged_engine.output_constraints import StructuredOutputs


class SharedPrepared:
    """What every copy of one request's SamplingParams shares (copy.copy keeps the reference:
    its n samples, the prompts of one server request): the forms its client lists are
    prepared into, made once per request by the layer that uses them
    (engine/kserve_paged_engine/sample/token_filters.py), keyed by what they were made for."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: dict[Any, Any] = {}


def _token_ids_ok(ids: list[Any]) -> bool:
    """Every element a non-negative int (bool excluded), in C-speed passes: a list may hold
    as many ids as the server's cap allows."""
    return not ids or (set(map(type, ids)) == {int} and min(ids) >= 0)


def _bad(msg: str) -> ValueError:
    return ValueError(f"invalid sampling parameter: {msg}")


def _finite(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise _bad(f"{name} must be a finite number (got {value!r})")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # top log-probabilities to return per generated token
    # Top log-probabilities of each prompt token (given the tokens before it). Such a request
    # computes its whole prompt: cached positions have no logits.
    prompt_logprobs: int | None = None
    # Holds the output to a JSON schema, regex, choice or grammar (StructuredOutputs above;
    # compiled and enforced by engine/kserve_paged_engine/sample/structured_output.py); a dict is taken as its
    # fields.
    structured_outputs: StructuredOutputs | None = None
    # Beam search (engine/kserve_paged_engine/frontend/beam_search.py): `best_of` beams (default n), the n best returned;
    # length_penalty and early_stopping (True, False or "never") as transformers defines them.
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # vLLM's token filters: only `allowed_token_ids` may be sampled; no word of `bad_words` is
    # ever completed (the input processor finds each word's token sequences with the model's
    # tokenizer, into `bad_words_token_ids`: engine/kserve_paged_engine/sample/logits_processors.py).
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Keep only the prompt's last k tokens (-1: the context window), cut by the input processor.
    truncate_prompt_tokens: int | None = None
    shared: SharedPrepared = field(default_factory=SharedPrepared, init=False, repr=False,
                                   compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(
            self.bad_words or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as exc:
                raise ValueError(f"invalid sampling parameter: logit_bias must map token ids "
                                 f"to numbers ({exc})") from None
        else:
            self.logit_bias = None
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputs(**self.structured_outputs)
            except TypeError as exc:
                raise ValueError(f"invalid sampling parameter: structured_outputs: {exc}") from None
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first bad option, checked in this order."""
        self._validate_lengths()
        self._validate_sampling()
        self._validate_stops_and_penalties()
        self._validate_outputs()
        self._validate_filters()
        self._validate_beam_search(_bad)

    def _validate_filters(self) -> None:
        ids = self.allowed_token_ids
        if ids is not None:
            if not ids:
                raise _bad("allowed_token_ids must not be empty (nothing could be sampled)")
            for t in () if _token_ids_ok(ids) else ids:
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    raise _bad(f"allowed_token_ids must be non-negative integers (got {t!r})")
        for w in self.bad_words:
            if not isinstance(w, str) or not w.strip():
                raise _bad(f"bad_words must be non-empty strings (got {w!r})")
        chars = sum(map(len, self.bad_words))
        if chars > L.MAX_BAD_WORDS_CHARS:
            raise _bad(f"bad_words hold {chars} characters in all, more than "
                       f"{L.MAX_BAD_WORDS_CHARS}")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool)
                              or (k < 1 and k != -1)):
            raise _bad(f"truncate_prompt_tokens must be -1 (the context window) or an integer "
                       f">= 1 (got {k!r})")

    def _validate_lengths(self) -> None:
        if (not isinstance(self.n, int) or isinstance(self.n, bool)
                or not L.MIN_N <= self.n <= L.MAX_N):
            raise _bad(f"n must be an integer from {L.MIN_N} to {L.MAX_N} (got {self.n!r})")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or isinstance(self.max_tokens, bool)
                                            or self.max_tokens < L.MIN_MAX_TOKENS):
            raise _bad(f"max_tokens must be an integer >= {L.MIN_MAX_TOKENS} "
                       f"(got {self.max_tokens!r})")
        if not isinstance(self.min_tokens, int) or self.min_tokens < L.MIN_MIN_TOKENS:
            raise _bad(f"min_tokens must be an integer >= {L.MIN_MIN_TOKENS} "
                       f"(got {self.min_tokens!r})")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                       f"({self.max_tokens})")

    def _validate_sampling(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            _finite(name, getattr(self, name))
        if self.temperature < L.MIN_TEMPERATURE:
            raise _bad(f"temperature must be >= {L.MIN_TEMPERATURE:g} (got {self.temperature})")
        low, high = L.TOP_P_RANGE
        if not low < self.top_p <= high:
            raise _bad(f"top_p must be in ({low:g}, {high:g}] (got {self.top_p})")
        low, high = L.MIN_P_RANGE
        if not low <= self.min_p <= high:
            raise _bad(f"min_p must be in [{low:g}, {high:g}] (got {self.min_p})")
        # -1 (off) became 0 in __post_init__
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise _bad(f"top_k must be -1, 0 (off) or a positive integer (got {self.top_k!r})")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise _bad(f"seed must be an integer (got {self.seed!r})")

    def _validate_stops_and_penalties(self) -> None:
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _bad(f"stop strings must be non-empty strings (got {s!r})")
        for t in () if _token_ids_ok(self.stop_token_ids) else self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise _bad(f"stop_token_ids must be non-negative integers (got {t!r})")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            _finite(name, getattr(self, name))
        low, high = L.PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not low <= value <= high:
                raise _bad(f"{name} must be in [{low:g}, {high:g}] (got {value})")
        low, high = L.REPETITION_PENALTY_RANGE
        if not low < self.repetition_penalty <= high:
            raise _bad(f"repetition_penalty must be in ({low:g}, {high:g}] "
                       f"(got {self.repetition_penalty})")
        low, high = L.LOGIT_BIAS_RANGE
        for token, bias in (self.logit_bias or {}).items():
            if token < 0:
                raise _bad(f"logit_bias token ids must be non-negative (got {token})")
            if not math.isfinite(bias) or not low <= bias <= high:
                raise _bad(f"logit_bias values must be in [{low:g}, {high:g}] "
                           f"(got {bias} for {token})")

    def _validate_outputs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not L.MIN_LOGPROBS <= value <= L.MAX_LOGPROBS):
                raise _bad(f"{name} must be an integer from {L.MIN_LOGPROBS} to "
                           f"{L.MAX_LOGPROBS} (got {value!r})")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise _bad("structured_outputs must be a StructuredOutputs or a dict of its "
                           "fields")
            # The grammar ends the output with EOS: without it, or with EOS banned, a
            # completed grammar would leave no token to sample.
            if self.ignore_eos:
                raise _bad("ignore_eos cannot be combined with structured outputs")
            if self.min_tokens:
                raise _bad("min_tokens cannot be combined with structured outputs")

    def _validate_beam_search(self, bad) -> None:
        b = self.best_of
        if b is not None and (not isinstance(b, int) or isinstance(b, bool)
                              or not L.MIN_N <= b <= L.MAX_N):
            raise bad(f"best_of must be an integer from {L.MIN_N} to {L.MAX_N} (got {b!r})")
        if not self.use_beam_search:
            if b is not None and b != self.n:
                raise bad(f"best_of ({b}) other than n ({self.n}) needs use_beam_search "
                          "(every sample is returned)")
            return
        if self.beam_width < self.n:
            raise bad(f"best_of (the beam width, {self.beam_width}) must be >= n ({self.n})")
        lp = self.length_penalty
        if not isinstance(lp, (int, float)) or isinstance(lp, bool) or not math.isfinite(lp):
            raise bad(f"length_penalty must be a finite number (got {lp!r})")
        if self.early_stopping not in (True, False, "never"):
            raise bad(f"early_stopping must be true, false or \"never\" "
                      f"(got {self.early_stopping!r})")
        unsupported = [name for name, off in (
            ("stop", []), ("logprobs", None), ("prompt_logprobs", None), ("min_tokens", 0),
            ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
            ("logit_bias", None), ("structured_outputs", None), ("allowed_token_ids", None),
            ("bad_words", [])) if getattr(self, name) != off]
        if unsupported:
            raise bad(f"{', '.join(unsupported)} cannot be combined with use_beam_search")

    def with_max_tokens(self, max_tokens: int | None) -> SamplingParams:
        """A copy with this output budget, checked (ValueError). It shares this one's lists
        and `shared`, so the copies made for a request's prompts are prepared once."""
        params = copy.copy(self)
        params.max_tokens = max_tokens
        params._validate_lengths()
        return params

    @property
    def beam_width(self) -> int:
        return self.best_of if self.best_of is not None else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_logits_processing(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias
                    or self.allowed_token_ids is not None or self.bad_words_token_ids)
