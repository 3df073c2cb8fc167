"""`--speculative_config`: vLLM's JSON (`method`, `num_speculative_tokens`, prompt lookup,
the draft `model`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
# A draft model runs one decode pass per draft token: past this, a step is mostly drafting.
MAX_DRAFT_MODEL_TOKENS = 16
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
    model: str | None = None  # draft_model: a local folder of the target's vocabulary

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS} "
                             f"(got {self.method!r})")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens (required) must be an "
                             f"integer >= 1 (got {k!r})")
        if self.method == "draft_model":
            self._check_draft_model(k)
            return
        if self.model is not None:
            raise ValueError("speculative_config: 'model' is for method draft_model "
                             f"(method is {self.method!r})")
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

    def _check_draft_model(self, k: int) -> None:
        """What can be checked before loading anything; the vocabulary is checked against the
        target's when the engine loads the draft (engine/kserve_paged_engine/spec_decode/draft_model.py)."""
        if k > MAX_DRAFT_MODEL_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be <= "
                             f"{MAX_DRAFT_MODEL_TOKENS} with a draft model (got {k})")
        if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError("speculative_config: prompt_lookup_min/max are for method ngram")
        path = self.model
        if not isinstance(path, str) or not path:
            raise ValueError("speculative_config: method draft_model needs 'model', the draft "
                             "model's local folder")
        if not os.path.isfile(os.path.join(os.path.expanduser(path), "config.json")):
            raise ValueError(f"speculative_config: draft model folder {path!r} does not exist "
                             "or has no config.json")

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
        if "method" not in data and "model" in data:  # vLLM's older spelling: model alone
            data["method"] = "ngram" if data["model"] in ("ngram", "[ngram]") else "draft_model"
        if data.get("method") == "ngram" and data.get("model") in ("ngram", "[ngram]"):
            data.pop("model")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} "
                             f"(known: {sorted(known)})")
        return cls(**data)
