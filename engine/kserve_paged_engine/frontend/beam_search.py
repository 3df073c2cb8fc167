"""Beam search inside the engine: each beam is a request of one group, forked and pruned on
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

# Joins the group's (user's) request id and a beam number into ids that users do not type.
BEAM_SEP = "\x1f" + "beam"


@dataclass(slots=True)
class Hypothesis:
    token_ids: list[int]
    score: float  # cum_logprob / len ** length_penalty, what transformers calls sequences_scores
    cum_logprob: float
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass(slots=True)
class BeamSearch:
    group_id: str
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
    """Every live beam-search group, by group id (the user's request id)."""

    def __init__(self) -> None:
        self.groups: dict[str, BeamSearch] = {}
        self._group_of: dict[str, str] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def is_beam(self, request_id: str) -> bool:
        return request_id in self._group_of

    def group_of(self, request_id: str) -> str | None:
        return self._group_of.get(request_id)

    def start(self, root: Request, max_model_len: int) -> None:
        params = root.sampling_params
        eos = set(params.stop_token_ids)
        if root.eos_token_id is not None and not params.ignore_eos:
            eos.add(root.eos_token_id)
        max_new = min(root.max_tokens, max_model_len - root.num_prompt_tokens)
        self.groups[root.request_id] = BeamSearch(root.request_id, params, frozenset(eos),
                                                 max_new, [root.request_id], [0.0])
        self._group_of[root.request_id] = root.request_id
        root.group_id = root.request_id

    def expand(self, request_ids: list[str]) -> list[str]:
        """The ids to abort for these: a group id stands for its live beams (and is forgotten)."""
        out: list[str] = []
        for rid in request_ids:
            group = self.groups.pop(rid, None)
            if group is None:
                out.append(rid)
                continue
            for beam in group.beams:
                self._group_of.pop(beam, None)
            out.extend(group.beams)
        return out

    def report(self, request: Request, logits: torch.Tensor) -> BeamSearch:
        """Keep the beam's best continuations (log-probs in float32); returns its group."""
        group = self.groups[self._group_of[request.request_id]]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        group.reports[request.request_id] = torch.topk(logprobs, group.num_candidates)
        return group

    @staticmethod
    def ready(group: BeamSearch, requests: dict[str, Request]) -> bool:
        """Whether every live beam has its logits for the current length (lockstep)."""
        for rid in group.beams:
            req = requests.get(rid)
            if (rid not in group.reports or req is None or req.status is not RequestStatus.RUNNING
                    or req.num_computed_tokens != req.num_tokens):
                return False
        return True

    def advance(self, group: BeamSearch, sched: Scheduler) -> bool:
        """One beam step: choose the next beams, fork and prune requests; True when done (the
        group's requests are then finished and the group forgotten)."""
        k, lp = group.width, group.params.length_penalty
        vals = torch.stack([group.reports[b][0] for b in group.beams])
        ids = torch.stack([group.reports[b][1] for b in group.beams])
        scores = vals + torch.tensor(group.scores, dtype=torch.float32)[:, None]
        top, flat = torch.topk(scores.flatten(), group.num_candidates)
        per_beam = ids.shape[1]
        cands = [(f // per_beam, int(ids.view(-1)[f]), s) for f, s in zip(flat.tolist(),
                                                                           top.tolist())]
        last = group.gen_len + 1 >= group.max_new
        finished_scores = (top / float(group.gen_len + 1) ** lp).tolist()
        requests = sched.requests
        chosen: list[tuple[int, int, float]] = []
        for j, (beam, token, score) in enumerate(cands):
            if last or token in group.eos_ids:
                if j < k:
                    prev = requests[group.beams[beam]]
                    tokens = prev.output_token_ids + [token]
                    reason = "stop" if token in group.eos_ids else "length"
                    group.finished.append(Hypothesis(tokens, finished_scores[j], score, reason))
            elif len(chosen) < k:
                chosen.append((beam, token, score))
        group.finished.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties
        del group.finished[k:]
        group.gen_len += 1
        group.reports.clear()
        if len(chosen) < k or self._done(group, chosen[0][2]):
            self._finish(group, sched)
            return True
        # Forks first (they copy the parent's tokens), then prunes, then the new tokens.
        parents = [requests[rid] for rid in group.beams]
        reused: set[int] = set()
        moves: list[tuple[Request, int]] = []
        for beam, token, _ in chosen:
            if beam in reused:
                child_id = f"{group.group_id}{BEAM_SEP}{group.next_id}"
                group.next_id += 1
                child = sched.fork(parents[beam], child_id)
                self._group_of[child_id] = group.group_id
                moves.append((child, token))
            else:
                reused.add(beam)
                moves.append((parents[beam], token))
        for i, parent in enumerate(parents):
            if i not in reused:
                self._group_of.pop(parent.request_id, None)
                sched.finish(parent, RequestStatus.FINISHED_STOPPED)
        for req, token in moves:
            req.output_token_ids.append(token)
        group.beams = [req.request_id for req, _ in moves]
        group.scores = [score for _, _, score in chosen]
        return False

    @staticmethod
    def _done(group: BeamSearch, best_running: float) -> bool:
        if len(group.finished) < group.width:
            return False
        if group.params.early_stopping is True:
            return True
        lp = group.params.length_penalty
        length = (group.max_new if group.params.early_stopping == "never" and lp > 0
                  else group.gen_len)
        best = float(torch.tensor(best_running, dtype=torch.float32) / float(length) ** lp)
        return best <= group.finished[-1].score

    def _finish(self, group: BeamSearch, sched: Scheduler) -> None:
        for rid in group.beams:
            self._group_of.pop(rid, None)
            req = sched.requests.get(rid)
            if req is not None and not req.is_finished:
                sched.finish(req, RequestStatus.FINISHED_STOPPED)
        group.beams = []
        del self.groups[group.group_id]
