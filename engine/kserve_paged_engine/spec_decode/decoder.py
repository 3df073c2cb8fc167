"""The engine's side of speculation: who gets drafts before a step, what a verified step
appends, and when a request stops proposing because its drafts are not kept."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kserve_paged_engine.config.speculative import SpeculativeConfig
from kserve_paged_engine.core.request import Request
from kserve_paged_engine.outputs import Logprob
from kserve_paged_engine.sample.logits_processors import apply_penalties
from kserve_paged_engine.sample.logprobs import sampled_entries
from kserve_paged_engine.sample.sampler import GREEDY_EPS, greedy_tokens, target_probs
from kserve_paged_engine.spec_decode.draft_gate import DraftGate
from kserve_paged_engine.spec_decode.draft_model import DraftModelProposer, GeneratorOf
from kserve_paged_engine.spec_decode.ngram import NgramProposer
from kserve_paged_engine.spec_decode.rejection import accept_greedy, rejection_sample

logger = logging.getLogger("kserve_paged_engine")

# Verified steps in a row that keep no draft before the request pauses proposing; the pause
# starts at PAUSE_MIN steps and doubles (to PAUSE_MAX) each time it ends in another miss run.
MISSES_BEFORE_PAUSE = 2
PAUSE_MIN, PAUSE_MAX = 4, 64


@dataclass(slots=True)
class _Backoff:
    misses: int = 0
    pause: int = 0  # steps left without proposing
    next_pause: int = PAUSE_MIN


@dataclass(slots=True)
class SpecRow:
    """A scheduled request with drafts: its first verification row in the step's logits."""

    request: Request
    first_row: int
    drafts: list[int]


