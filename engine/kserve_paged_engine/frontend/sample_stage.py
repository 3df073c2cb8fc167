"""The step's sample stage: every row of a step's logits to the tokens it appends, and what
the sampling side keeps per request (its generator and the logprobs it gathered).

Rows are routed first: a request with drafts has 1 + drafts verification rows
(engine/kserve_paged_engine/spec_decode/); a beam only reports its row to its search (engine/kserve_paged_engine/frontend/beam_search.py); every
other request samples, and an n > 1 request whose prompt this step computed forks its other
samples now, each sampling from the same row with its own generator. Sampling rows then take
penalties and logit bias, the structured-output masks, and the sampler; logprobs are of the raw
model logits, as vLLM returns them. Each of those stages is entered only when some row needs
it.

The stage owns each request's `SamplingState`: made when the request is added or forked,
written by the stage and the speculative decoder's verification (through the stage), read by
the output processor through `SamplingStates.logprobs` / `prompt_logprobs`, and dropped when
the request ends (`forget`), so no other module keeps or reaches into it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from kserve_paged_engine.core.request import Request
from kserve_paged_engine.core.scheduler import Scheduler
from kserve_paged_engine.core.scheduler_output import Appended, SchedulerOutput
from kserve_paged_engine.frontend.beam_search import BeamSearch, BeamSearches
from kserve_paged_engine.frontend.forks import Forks
from kserve_paged_engine.model_executor.host_io import ReadBack, upload
from kserve_paged_engine.outputs import Logprob
from kserve_paged_engine.sample.logits_processors import apply_penalties
from kserve_paged_engine.sample.logprobs import PromptSpan, record_prompt, sampled_entries
from kserve_paged_engine.sample.sampler import Sampler, make_generator
from kserve_paged_engine.sample.structured_output import GrammarBitmask, RequestGrammar
from kserve_paged_engine.spec_decode.decoder import SpecDecoder, SpecRow
from kserve_paged_engine.worker.model_runner import StepResult


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


@dataclass(slots=True)
class SampledStep:
    """What a step's rows gave, before the stop check and the scheduler."""

    sampling: list[Request]  # requests that sampled a row (forks included), in row order
    tokens: list[int]  # their tokens, in the same order
    spec_rows: list[SpecRow]  # requests with drafts
    verified: dict[str, list[int]]  # each one's tokens: kept drafts, then one more
    forked: list[Request]  # n > 1 samples forked in this step (not in its schedule)
    beam_searches: list[BeamSearch] = field(default_factory=list)  # searches whose beams reported
    # Each speculating request's verified tokens' logprob entries (entry, chosen logprob),
    # recorded once the stop check says how many of the tokens it keeps (record_verified).
    verified_logprobs: dict[str, list[tuple[dict[int, Logprob], float]]] = field(
        default_factory=dict)


