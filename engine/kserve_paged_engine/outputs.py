"""What the engine hands back: per-request outputs, shaped like vLLM's so users feel at home."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One dict per generated token: the chosen token and the requested top tokens.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # cumulative
    token_ids: list[int]  # cumulative
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # What this step added, for streaming.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    # Only when SamplingParams.logprobs is set (cumulative, like token_ids).
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    # Beam search only: cumulative_logprob / length ** length_penalty (the beam's rank).
    score: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when finish_reason is "error"
    # The HTTP status the error is (400: the request's own input, e.g. its grammar; 408: its
    # deadline passed); None: a server fault (500).
    error_status: int | None = None
    # Only when SamplingParams.prompt_logprobs is set: None for the first prompt token.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # A pooling request's result (float32, CPU): its embedding, or its classification logits
    # (engine/kserve_paged_engine/frontend/pooling.py); None for generation.
    pooled: torch.Tensor | None = None
