"""The step's stop check: which requests end with the tokens this step gives them, and why.

It runs between sampling and the scheduler's update, as its own stage of `LLMEngine.step`, so
the scheduler never calls back into the front: it is told what each request appends and how it
ends (`Appended`, engine/kserve_paged_engine/core/scheduler_output.py) and only updates its state. A
request's tokens are checked one by one, in vLLM's order: a stop string (the detokenizer's,
which holds back text that may still become one) wins over the token that ended the request,
EOS or a stop token id over length; none of the first three before `min_tokens` outputs. A
speculating request's verified tokens are checked between one another, so it ends where a
plain decode would have; a request that samples nothing (max_tokens=0, pooling) ends once its
prompt is computed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import chain
from typing import Protocol

from kserve_paged_engine.core.request import Request, RequestStatus
from kserve_paged_engine.core.scheduler_output import Appended, SchedulerOutput
from kserve_paged_engine.limits import past_min_tokens


def token_end(request: Request, token: int) -> tuple[RequestStatus, int | None] | None:
    """EOS (unless ignore_eos) or a stop token id ends the request, once past its min_tokens
    (StopCheck checks that: `kserve_paged_engine.limits.past_min_tokens`)."""
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


class StopTexts(Protocol):
    """Where the text of a request's tokens is made (the output processor's detokenizers)."""

    def detokenize(self, request_id: str, token: int, ended_by_token: bool,
                   check_stop: bool) -> str | None:
        """Add `token` to the text; the stop string the text now ends in, if any."""
        ...


class StopCheck:
    def __init__(self, max_model_len: int, texts: StopTexts | None = None) -> None:
        """`texts` None: no stop strings (a scheduler driven without a front, as tests do)."""
        self.max_model_len = max_model_len
        self.texts = texts

    def check(self, out: SchedulerOutput, sampled: Mapping[str, int],
              verified: Mapping[str, list[int]] | None = None,
              forked: Iterable[Request] = ()) -> dict[str, Appended]:
        """What each running request of the step appends and whether it ends: its sampled
        token, then (with drafts) its verified ones; `forked` are the samples forked in the
        step, checked after it."""
        ends: dict[str, Appended] = {}
        for request in chain(out.scheduled, forked):
            rid = request.request_id
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            token = sampled.get(rid)
            if token is None:
                num = out.num_scheduled_tokens.get(rid, 0)
                if not request.wants_token and request.num_computed_tokens + num >= (
                        request.num_tokens):
                    ends[rid] = Appended([], request.prompt_done_status)  # scored or pooled
                continue
            drafts = out.spec_tokens.get(rid)
            more = (verified or {}).get(rid, []) if drafts else []
            ends[rid] = self._tokens(request, [token, *more])
            if drafts:
                ends[rid].rejected_drafts = len(drafts) - len(more)
        return ends

    def _tokens(self, request: Request, tokens: list[int]) -> Appended:
        """The tokens appended one by one, each checked before the next."""
        done, min_tokens = request.num_output_tokens, request.sampling_params.min_tokens
        for j, token in enumerate(tokens):
            num_output = done + j + 1
            past_min = past_min_tokens(num_output, min_tokens)
            by_token = token_end(request, token) if past_min else None
            text = None if self.texts is None else self.texts.detokenize(
                request.request_id, token, by_token is not None, past_min)
            end = ((RequestStatus.FINISHED_STOPPED, text) if text is not None
                   else by_token or length_end(request, num_output, self.max_model_len))
            if end is not None:
                return Appended(tokens[:j + 1], *end)
        return Appended(tokens)
