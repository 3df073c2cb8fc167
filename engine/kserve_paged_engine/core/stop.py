"""Why a request ends with a token it appends: the token and length rules, and what the stop
check hands the scheduler.

The stop check is its own stage of the step (engine/kserve_paged_engine/frontend/stop_check.py):
it runs these rules and the stop strings (the detokenizer's) token by token, before the
scheduler hears of the step; the scheduler is told what each request appends and how it ends,
and only updates its state (Scheduler.update_from_output).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kserve_paged_engine.core.request import Request, RequestStatus


@dataclass(slots=True)
class Appended:
    """What one request appends in a step, as the stop check decided: its tokens in order, cut
    after the one that ends it; how it ends (None: it goes on) and why (the stop string or stop
    token id); and how many of its drafts the target rejected (their slots roll back)."""

    tokens: list[int] = field(default_factory=list)
    status: RequestStatus | None = None
    stop_reason: int | str | None = None
    rejected_drafts: int = 0


def token_end(request: Request, token: int) -> tuple[RequestStatus, int | None] | None:
    """EOS (unless ignore_eos) or a stop token id ends the request, once past its min_tokens
    (the caller checks that: `kserve_paged_engine.limits.past_min_tokens`)."""
    params = request.sampling_params
    if not params.ignore_eos and request.eos_token_id is not None and (
            token == request.eos_token_id):
        return RequestStatus.FINISHED_STOPPED, None
    if token in params.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED, token
    return None


def length_end(request: Request, num_output: int, max_model_len: int
               ) -> tuple[RequestStatus, None] | None:
    """`max_tokens` outputs, or the model's length limit, ends the request ("length")."""
    if num_output >= request.max_tokens or (
            request.num_prompt_tokens + num_output >= max_model_len):
        return RequestStatus.FINISHED_LENGTH, None
    return None
