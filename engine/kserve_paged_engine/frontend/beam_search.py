"""Beam search inside the engine: each beam is a request of its search, forked and pruned on
shared blocks (KVCacheManager.fork, copy-on-write), scheduled like any other request.

The selection follows transformers' `generate(num_beams=k, do_sample=False)`: each step takes
the best (1 + number of EOS ids, at least 2) x k continuations of all beams by summed log-prob;
of those, the ones ending in EOS (or reaching max_tokens) among the first k become finished
hypotheses scored sum / length ** length_penalty, and the first k others are the next beams.
The search ends when every candidate ends, when k hypotheses are finished and early_stopping is
True, or when (k finished) the best running beam can no longer beat the worst finished one
(its score over its current length, or over max_tokens when early_stopping is "never" and
length_penalty > 0). Beams move in lockstep: a step's selection waits until every live beam
has its logits (a preempted beam recomputes first). Details: docs/engine.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kserve_paged_engine.core.request import Request, RequestStatus
from kserve_paged_engine.core.scheduler import Scheduler
from kserve_paged_engine.sampling_params import SamplingParams

# Joins the search's (user's) request id and a beam number into ids that users do not type.
BEAM_SEP = "\x1f" + "beam"


@dataclass(slots=True)
class Hypothesis:
    token_ids: list[int]
    score: float  # cum_logprob / len ** length_penalty, what transformers calls sequences_scores
    cum_logprob: float
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass(slots=True)
class BeamSearch:
    fork_root: str
    params: SamplingParams
    eos_ids: frozenset[int]
    max_new: int  # max_tokens, capped by the model's length limit
    beams: list[str]  # live beam request ids, best first
    scores: list[float]  # their summed log-probs
    finished: list[Hypothesis] = field(default_factory=list)
    reports: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    gen_len: int = 0
    next_id: int = 0

    @property
    def width(self) -> int:
        return self.params.beam_width

    @property
    def num_candidates(self) -> int:
        return max(2, 1 + len(self.eos_ids)) * self.width


class BeamSearches:
    """Every live beam search, by its id (the user's request id)."""

    def __init__(self) -> None:
        self.searches: dict[str, BeamSearch] = {}
        self._search_of: dict[str, str] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.searches

    def is_beam(self, request_id: str) -> bool:
        return request_id in self._search_of

    def search_of(self, request_id: str) -> str | None:
        return self._search_of.get(request_id)

    def start(self, root: Request, max_model_len: int) -> None:
        params = root.sampling_params
        eos = set(params.stop_token_ids)
        if root.eos_token_id is not None and not params.ignore_eos:
            eos.add(root.eos_token_id)
        max_new = min(root.max_tokens, max_model_len - root.num_prompt_tokens)
        self.searches[root.request_id] = BeamSearch(root.request_id, params, frozenset(eos),
                                                 max_new, [root.request_id], [0.0])
        self._search_of[root.request_id] = root.request_id
        root.fork_root = root.request_id

    def expand(self, request_ids: list[str]) -> list[str]:
        """The ids to abort for these: a search id stands for its live beams (and is forgotten)."""
        out: list[str] = []
        for rid in request_ids:
            search = self.searches.pop(rid, None)
            if search is None:
                out.append(rid)
                continue
            for beam in search.beams:
                self._search_of.pop(beam, None)
            out.extend(search.beams)
        return out

    def report(self, request: Request, logits: torch.Tensor) -> BeamSearch:
        """Keep the beam's best continuations (log-probs in float32); returns its search."""
        search = self.searches[self._search_of[request.request_id]]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        search.reports[request.request_id] = torch.topk(logprobs, search.num_candidates)
        return search

    @staticmethod
    def ready(search: BeamSearch, requests: dict[str, Request]) -> bool:
        """Whether every live beam has its logits for the current length (lockstep)."""
        for rid in search.beams:
            req = requests.get(rid)
            if (rid not in search.reports or req is None or req.status is not RequestStatus.RUNNING
                    or req.num_computed_tokens != req.num_tokens):
                return False
        return True

    def advance(self, search: BeamSearch, sched: Scheduler) -> bool:
        """One beam step: choose the next beams, fork and prune requests; True when done (the
        search's requests are then finished and the search forgotten)."""
        k = search.width
        last = search.gen_len + 1 >= search.max_new
        requests = sched.requests
        chosen: list[tuple[int, int, float]] = []
        for j, (beam, token, score, finished_score) in enumerate(self._candidates(search)):
            if last or token in search.eos_ids:
                if j < k:
                    prev = requests[search.beams[beam]]
                    tokens = prev.output_token_ids + [token]
                    reason = "stop" if token in search.eos_ids else "length"
                    search.finished.append(Hypothesis(tokens, finished_score, score, reason))
            elif len(chosen) < k:
                chosen.append((beam, token, score))
        search.finished.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties
        del search.finished[k:]
        search.gen_len += 1
        search.reports.clear()
        if len(chosen) < k or self._done(search, chosen[0][2]):
            self._finish(search, sched)
            return True
        # Forks first (they copy the parent's tokens), then prunes, then the new tokens.
        parents = [requests[rid] for rid in search.beams]
        reused: set[int] = set()
        moves: list[tuple[Request, int]] = []
        for beam, token, _ in chosen:
            if beam in reused:
                child_id = f"{search.fork_root}{BEAM_SEP}{search.next_id}"
                search.next_id += 1
                child = sched.fork(parents[beam], child_id)
                self._search_of[child_id] = search.fork_root
                moves.append((child, token))
            else:
                reused.add(beam)
                moves.append((parents[beam], token))
        for i, parent in enumerate(parents):
            if i not in reused:
                self._search_of.pop(parent.request_id, None)
                sched.finish(parent, RequestStatus.FINISHED_STOPPED)
        for req, token in moves:
            req.output_token_ids.append(token)
        search.beams = [req.request_id for req, _ in moves]
        search.scores = [score for _, _, score in chosen]
        return False

    @staticmethod
    def _candidates(search: BeamSearch) -> list[tuple[int, int, float, float]]:
        """The step's best continuations of every beam, best first, as (beam, token, summed
        log-prob, its score as a finished hypothesis). Computed on the device of the beams'
        log-probs (their summed scores uploaded to it) and read back in one transfer."""
        vals = torch.stack([search.reports[b][0] for b in search.beams])
        ids = torch.stack([search.reports[b][1] for b in search.beams])
        prior = torch.tensor(search.scores, dtype=torch.float32, device=vals.device)
        top, flat = torch.topk((vals + prior.unsqueeze(1)).flatten(), search.num_candidates)
        tokens = ids.flatten().index_select(0, flat)
        beam = flat.div(ids.shape[1], rounding_mode="floor")
        finished = top / float(search.gen_len + 1) ** search.params.length_penalty
        # float64 holds the float32 scores and the ids exactly: one read for all four.
        rows = torch.stack([beam.double(), tokens.double(), top.double(), finished.double()])
        beams, toks, tops, fins = rows.tolist()
        return [(int(b), int(t), s, f) for b, t, s, f in zip(beams, toks, tops, fins)]

    @staticmethod
    def _done(search: BeamSearch, best_running: float) -> bool:
        if len(search.finished) < search.width:
            return False
        if search.params.early_stopping is True:
            return True
        lp = search.params.length_penalty
        length = (search.max_new if search.params.early_stopping == "never" and lp > 0
                  else search.gen_len)
        best = float(torch.tensor(best_running, dtype=torch.float32) / float(length) ** lp)
        return best <= search.finished[-1].score

    def _finish(self, search: BeamSearch, sched: Scheduler) -> None:
        for rid in search.beams:
            self._search_of.pop(rid, None)
            req = sched.requests.get(rid)
            if req is not None and not req.is_finished:
                sched.finish(req, RequestStatus.FINISHED_STOPPED)
        search.beams = []
        del self.searches[search.fork_root]
