"""One step's schedule: what the scheduler hands the model runner, the step as it is built
(budget left, requests chosen so far), and what the scheduler is told back (`Appended`: each
request's tokens and how it ends, as the stop check decided)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kserve_paged_engine.core.kv_tier.link import TierMoves
from kserve_paged_engine.core.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    # Requests in execution order with their token counts.
    num_scheduled_tokens: dict[str, int]
    scheduled: list[Request]
    total_num_scheduled_tokens: int
    preempted: list[str] = field(default_factory=list)
    # Copy-on-write block copies (source id, destination id) to do before the forward.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Waiting requests that can never run (why): the engine fails them.
    unschedulable: list[tuple[Request, str]] = field(default_factory=list)
    # Draft tokens scheduled after a request's last token (counted in its num tokens).
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Second-tier copies (engine/kserve_paged_engine/core/kv_tier/link.py), before the copy-on-write ones.
    tier_moves: TierMoves | None = None
    # Requests scheduled for the first time (their prompt tokens count once, in the stats).
    started: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class StepBuild:
    """The step being scheduled: the token budget left and what it holds so far."""

    budget: int
    now: float
    scheduled: dict[str, int] = field(default_factory=dict)
    order: list[Request] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    spec: dict[str, list[int]] = field(default_factory=dict)
    unschedulable: list[tuple[Request, str]] = field(default_factory=list)
    started: list[Request] = field(default_factory=list)

    def add(self, request: Request, num_new: int) -> None:
        self.scheduled[request.request_id] = num_new
        self.order.append(request)
        self.budget -= num_new

    def drop(self, request: Request) -> None:
        """Take a request back out (its admission fell through); its tokens back in the
        budget."""
        num = self.scheduled.pop(request.request_id, None)
        if num is not None:
            self.order.remove(request)
            self.budget += num

    def output(self, block_copies: list[tuple[int, int]],
               tier_moves: TierMoves | None = None) -> SchedulerOutput:
        return SchedulerOutput(self.scheduled, self.order, sum(self.scheduled.values()),
                               self.preempted, block_copies, self.unschedulable, self.spec,
                               tier_moves, self.started)


@dataclass(slots=True)
class Appended:
    """What one request appends in a step, as the stop check decided: its tokens in order, cut
    after the one that ends it; how it ends (None: it goes on) and why (the stop string or stop
    token id); and how many of its drafts the target rejected (their slots roll back)."""

    tokens: list[int] = field(default_factory=list)
    status: RequestStatus | None = None
    stop_reason: int | str | None = None
    rejected_drafts: int = 0
