"""What the sampling side keeps per request: its random generator and the logprobs it has
gathered (of each sampled token, and of its prompt tokens).

The sample stage (engine/kserve_paged_engine/frontend/sample_stage.py) owns it: a request's
state is made when it is added or forked, written by the stage and the speculative decoder's
verification (through the stage), read by the output processor through `logprobs` /
`prompt_logprobs`, and dropped when the request ends (`forget`), so no other module keeps or
reaches into it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kserve_paged_engine.core.request import Request
from kserve_paged_engine.outputs import Logprob
from kserve_paged_engine.sample.sampler import make_generator


@dataclass(slots=True)
class SamplingState:
    generator: torch.Generator | None  # its own (a seed), or None: the sampler's shared one
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: dict[int, dict[int, Logprob]] = field(default_factory=dict)


class SamplingStates:
    """Every live request's sampling state, by request id."""

    def __init__(self, shared: torch.Generator) -> None:
        self.shared = shared
        self._states: dict[str, SamplingState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def add(self, request: Request) -> None:
        self._states[request.request_id] = SamplingState(
            make_generator(request.sampling_params.seed))

    def fork(self, child: Request, parent: Request) -> None:
        """A sample forked before any output: its own generator (its own seed), the prompt
        logprobs the parent has so far."""
        self._states[child.request_id] = SamplingState(
            make_generator(child.sampling_params.seed),
            prompt_logprobs=dict(self._states[parent.request_id].prompt_logprobs))

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._states.pop(rid, None)

    def generator_of(self, request: Request) -> torch.Generator:
        """The request's own generator, or the shared one (no seed)."""
        state = self._states.get(request.request_id)
        return state.generator if state is not None and state.generator is not None \
            else self.shared

    def own_generators(self, requests: Iterable[Request]) -> list[torch.Generator | None]:
        """Each request's own generator (None: it draws from the shared one)."""
        return [self._states[r.request_id].generator for r in requests]

    def prompt_kept(self, request: Request) -> dict[int, dict[int, Logprob]]:
        """Where the prompt logprobs of `request` are kept (written by sample/logprobs.py)."""
        return self._states[request.request_id].prompt_logprobs

    def record(self, request: Request, entry: dict[int, Logprob], chosen: float) -> None:
        """One sampled token's logprobs entry."""
        state = self._states[request.request_id]
        state.logprobs.append(entry)
        state.cumulative_logprob += chosen

    def logprobs(self, request_id: str) -> tuple[list[dict[int, Logprob]], float]:
        """(a copy of the sampled tokens' entries, their cumulative logprob)."""
        state = self._states.get(request_id)
        return ([], 0.0) if state is None else (list(state.logprobs), state.cumulative_logprob)

    def prompt_logprobs(self, request_id: str) -> dict[int, dict[int, Logprob]]:
        state = self._states.get(request_id)
        return {} if state is None else state.prompt_logprobs
