"""`--speculative_config`: vLLM's JSON (`method`, `num_speculative_tokens`, prompt lookup)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram",)
# vLLM's default n-gram window when neither bound is given.
DEFAULT_LOOKUP = 5
# vLLM's keys that change nothing here (no separate draft workers, no batch-size switch).
VLLM_IGNORED_KEYS = frozenset({"disable_log_stats", "disable_logprobs", "disable_by_batch_size",
                               "draft_tensor_parallel_size"})


@dataclass(slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int | None = None  # required, as in vLLM
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS} "
                             f"(got {self.method!r}; draft_model is not built yet)")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens (required) must be an "
                             f"integer >= 1 (got {k!r})")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = DEFAULT_LOOKUP
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1 "
                                 f"(got {v!r})")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= "
                             f"prompt_lookup_max ({hi})")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> SpeculativeConfig:
        """Parse the flag's JSON object; unknown keys are refused, a few of vLLM's ignored."""
        try:
            data = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("speculative_config must be a JSON object")
        for key in VLLM_IGNORED_KEYS:
            data.pop(key, None)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} "
                             f"(known: {sorted(known)})")
        return cls(**data)
