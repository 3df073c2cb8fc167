"""Requests out: what each live request needs for its outputs beyond what the scheduler keeps
(its prompt text, its incremental detokenizer, how much was sent, its token times), and the
`RequestOutput`s built from it after every step.

The detokenizer is fed by the step's stop check (`detokenize`, engine/kserve_paged_engine/frontend/stop_check.py),
which asks it for stop strings; the logprobs are the sample stage's (read through
`SamplingStates`); arrival and first-schedule times are the request's own
(engine/kserve_paged_engine/core/request.py). Outputs are copies: they cross to the event loop's thread while the
engine keeps going. The samples of an n > 1 request are folded back into one output per
request here (engine/kserve_paged_engine/frontend/forks.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from kserve_paged_engine.core.request import Request
from kserve_paged_engine.frontend.beam_search import BeamSearch
from kserve_paged_engine.frontend.detokenizer import IncrementalDetokenizer
from kserve_paged_engine.frontend.forks import Forks
from kserve_paged_engine.frontend.sample_stage import SamplingStates
from kserve_paged_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass(slots=True)
class RequestState:
    """What the outputs of a live request are built from, beyond the request itself."""

    request: Request
    prompt: str | None
    detok: IncrementalDetokenizer
    sent_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None

    def metrics(self, finished_time: float | None) -> RequestMetrics:
        req = self.request
        return RequestMetrics(req.arrival_time, req.first_scheduled_time,
                              self.first_token_time, self.last_token_time, finished_time)


class OutputProcessor:
    def __init__(self, tokenizer: Any, forks: Forks, sampling: SamplingStates) -> None:
        self.tokenizer = tokenizer
        self.forks = forks
        self.sampling = sampling  # read only: each request's logprobs
        self._live: dict[str, RequestState] = {}

    def track(self, request: Request, prompt: str | None) -> None:
        """Start keeping a newly queued request's state."""
        self._live[request.request_id] = RequestState(
            request, prompt,
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                   request.sampling_params))

    def track_forks(self, forked: Iterable[tuple[Request, Request]]) -> None:
        """Samples forked from their parent (child, parent) before any output: the parent's
        prompt text, a detokenizer of their own."""
        for child, parent in forked:
            self._live[child.request_id] = RequestState(
                child, self._live[parent.request_id].prompt,
                IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids,
                                       child.sampling_params))

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._live.pop(rid, None)

    def detokenize(self, request_id: str, token: int, ended_by_token: bool,
                   check_stop: bool) -> str | None:
        """The stop check's question: add the request's new token to its text and say which
        stop string, if any, the text now ends in (`ended_by_token`: EOS or a stop token ends
        it, whose text is left out; `check_stop`: past min_tokens)."""
        detok = self._live[request_id].detok
        detok.update([token], stop_terminated=ended_by_token, check_stop=check_stop)
        return detok.stop_reason if detok.stopped else None

    def step_outputs(self, sampling: list[Request], sampled: dict[str, int],
                     ended: list[Request], now: float,
                     pooled: dict[str, torch.Tensor] | None = None) -> list[RequestOutput]:
        """Outputs of the requests that got a token this step, then of those that ended
        without one (max_tokens=0, once the prompt is scored; a pooling request with its
        result from `pooled`, the pooling stage's)."""
        outputs = []
        for req in sampling:
            if req.request_id not in sampled:
                continue
            state = self._live[req.request_id]
            if state.first_token_time is None:
                state.first_token_time = now
            state.last_token_time = now
            outputs.append(self.make_output(state, now))
        outputs.extend(self.make_output(self._live[r.request_id], now,
                                        (pooled or {}).get(r.request_id)) for r in ended
                       if r.request_id not in sampled and r.request_id in self._live)
        return outputs

    def make_output(self, state: RequestState, now: float,
                    pooled: torch.Tensor | None = None) -> RequestOutput:
        req = state.request
        finished = req.is_finished
        delta_ids = req.output_token_ids[state.sent_tokens:]
        state.sent_tokens = req.num_output_tokens
        if finished:
            del self._live[req.request_id]
        completion = CompletionOutput(
            index=0, text=state.detok.output_text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            delta_text=state.detok.get_delta(finished), delta_token_ids=delta_ids)
        params = req.sampling_params
        if params.logprobs is not None:
            completion.logprobs, completion.cumulative_logprob = self.sampling.logprobs(
                req.request_id)
        out = RequestOutput(req.request_id, state.prompt, req.prompt_token_ids, [completion],
                            finished, max(req.num_cached_tokens, 0),
                            state.metrics(now if finished else None), pooled=pooled)
        if params.prompt_logprobs is not None:
            # vLLM's shape: None for the first prompt token, then one dict per token.
            kept = self.sampling.prompt_logprobs(req.request_id)
            out.prompt_logprobs = [None] + [kept.get(p) for p in range(1, req.num_prompt_tokens)]
        return out

    def beam_output(self, search: BeamSearch, now: float) -> RequestOutput:
        """The final output of a beam search: the n best hypotheses, best first."""
        state = self._live.pop(search.fork_root)
        state.first_token_time = state.first_token_time or now
        state.last_token_time = now
        params = search.params
        completions = []
        for i, h in enumerate(search.finished[:params.n]):
            text = self.tokenizer.decode(h.token_ids,
                                         skip_special_tokens=params.skip_special_tokens)
            completions.append(CompletionOutput(
                index=i, text=text, token_ids=h.token_ids, finish_reason=h.finish_reason,
                delta_text=text, delta_token_ids=list(h.token_ids),
                cumulative_logprob=h.cum_logprob, score=h.score))
        req = state.request
        return RequestOutput(search.fork_root, state.prompt, req.prompt_token_ids, completions,
                             True, max(req.num_cached_tokens, 0), state.metrics(now))

    def error_outputs(self, request_ids: list[str], message: str,
                      status: int | None = None) -> list[RequestOutput]:
        """The last outputs of requests that failed (already finished in the scheduler); the
        samples of theirs not forked yet end with them (their request waits for every one)."""
        now = time.monotonic()
        outputs = []
        for rid in request_ids:
            state = self._live.get(rid)
            if state is None:
                continue
            out = self.make_output(state, now)
            out.error, out.error_status = message, status
            outputs.append(out)
            for child_id, _ in self.forks.take_pending(rid) if self.forks.pending else ():
                outputs.append(RequestOutput(
                    child_id, out.prompt, out.prompt_token_ids,
                    [CompletionOutput(0, "", [], finish_reason="error")], True, error=message,
                    error_status=status))
        return outputs
