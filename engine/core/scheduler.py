"""One token-budget scheduler for prefill chunks, decodes, prefix hits and preemption.

Each step hands out `{request_id: num_new_tokens}`: a running request asks for whatever it has
not computed yet (one token when decoding, the rest of its prompt when prefilling), a waiting
request asks for its prompt minus its prefix hit. Long asks are cut to the budget, which is
chunked prefill; a request whose blocks cannot be allocated evicts a worse one, which is
preemption by recompute. So the features compose instead of living in separate code paths.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager, PrefixHit
from engine.core.request import Request, RequestStatus
from engine.sampling_params import SamplingParams


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

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class WaitingQueue:
    """FCFS: arrival order, preempted requests back at the front. Priority: (priority, arrival)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def push(self, request: Request, front: bool = False) -> None:
        if self.policy == "priority":
            key = (request.priority, request.arrival_time, next(self._counter), request)
            heapq.heappush(self._heap, key)
        elif front:
            self._fifo.appendleft(request)
        else:
            self._fifo.append(request)

    def peek(self) -> Request:
        return self._heap[0][3] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, request: Request) -> None:
        if self.policy == "priority":
            self._heap = [e for e in self._heap if e[3] is not request]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(request)

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)

    def __iter__(self):
        if self.policy == "priority":
            return (e[3] for e in sorted(self._heap))
        return iter(self._fifo)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.policy = config.scheduling_policy
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(self.policy)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._unschedulable: list[tuple[Request, str]] = []

    # ------------------------------------------------------------ admission
    def add_request(self, request: Request) -> None:
        """Queue a request, or refuse it at once if it could never run."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        n = request.num_prompt_tokens
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens, but the maximum context length is "
                f"{self.max_model_len} tokens (prompt plus at least one generated token)")
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self.waiting.push(request)

    def _policy_key(self, request: Request) -> tuple[int, float]:
        prio = request.priority if self.policy == "priority" else 0
        return (prio, request.arrival_time)

    # ------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        order: list[Request] = []
        preempted: list[str] = []
        self._unschedulable = []
        spec: dict[str, list[int]] = {}
        now = time.monotonic()

        def victim_for(candidate: Request) -> Request | None:
            """The worst running request not yet scheduled this step, if worse than candidate.

            Requests scheduled in this step are never victims: their new blocks are already
            registered in the prefix cache, and others may have hit them in this step. Nor is
            a member of their group: a group is preempted whole or not at all.
            """
            busy = {r.group_id for r in order if r.group_id is not None}
            pool = [r for r in self.running
                    if r.request_id not in scheduled and r.group_id not in busy]
            if not pool:
                return None
            worst = max(pool, key=self._policy_key)
            if candidate.status is RequestStatus.RUNNING:
                return worst  # may be the candidate itself
            return worst if self._policy_key(worst) > self._policy_key(candidate) else None

        def preempt(victim: Request) -> None:
            """Preempt the victim with every member of its group not scheduled in this step:
            shared blocks return to the pool only when all their holders let go."""
            group = [victim]
            if victim.group_id is not None:
                group += [r for r in self.running if r is not victim
                          and r.group_id == victim.group_id and r.request_id not in scheduled]
            for member in group:
                self.running.remove(member)
                self.kv.free(member)  # before resetting computed tokens, see KVCacheManager.free
                member.num_computed_tokens = 0
                member.spec_token_ids = []
                spec.pop(member.request_id, None)
                member.status = RequestStatus.PREEMPTED
                member.num_preemptions += 1
                self.num_preemptions += 1
                self.waiting.push(member, front=True)
                preempted.append(member.request_id)

        # Running requests first, best first (a preempted request re-admitted later still
        # keeps its arrival-time rank), each asking for what it has not computed yet. A group
        # (forks sharing blocks) is one unit: its room is found for all members at once, so a
        # preemption for its sake never splits it.
        done_groups: set[str] = set()
        for request in sorted(self.running, key=self._policy_key):
            if budget == 0 or len(scheduled) >= self.config.max_num_seqs:
                break  # forks can make more running requests than one step may hold
            if request.status is not RequestStatus.RUNNING or request.group_id in done_groups:
                continue  # preempted earlier in this loop, or its group is done
            if self.policy == "priority" and len(self.waiting):
                # A better waiting request goes before this (worse) running one.
                budget = self._admit_waiting(budget, scheduled, order, now, victim_for, preempt,
                                             better_than=self._policy_key(request))
                if request.status is not RequestStatus.RUNNING or budget == 0:
                    continue
            unit = [request]
            if request.group_id is not None:
                done_groups.add(request.group_id)
                unit = [r for r in self.running if r.group_id == request.group_id]
            following = self._share_in_group(unit, scheduled) if len(unit) > 1 else set()
            asks: list[tuple[Request, int]] = []
            drafts: dict[str, list[int]] = {}
            room, seats = budget, self.config.max_num_seqs - len(scheduled)
            for member in unit:
                num_new = min(member.num_tokens - member.num_computed_tokens, room)
                if num_new > 0 and seats > 0 and member.request_id not in following:
                    fit = self._fit_drafts(member, room)
                    if fit:  # lookahead slots: in the budget and the block count like any token
                        drafts[member.request_id] = fit
                        num_new += len(fit)
                    asks.append((member, num_new))
                    room -= num_new
                    seats -= 1
            if not asks:
                continue
            while self.kv.blocks_needed_together(asks) > self.kv.num_free_blocks:
                victim = victim_for(request)
                assert victim is not None
                preempt(victim)
                if request.status is not RequestStatus.RUNNING:
                    break  # it was the victim, or in the victim's group
            if request.status is not RequestStatus.RUNNING:
                continue
            for member, num_new in asks:
                allocated = self.kv.allocate_slots(member, num_new)
                assert allocated, "blocks_needed_together undercounted"
                scheduled[member.request_id] = num_new
                order.append(member)
                budget -= num_new
                if member.request_id in drafts:
                    spec[member.request_id] = drafts[member.request_id]

        # Then waiting requests by policy, while budget, sequence slots and blocks last.
        if not preempted:
            budget = self._admit_waiting(budget, scheduled, order, now, victim_for, preempt)

        total = sum(scheduled.values())
        return SchedulerOutput(scheduled, order, total, preempted, self.kv.take_block_copies(),
                               self._unschedulable, spec)

    def _fit_drafts(self, request: Request, room: int) -> list[int]:
        """The request's drafts that fit this step: only after its last token (a decode),
        within the budget, the context length and max_tokens (the verified step appends up to
        one token more than it keeps drafts)."""
        drafts = request.spec_token_ids
        if not drafts or request.num_tokens - request.num_computed_tokens != 1:
            return []
        cap = min(len(drafts), room - 1, self.max_model_len - request.num_tokens,
                  request.max_tokens - request.num_output_tokens - 1)
        return drafts[:cap] if cap > 0 else []

    def _admit_waiting(self, budget: int, scheduled: dict[str, int], order: list[Request],
                       now: float, victim_for: Callable[[Request], Request | None],
                       preempt: Callable[[Request], None],
                       better_than: tuple[int, float] | None = None) -> int:
        """Admit waiting requests in policy order; returns the budget left."""
        # Passed over while their grammar compiles, or while max_loras other adapters run.
        compiling: list[Request] = []
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if better_than is not None and self._policy_key(request) >= better_than:
                break
            if (request.grammar is not None and request.grammar.compiling) or (
                    not self._lora_fits(request)):
                compiling.append(self.waiting.pop())
                continue
            if request.sampling_params.use_beam_search:
                # Beams move in lockstep: the group is admitted whole or not at all.
                unit = [r for r in self.waiting if r.group_id == request.group_id]
                if self.running and len(self.running) + len(unit) > self.config.max_num_seqs:
                    break  # its beams wait for sequence slots (alone it may outnumber them)
                need = self._group_blocks(unit)
                if need > self.kv.num_blocks:
                    for member in unit:
                        self.waiting.remove(member)
                        compiling.append(member)
                    self._unschedulable.append((unit[0], (
                        f"the KV cache ({self.kv.num_blocks} blocks of {self.kv.block_size} "
                        f"tokens) cannot hold the {len(unit)} beams of this request together "
                        f"({need} blocks); use a smaller beam width or max_tokens")))
                    continue
                left = self._admit_group(unit, need, budget, scheduled, order, now,
                                         victim_for, preempt)
                if left is None:
                    break
                budget = left
                continue
            # Waiting requests hold no blocks and have computed nothing (preemption resets).
            hit = self._best_hit(request, scheduled)
            num_new = min(request.num_tokens - hit.num_tokens, budget)
            admitted = True
            while not self.kv.allocate_slots(request, num_new, hit):
                victim = victim_for(request)
                if victim is None or not self._preemption_would_fit(request, num_new, hit,
                                                                    scheduled):
                    admitted = False
                    break
                preempt(victim)
                # Preemption may have evicted blocks the hit counted on: look again.
                hit = self._best_hit(request, scheduled)
                num_new = min(request.num_tokens - hit.num_tokens, budget)
            if not admitted:
                break
            request.num_computed_tokens += hit.num_tokens
            self._start_running(request, hit, now)
            scheduled[request.request_id] = num_new
            order.append(request)
            budget -= num_new
        for request in reversed(compiling):
            self.waiting.push(request, front=True)
        return budget

    def _best_hit(self, request: Request, scheduled: dict[str, int]) -> PrefixHit:
        """The longer of the prefix-cache hit and the blocks a running sibling (an n > 1
        sample of the same request) holds for their common tokens."""
        hit = self.kv.find_prefix(request)
        if request.group_id is None:
            return hit
        for sibling in self.running:
            if sibling.group_id == request.group_id:
                valid = sibling.num_computed_tokens + scheduled.get(sibling.request_id, 0)
                other = self.kv.sibling_hit(request, sibling, valid)
                if other.num_tokens > hit.num_tokens:
                    hit = other
        return hit

    def _group_blocks(self, unit: list[Request]) -> int:
        """Blocks a waiting group needs to hold its tokens and take one more step, each member
        sharing the full blocks it has in common with a member ahead of it (an upper bound on
        what admitting it consumes: prefix-cache hits only lower it), in every KV group (a
        sliding group's too: its first step writes every prompt token)."""
        bs = self.kv.block_size
        need = 0
        for j, member in enumerate(unit):
            shared = max((min(member.common_prefix_len(a), member.num_tokens - 1) // bs
                          for a in unit[:j]), default=0)
            need += -(-(member.num_tokens + 1) // bs) - shared
        return need * self.kv.num_groups

    def _admit_group(self, unit: list[Request], need: int, budget: int,
                     scheduled: dict[str, int], order: list[Request], now: float,
                     victim_for: Callable[[Request], Request | None],
                     preempt: Callable[[Request], None]) -> int | None:
        """Admit every member of a waiting beam group, sharing their common blocks, or none
        (None: it waits). Returns the budget left."""
        key = self._policy_key(unit[0])
        while need > self.kv.num_free_blocks:
            victim = victim_for(unit[0])
            reclaimable = self.kv.num_reclaimable([
                r.request_id for r in self.running
                if r.request_id not in scheduled and self._policy_key(r) > key])
            if victim is None or need > self.kv.num_free_blocks + reclaimable:
                return None
            preempt(victim)
        admitted: list[Request] = []
        hits: list[PrefixHit] = []
        for member in unit:
            hit = self.kv.find_prefix(member)
            hits.append(hit)
            admitted.append(member)
            ok = self.kv.allocate_slots(member, 0, hit)
            member.num_computed_tokens = hit.num_tokens if ok else 0
            following = self._share_in_group(admitted, scheduled) if ok else set()
            seated = len(scheduled) < self.config.max_num_seqs
            num_new = 0 if member.request_id in following or not seated else min(
                member.num_tokens - member.num_computed_tokens, budget)
            if not ok or (num_new and not self.kv.allocate_slots(member, num_new)):
                for m in admitted:  # the bound above was off: back to waiting, untouched
                    self.kv.free(m)
                    m.num_computed_tokens = 0
                    scheduled.pop(m.request_id, None)
                    if m in order:
                        order.remove(m)
                return None
            if num_new:
                scheduled[member.request_id] = num_new
                order.append(member)
                budget -= num_new
        for member, hit in zip(unit, hits):
            self._start_running(member, hit, now)
        return budget

    def _start_running(self, request: Request, hit: PrefixHit, now: float) -> None:
        """Move an admitted request (its blocks allocated, its hits counted as computed) from
        the waiting queue to the running list."""
        self.waiting.remove(request)
        self.kv.record_lookup(request, hit)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = request.num_computed_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _share_in_group(self, unit: list[Request], step_tokens: dict[str, int]) -> set[str]:
        """Hand each member of a group the full blocks it has in common with a member ahead of
        it in `unit` (KVCacheManager.sibling_hit), and return the members that follow: their
        common prefix with a member ahead is not written yet, so they wait for it rather than
        compute it a second time. The first member never waits, so the group progresses."""
        bs = self.kv.block_size
        following: set[str] = set()
        for j, member in enumerate(unit):
            for ahead in unit[:j]:
                valid = ahead.num_computed_tokens + step_tokens.get(ahead.request_id, 0)
                hit = self.kv.sibling_hit(member, ahead, valid)
                if hit.blocks:
                    allocated = self.kv.allocate_slots(member, 0, hit)
                    assert allocated, "shared blocks cost no free block"
                    member.num_computed_tokens += hit.num_tokens
            if member.num_computed_tokens % bs:
                continue  # its own partial block: it cannot take shared blocks any more
            for ahead in unit[:j]:
                valid = ahead.num_computed_tokens + step_tokens.get(ahead.request_id, 0)
                shareable = min(member.common_prefix_len(ahead), member.num_tokens - 1)
                shareable -= shareable % bs
                if member.num_computed_tokens < shareable and valid < shareable:
                    following.add(member.request_id)
                    break
        return following

    def _lora_fits(self, request: Request) -> bool:
        """Whether the request's adapter is running already or one more adapter may run."""
        lora = request.lora_request
        if lora is None:
            return True
        active = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        return lora.lora_int_id in active or len(active) < self.config.max_loras

    def _preemption_would_fit(self, request: Request, num_new: int, hit: PrefixHit,
                              scheduled: dict[str, int]) -> bool:
        """Whether preempting every eligible victim (worse, not scheduled this step) could
        make room. Without this check a waiting request could preempt victims one by one and
        still not fit, leaving them preempted for nothing.
        """
        key = self._policy_key(request)
        reclaimable = self.kv.num_reclaimable([r.request_id for r in self.running
                                               if r.request_id not in scheduled
                                               and self._policy_key(r) > key])
        return self.kv.blocks_needed(request, num_new, hit) <= (
            self.kv.num_free_blocks + reclaimable)

    # ------------------------------------------------------------ after the model ran
    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int],
                           stop_strings: Callable[[Request, bool], str | None] | None = None,
                           verified: dict[str, list[int]] | None = None) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish what must finish.

        `sampled` holds a token for each request whose scheduled tokens reached its end (a
        prefill chunk that stops short samples nothing). `stop_strings(request, ended_by_token)`
        is told of each appended token (the engine's detokenizer) and returns the stop string
        its text now ends in, if any. `verified` holds, for a request that ran drafts, the
        kept drafts' tokens after its sampled one: only the drafts kept count as computed, the
        rejected ones' slots roll back. Returns the requests finished here.
        """
        finished: list[Request] = []
        for request in output.scheduled:
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            num = output.num_scheduled_tokens[request.request_id]
            drafts = output.spec_tokens.get(request.request_id)
            more = (verified or {}).get(request.request_id, []) if drafts else []
            if drafts:
                num -= len(drafts) - len(more)
            request.num_computed_tokens += num
            self.kv.free_out_of_window(request)  # no-op without a sliding KV group
            token = sampled.get(request.request_id)
            if token is None:
                if not request.wants_token and request.num_computed_tokens >= request.num_tokens:
                    self.finish(request, RequestStatus.FINISHED_LENGTH)  # max_tokens=0: scored
                    finished.append(request)
                continue
            if self.accept_token(request, token, stop_strings):
                finished.append(request)
                continue
            for token in more:
                if self.accept_token(request, token, stop_strings):
                    finished.append(request)
                    break
            if drafts and not request.is_finished:
                self.kv.free_lookahead(request)
        return finished

    def accept_token(self, request: Request, token: int,
                     stop_strings: Callable[[Request, bool], str | None] | None = None) -> bool:
        """Append a sampled token and finish the request if it must end; True if it ended."""
        request.output_token_ids.append(token)
        status, reason = self._check_stop(request, token, stop_strings)
        if status is None:
            return False
        request.stop_reason = reason
        self.finish(request, status)
        return True

    def fork(self, parent: Request, child_id: str, params: SamplingParams | None = None,
             num_computed: int | None = None) -> Request:
        """A running copy of `parent` sharing its blocks (KVCacheManager.fork), with the
        parent's tokens so far; `num_computed` when the parent's step is not yet counted."""
        if child_id in self.requests:
            raise ValueError(f"request id {child_id!r} is already in use")
        if parent.status is not RequestStatus.RUNNING:
            raise RuntimeError(f"cannot fork {parent.request_id!r}: it is {parent.status.value}")
        child = Request(child_id, parent.prompt_token_ids, params or parent.sampling_params,
                        eos_token_id=parent.eos_token_id, priority=parent.priority,
                        cache_salt=parent.cache_salt, lora_request=parent.lora_request,
                        arrival_time=parent.arrival_time,
                        output_token_ids=list(parent.output_token_ids),
                        num_computed_tokens=(parent.num_computed_tokens if num_computed is None
                                             else num_computed),
                        num_cached_tokens=parent.num_cached_tokens,
                        group_id=parent.group_id or parent.request_id,
                        block_hashes=list(parent.block_hashes),
                        first_scheduled_time=parent.first_scheduled_time)
        parent.group_id = child.group_id
        self.kv.fork(parent, child)
        child.status = RequestStatus.RUNNING
        self.requests[child_id] = child
        self.running.append(child)
        return child

    def _check_stop(self, request: Request, token: int,
                    stop_strings: Callable[[Request, bool], str | None] | None
                    ) -> tuple[RequestStatus | None, int | str | None]:
        """Why the request ends with this token, if it does: (status, stop_reason). A stop
        string wins over the token that ended the request; EOS or a stop token over length."""
        params = request.sampling_params
        by_token: tuple[RequestStatus, int | None] | None = None
        if request.past_min_tokens:
            if (not params.ignore_eos and request.eos_token_id is not None
                    and token == request.eos_token_id):
                by_token = (RequestStatus.FINISHED_STOPPED, None)
            elif token in params.stop_token_ids:
                by_token = (RequestStatus.FINISHED_STOPPED, token)
        text_stop = stop_strings(request, by_token is not None) if stop_strings else None
        if text_stop is not None:
            return RequestStatus.FINISHED_STOPPED, text_stop
        if by_token is not None:
            return by_token
        if request.num_output_tokens >= request.max_tokens or (
                request.num_tokens >= self.max_model_len):
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    def finish(self, request: Request, status: RequestStatus) -> None:
        """The one way a request ends: out of its queue, its blocks freed, its status set."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        del self.requests[request.request_id]

    def finish_requests(self, request_ids, status: RequestStatus) -> list[Request]:
        """Finish (abort, error) requests by id; unknown or finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        done = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            self.finish(request, status)
            done.append(request)
        return done

    def abort(self, request_id: str) -> bool:
        return bool(self.finish_requests([request_id], RequestStatus.FINISHED_ABORTED))

    # ------------------------------------------------------------ state
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict[str, int | float]:
        s = self.kv.stats()
        bs = self.kv.block_size
        slack = 0
        for request in self.running:  # the unwritten tail of the last block, in every group
            cap = self.kv.num_blocks_of(request.request_id) * bs
            slack += (cap - min(request.num_tokens, cap)) * self.kv.num_groups
        s["kv_slots_used"] = s["kv_slots_allocated"] - slack
        s["num_running"] = len(self.running)
        s["num_waiting"] = len(self.waiting)
        s["num_preemptions"] = self.num_preemptions
        return s
