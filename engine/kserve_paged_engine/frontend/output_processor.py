"""Requests out: each live request's state beyond what the scheduler keeps (its detokenizer,
generator, logprobs, timings), and the `RequestOutput`s built from it after every step.

Outputs are copies: they cross to the event loop's thread while the engine keeps going. The
samples of an n > 1 request are folded back into one output per request here
(engine/kserve_paged_engine/frontend/forks.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from kserve_paged_engine.core.request import Request
from kserve_paged_engine.frontend.beam_search import BeamSearch
from kserve_paged_engine.frontend.detokenizer import IncrementalDetokenizer
from kserve_paged_engine.frontend.forks import Forks
from kserve_paged_engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kserve_paged_engine.sample.sampler import make_generator


@dataclass(slots=True)
class RequestState:
    """Engine-side state of a live request beyond what the scheduler keeps."""

    request: Request
    prompt: str | None
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    sent_tokens: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: dict[int, dict[int, Logprob]] = field(default_factory=dict)
    pooled: torch.Tensor | None = None  # a pooling request's result, once its prompt is done


class OutputProcessor:
    def __init__(self, tokenizer: Any, groups: Forks) -> None:
        self.tokenizer = tokenizer
        self.groups = groups
        self.live: dict[str, RequestState] = {}

    def track(self, request: Request, prompt: str | None) -> None:
        """Start keeping a newly queued request's state."""
        params = request.sampling_params
        self.live[request.request_id] = RequestState(
            request, prompt,
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params),
            make_generator(params.seed), metrics=RequestMetrics(request.arrival_time))

    def track_fork(self, child: Request, parent: Request) -> None:
        """A sample forked from `parent` before any output: its timings and prompt logprobs so
        far, a detokenizer and generator of its own."""
        src = self.live[parent.request_id]
        params = child.sampling_params
        self.live[child.request_id] = RequestState(
            child, src.prompt,
            IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, params),
            make_generator(params.seed), metrics=dataclasses.replace(src.metrics),
            prompt_logprobs=dict(src.prompt_logprobs))

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.live.pop(rid, None)

    def mark_scheduled(self, scheduled: Iterable[Request], now: float) -> int:
        """Record first scheduling; returns the prompt tokens of requests scheduled first now
        (a fork or a beam counts under the request the user sent)."""
        prompt_tokens = 0
        for req in scheduled:
            state = self.live.get(req.request_id) or self.live[req.group_id]
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
                prompt_tokens += req.num_prompt_tokens
        return prompt_tokens

    def observe_token(self, req: Request, ended_by_token: bool) -> str | None:
        """The scheduler's stop-string check: feed the new token to the request's detokenizer
        and say which stop string, if any, its text now ends in."""
        detok = self.live[req.request_id].detok
        detok.update([req.output_token_ids[-1]], stop_terminated=ended_by_token,
                     check_stop=req.past_min_tokens)
        return detok.stop_reason if detok.stopped else None

    def step_outputs(self, sampling: list[Request], sampled: dict[str, int],
                     ended: list[Request], now: float) -> list[RequestOutput]:
        """Outputs of the requests that got a token this step, then of those that ended
        without one (max_tokens=0, once the prompt is scored)."""
        outputs = []
        for req in sampling:
            if req.request_id not in sampled:
                continue
            state = self.live[req.request_id]
            m = state.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            outputs.append(self.make_output(state, now))
        outputs.extend(self.make_output(self.live[r.request_id], now) for r in ended
                       if r.request_id not in sampled and r.request_id in self.live)
        return outputs

    def make_output(self, state: RequestState, now: float) -> RequestOutput:
        req = state.request
        finished = req.is_finished
        delta_ids = req.output_token_ids[state.sent_tokens:]
        state.sent_tokens = req.num_output_tokens
        if finished:
            state.metrics.finished_time = now
            del self.live[req.request_id]
        completion = CompletionOutput(
            index=0, text=state.detok.output_text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            delta_text=state.detok.get_delta(finished), delta_token_ids=delta_ids)
        if req.sampling_params.logprobs is not None:
            completion.logprobs = list(state.logprobs)
            completion.cumulative_logprob = state.cumulative_logprob
        out = RequestOutput(req.request_id, state.prompt, req.prompt_token_ids, [completion],
                            finished, max(req.num_cached_tokens, 0),
                            dataclasses.replace(state.metrics), pooled=state.pooled)
        if req.sampling_params.prompt_logprobs is not None:
            # vLLM's shape: None for the first prompt token, then one dict per token.
            out.prompt_logprobs = [None] + [state.prompt_logprobs.get(p)
                                            for p in range(1, req.num_prompt_tokens)]
        return out

    def beam_output(self, group: BeamSearch, now: float) -> RequestOutput:
        """The final output of a beam search: the n best hypotheses, best first."""
        state = self.live.pop(group.group_id)
        state.metrics.first_token_time = state.metrics.first_token_time or now
        state.metrics.last_token_time = state.metrics.finished_time = now
        params = group.params
        completions = []
        for i, h in enumerate(group.finished[:params.n]):
            text = self.tokenizer.decode(h.token_ids,
                                         skip_special_tokens=params.skip_special_tokens)
            completions.append(CompletionOutput(
                index=i, text=text, token_ids=h.token_ids, finish_reason=h.finish_reason,
                delta_text=text, delta_token_ids=list(h.token_ids),
                cumulative_logprob=h.cum_logprob, score=h.score))
        req = state.request
        return RequestOutput(group.group_id, state.prompt, req.prompt_token_ids, completions,
                             True, max(req.num_cached_tokens, 0),
                             dataclasses.replace(state.metrics))

    def error_outputs(self, request_ids: list[str], message: str,
                      status: int | None = None) -> list[RequestOutput]:
        """The last outputs of requests that failed (already finished in the scheduler); the
        samples of theirs not forked yet end with them (their group waits for every one)."""
        now = time.monotonic()
        outputs = []
        for rid in request_ids:
            state = self.live.get(rid)
            if state is None:
                continue
            out = self.make_output(state, now)
            out.error, out.error_status = message, status
            outputs.append(out)
            for child_id, _ in self.groups.take_pending(rid):
                outputs.append(RequestOutput(
                    child_id, out.prompt, out.prompt_token_ids,
                    [CompletionOutput(0, "", [], finish_reason="error")], True, error=message,
                    error_status=status))
        return outputs

    def merge(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """One output per request the user sent (n > 1 samples folded together)."""
        return self.groups.merge(outputs)
