"""Per-request sampling options, validated when made so bad input fails before it is queued."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine import limits as L
from engine.sample.structured_output import StructuredOutputs


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
    # Holds the output to a JSON schema, regex, choice or grammar (engine/structured_output.py);
    # a dict is taken as StructuredOutputs' fields.
    structured_outputs: StructuredOutputs | None = None
    # Beam search (engine/beam_search.py): `best_of` beams (default n), the n best returned;
    # length_penalty and early_stopping (True, False or "never") as transformers defines them.
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
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
        def bad(msg: str) -> ValueError:
            return ValueError(f"invalid sampling parameter: {msg}")

        if (not isinstance(self.n, int) or isinstance(self.n, bool)
                or not L.MIN_N <= self.n <= L.MAX_N):
            raise bad(f"n must be an integer from {L.MIN_N} to {L.MAX_N} (got {self.n!r})")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or isinstance(self.max_tokens, bool)
                                            or self.max_tokens < L.MIN_MAX_TOKENS):
            raise bad(f"max_tokens must be an integer >= {L.MIN_MAX_TOKENS} "
                      f"(got {self.max_tokens!r})")
        if not isinstance(self.min_tokens, int) or self.min_tokens < L.MIN_MIN_TOKENS:
            raise bad(f"min_tokens must be an integer >= {L.MIN_MIN_TOKENS} "
                      f"(got {self.min_tokens!r})")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise bad(f"{name} must be a finite number (got {value!r})")
        if self.temperature < L.MIN_TEMPERATURE:
            raise bad(f"temperature must be >= {L.MIN_TEMPERATURE:g} (got {self.temperature})")
        low, high = L.TOP_P_RANGE
        if not low < self.top_p <= high:
            raise bad(f"top_p must be in ({low:g}, {high:g}] (got {self.top_p})")
        low, high = L.MIN_P_RANGE
        if not low <= self.min_p <= high:
            raise bad(f"min_p must be in [{low:g}, {high:g}] (got {self.min_p})")
        # -1 (off) became 0 in __post_init__
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise bad(f"top_k must be -1, 0 (off) or a positive integer (got {self.top_k!r})")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad(f"seed must be an integer (got {self.seed!r})")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad(f"stop strings must be non-empty strings (got {s!r})")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise bad(f"stop_token_ids must be non-negative integers (got {t!r})")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise bad(f"{name} must be a finite number (got {value!r})")
        low, high = L.PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not low <= value <= high:
                raise bad(f"{name} must be in [{low:g}, {high:g}] (got {value})")
        low, high = L.REPETITION_PENALTY_RANGE
        if not low < self.repetition_penalty <= high:
            raise bad(f"repetition_penalty must be in ({low:g}, {high:g}] "
                      f"(got {self.repetition_penalty})")
        low, high = L.LOGIT_BIAS_RANGE
        for token, bias in (self.logit_bias or {}).items():
            if token < 0:
                raise bad(f"logit_bias token ids must be non-negative (got {token})")
            if not math.isfinite(bias) or not low <= bias <= high:
                raise bad(f"logit_bias values must be in [{low:g}, {high:g}] "
                          f"(got {bias} for {token})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not L.MIN_LOGPROBS <= value <= L.MAX_LOGPROBS):
                raise bad(f"{name} must be an integer from {L.MIN_LOGPROBS} to "
                          f"{L.MAX_LOGPROBS} (got {value!r})")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise bad("structured_outputs must be a StructuredOutputs or a dict of its fields")
            # The grammar ends the output with EOS: without it, or with EOS banned, a
            # completed grammar would leave no token to sample.
            if self.ignore_eos:
                raise bad("ignore_eos cannot be combined with structured outputs")
            if self.min_tokens:
                raise bad("min_tokens cannot be combined with structured outputs")
        self._validate_beam_search(bad)

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
            ("logit_bias", None), ("structured_outputs", None)) if getattr(self, name) != off]
        if unsupported:
            raise bad(f"{', '.join(unsupported)} cannot be combined with use_beam_search")

    @property
    def beam_width(self) -> int:
        return self.best_of if self.best_of is not None else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_logits_processing(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias)