@dataclass(slots=True)
class Verified:
    """A verified request's tokens (kept drafts, then one more) and, if it asked, each one's
    logprobs entry with the token's own logprob."""

    tokens: list[int]
    logprobs: list[tuple[dict[int, Logprob], float]] = field(default_factory=list)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, draft: DraftModelProposer | None = None
                 ) -> None:
        self.config = config
        self.proposer: NgramProposer | DraftModelProposer = draft or NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        # The draft model's distributions of this step's drafts (sampled requests only).
        self._draft_probs: dict[str, torch.Tensor] = {}
        self.num_draft_failures = 0  # steps whose draft forward raised (logged)
        # vLLM's spec-decode counters: verified steps with drafts, draft tokens, kept drafts,
        # and kept drafts by position.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens
        self._backoff: dict[str, _Backoff] = {}
        # The draft model's batch-wide switch (draft_gate.py), fed this step's draft time.
        self.gate = DraftGate()
        self._step_start = self._draft_seconds = 0.0

    @staticmethod
    def can_speculate(request: Request) -> bool:
        """Constrained, beam and LoRA requests never speculate (a grammar would have to check
        drafts; beams move in lockstep; adapters are untested with multi-token decodes), nor
        a request still under min_tokens (its stop tokens are banned row by row)."""
        p = request.sampling_params
        return (request.grammar is None and not p.use_beam_search
                and request.lora_request is None and request.past_min_tokens)

    def propose(self, running: Sequence[Request], is_beam: Callable[[str], bool],
                generator_of: GeneratorOf = lambda _: None) -> None:
        """Set each decoding request's drafts for the coming step (none where no n-gram
        recurs, the request cannot speculate, or it is pausing after misses). Decoding: one
        token not computed and at least one output, so a prompt's last chunk never carries
        drafts (its first sample is where n > 1 samples fork). A draft model proposes for all
        of them at once; `generator_of(request)` draws its sampled drafts."""
        self._step_start, self._draft_seconds = time.perf_counter(), 0.0
        live = {r.request_id for r in running}
        if len(self._backoff) > len(live):
            self._backoff = {rid: b for rid, b in self._backoff.items() if rid in live}
        self._draft_probs = {}
        batch: list[tuple[Request, int]] = []
        for request in running:
            request.spec_token_ids = []
            if (request.num_tokens - request.num_computed_tokens != 1
                    or not request.output_token_ids or not self.can_speculate(request)
                    or is_beam(request.request_id)):
                continue
            backoff = self._backoff.get(request.request_id)
            if backoff is not None and backoff.pause > 0:
                backoff.pause -= 1
                continue
            room = request.max_tokens - request.num_output_tokens - 1
            if isinstance(self.proposer, DraftModelProposer):
                batch.append((request, room))
            else:
                request.spec_token_ids = self.proposer.propose(request.all_token_ids, room)
        if batch and self.gate.open():
            self._propose_with_draft_model(batch, generator_of)
            self._draft_seconds = time.perf_counter() - self._step_start

    def _propose_with_draft_model(self, batch: list[tuple[Request, int]],
                                  generator_of: GeneratorOf) -> None:
        """A failing draft forward costs only this step's drafts (and the draft's KV, dropped
        whole): the requests decode plainly and the target's step goes on."""
        try:
            drafts, self._draft_probs = self.proposer.propose(batch, generator_of)
        except Exception:  # noqa: BLE001 - contain a draft failure to its drafts
            logger.exception("the draft model failed; this step decodes without drafts")
            self.num_draft_failures += 1
            self.proposer.release_all()
            return
        for request, _ in batch:
            request.spec_token_ids = drafts.get(request.request_id, [])

    def release(self, running: Sequence[Request]) -> None:
        """Free the draft model's KV of requests no longer running (no-op for n-gram)."""
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.retain({r.request_id for r in running})

    def verify(self, logits: torch.Tensor, rows: list[SpecRow],
               generators: Sequence[torch.Generator], decode: Callable[[list[int]], str]
               ) -> list[Verified]:
        """The tokens each request appends (kept drafts, then one more), from its rows of the
        step's raw logits, drawn with its generator; with the logprobs of those tokens (the
        target model's) when it asked for them (the sample stage keeps them)."""
        index: list[int] = []
        params, prompts, outputs = [], [], []
        for spec in rows:
            r = spec.request
            for j in range(len(spec.drafts) + 1):
                index.append(spec.first_row + j)
                params.append(r.sampling_params)
                prompts.append(r.prompt_token_ids)
                outputs.append(r.output_token_ids + spec.drafts[:j])
        raw = logits.index_select(0, torch.tensor(index, device=logits.device))
        processed = raw
        if any(p.needs_logits_processing for p in params):
            processed = apply_penalties(raw, params, prompts, outputs)
        greedy = greedy_tokens(processed).tolist()
        result: list[Verified] = []
        at = kept_total = 0
        for spec, generator in zip(rows, generators):
            r, n = spec.request, len(spec.drafts) + 1
            p = r.sampling_params
            if p.temperature < GREEDY_EPS:
                tokens = accept_greedy(greedy[at:at + n], spec.drafts)
            else:
                probs = target_probs(processed[at:at + n], [p] * n)
                q = self._draft_probs.get(r.request_id)  # None: an n-gram's point mass
                tokens = rejection_sample(probs, spec.drafts,
                                          None if q is None else q[:n - 1].to(probs.device),
                                          generator)
            verified = Verified(tokens)
            if p.logprobs is not None:
                kept = len(tokens)
                verified.logprobs = [(entry, chosen) for _, entry, chosen in sampled_entries(
                    raw[at:at + kept], torch.tensor(tokens, device=raw.device),
                    [p.logprobs] * kept, decode)]
            self._record(r.request_id, len(spec.drafts), len(tokens) - 1)
            kept_total += len(tokens) - 1
            result.append(verified)
            at += n
        if self._draft_seconds and rows:
            self.gate.record(self._draft_seconds, time.perf_counter() - self._step_start,
                             kept_total / len(rows))
        return result

    def _record(self, request_id: str, drafted: int, kept: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += kept
        for pos in range(kept):
            self.accepted_per_pos[pos] += 1
        backoff = self._backoff.setdefault(request_id, _Backoff())
        if kept:
            backoff.misses = 0
            backoff.next_pause = PAUSE_MIN
            return
        backoff.misses += 1
        if backoff.misses >= MISSES_BEFORE_PAUSE:
            backoff.pause = backoff.next_pause
            backoff.next_pause = min(2 * backoff.next_pause, PAUSE_MAX)
            backoff.misses = 0

    def stats(self) -> dict[str, int | list[int]]:
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
                "spec_decode_draft_paused_steps": self.gate.num_paused_steps}