class SamplingPipeline:
    def __init__(self, sampler: Sampler, bitmask: GrammarBitmask, spec: SpecDecoder | None,
                 scheduler: Scheduler, forks: Forks, beams: BeamSearches,
                 decode: Callable[[list[int]], str]) -> None:
        self.sampler = sampler
        self.bitmask = bitmask
        self.spec = spec
        self.scheduler = scheduler
        self.forks = forks
        self.beams = beams
        self.decode = decode
        self.read_back = ReadBack()  # the step's one host sync: the sampled ids
        # Each live request's generator and logprobs: this stage's alone (SamplingStates).
        self.states = SamplingStates(sampler.generator)

    def add(self, request: Request) -> None:
        """Start keeping a newly queued request's sampling state."""
        self.states.add(request)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the sampling state of requests that ended."""
        self.states.forget(request_ids)

    def generator_of(self, request: Request) -> torch.Generator:
        """The request's own generator, or the sampler's shared one (no seed)."""
        return self.states.generator_of(request)

    def run(self, out: SchedulerOutput, result: StepResult, forked: list[tuple[Request, Request]]
            ) -> SampledStep:
        """Route, verify and sample every row of the step's logits. n > 1 samples forked now
        (not in the step's schedule) are added to `forked` as (child, parent) as they are
        made, so a step that fails later fails them too."""
        if result.prompt_logits is not None:
            record_prompt(result.prompt_logits, [
                PromptSpan(r.prompt_token_ids, r.sampling_params.prompt_logprobs or 0, start,
                           count, self.states.prompt_kept(r))
                for r, start, count in result.prompt_spans], self.decode)
        logits = result.logits
        rows: list[int] = []
        sampling: list[Request] = []
        spec_rows: list[SpecRow] = []
        beam_searches: dict[str, BeamSearch] = {}
        beams, forks = self.beams.searches, self.forks.pending  # checked here: none, usually
        i = -1
        for r in result.sampling:
            i += 1
            if r.request_id in out.spec_tokens:
                spec_rows.append(SpecRow(r, i, out.spec_tokens[r.request_id]))
                i += len(spec_rows[-1].drafts)
                continue
            if beams and self.beams.is_beam(r.request_id):
                search = self.beams.report(r, logits[i])
                beam_searches[search.fork_root] = search
                continue
            rows.append(i)
            sampling.append(r)
            if forks:
                for child in self._fork_samples(r, out.num_scheduled_tokens[r.request_id]):
                    forked.append((child, r))
                    rows.append(i)
                    sampling.append(child)
        verified, verified_logprobs = self._verify(logits, spec_rows)
        tokens = self._sample(logits, rows, sampling)
        return SampledStep(sampling, tokens, spec_rows, verified, [c for c, _ in forked],
                           list(beam_searches.values()), verified_logprobs)

    def _sample(self, logits: torch.Tensor, rows: list[int], sampling: list[Request]
                ) -> list[int]:
        """Penalties, grammar masks, then the sampler, over the sampling rows at once; each
        request's logprobs of its token recorded. A stage no row needs is not entered."""
        if not sampling:
            return []
        if rows != list(range(len(logits))):
            logits = logits.index_select(0, upload(rows, torch.long, logits.device))
        params = [r.sampling_params for r in sampling]
        processed = logits
        if any(p.needs_logits_processing for p in params):
            processed = apply_penalties(logits, params, [r.prompt_token_ids for r in sampling],
                                        [r.output_token_ids for r in sampling])
        grammars = [r.grammar if r.grammar is not None and r.grammar.active else None
                    for r in sampling]
        if any(g is not None for g in grammars):
            processed = self.bitmask.apply(processed, grammars)
        token_tensor = self.sampler.sample(
            processed, params, self.states.own_generators(sampling),
            [r.num_output_tokens for r in sampling], [r.eos_token_id for r in sampling])
        wanted = [p.logprobs for p in params]
        if any(k is not None for k in wanted):
            for i, entry, chosen in sampled_entries(logits, token_tensor, wanted, self.decode):
                self.states.record(sampling[i], entry, chosen)
        return self.read_back.tokens(token_tensor)

    def _verify(self, logits: torch.Tensor, spec_rows: list[SpecRow]
                ) -> tuple[dict[str, list[int]], dict[str, list[tuple[dict[int, Logprob], float]]]]:
        """Each speculating request's tokens this step (kept drafts, then one more), and their
        logprob entries (when asked)."""
        if not spec_rows:
            return {}, {}
        assert self.spec is not None
        rows = self.spec.verify(logits, spec_rows,
                                [self.states.generator_of(s.request) for s in spec_rows],
                                self.decode)
        return ({s.request.request_id: v.tokens for s, v in zip(spec_rows, rows)},
                {s.request.request_id: list(v.logprobs) for s, v in zip(spec_rows, rows)
                 if v.logprobs})

    def record_verified(self, step: SampledStep, ends: Mapping[str, Appended]) -> None:
        """The logprobs of the verified tokens each speculating request keeps (as many as the
        stop check let it append), so a run cut at a stop has as many entries as tokens."""
        for spec in step.spec_rows:
            rid = spec.request.request_id
            entries = step.verified_logprobs.get(rid, [])
            kept = len(ends[rid].tokens) if rid in ends else len(entries)
            for entry, chosen in entries[:kept]:
                self.states.record(spec.request, entry, chosen)

    def _fork_samples(self, parent: Request, num_scheduled: int) -> list[Request]:
        """Fork the other samples of an n > 1 request from its first, whose prompt this step
        computed: they share all of its blocks, the partial last one until written."""
        pending = self.forks.take_pending(parent.request_id)
        if not pending:
            return []
        computed = parent.num_computed_tokens + num_scheduled
        children = []
        for child_id, params in pending:
            child = self.scheduler.fork(parent, child_id, params, num_computed=computed)
            if parent.grammar is not None:  # forked before any output: a fresh matcher
                spec = parent.sampling_params.structured_outputs
                child.grammar = RequestGrammar(parent.grammar.future,
                                               spec.start_after_token_id if spec else None)
                child.grammar.start()
            self.states.fork(child, parent)
            children.append(child)
        return children

    def accept(self, step: SampledStep) -> tuple[dict[str, int], list[Request]]:
        """The token each request appends first ({request id: token}), and the constrained
        requests whose token their grammar refused (which the mask makes impossible): their
        tokens are dropped. A speculating request's first token is its first verified one."""
        sampled = {r.request_id: t for r, t in zip(step.sampling, step.tokens)}
        rejected = []
        for req in step.sampling:
            if req.grammar is not None and not req.grammar.accept(sampled[req.request_id]):
                rejected.append(req)
                del sampled[req.request_id]
        for spec in step.spec_rows:
            sampled[spec.request.request_id] = step.verified[spec.request.request_id].pop(0)
        return sampled, rejected
