"""One token-budget scheduler for prefill chunks, decodes, prefix hits and preemption.

Each step hands out `{request_id: num_new_tokens}`: a running request asks for whatever it has
not computed yet (one token when decoding, the rest of its prompt when prefilling), a waiting
request asks for its prompt minus its prefix hit. Long asks are cut to the budget, which is
chunked prefill; a request whose blocks cannot be allocated evicts a worse one, which is
preemption by recompute. So the features compose instead of living in separate code paths.
The waiting queue is `request_queue.py`, forks' shared room `fork_admission.py`, who is
preempted `preemption.py`; what a step hands the runner, and what the step's stop check
(engine/kserve_paged_engine/frontend/stop_check.py) hands back, is `scheduler_output.py`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kserve_paged_engine.config.scheduler import SchedulerConfig
from kserve_paged_engine.core.fork_admission import (
    best_hit,
    fork_blocks,
    forked_request,
    share_among_forks,
)
from kserve_paged_engine.core.kv_cache_manager import KVCacheManager
from kserve_paged_engine.core.preemption import reclaimable, victim_for
from kserve_paged_engine.core.prefix_hits import PrefixHit
from kserve_paged_engine.core.request import Request, RequestStatus
from kserve_paged_engine.core.request_queue import WaitingQueue, policy_key
from kserve_paged_engine.core.scheduler_output import Appended, SchedulerOutput, StepBuild
from kserve_paged_engine.limits import request_id_in_use
from kserve_paged_engine.sampling_params import SamplingParams


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.policy = config.policy
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(self.policy)
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------ admission
    def add_request(self, request: Request) -> None:
        """Queue a request, or refuse it at once if it could never run."""
        if request.request_id in self.requests:
            raise ValueError(request_id_in_use(request.request_id))
        n = request.num_prompt_tokens
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens, but the maximum context length is "
                f"{self.max_model_len} tokens (prompt plus at least one generated token)")
        if not self.config.chunked_prefill and n > self.config.max_num_batched_tokens:
            raise ValueError(f"the prompt has {n} tokens, more than this model's one step "
                             f"computes (max_num_batched_tokens {self.config.max_num_batched_tokens})")
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self.waiting.push(request)

    def _policy_key(self, request: Request) -> tuple[int, float]:
        return policy_key(request, self.policy)

    # ------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        """This step's work: running requests first, best first, then waiting ones while the
        budget, sequence slots and blocks last (none after a preemption: room is short)."""
        step = StepBuild(self.config.max_num_batched_tokens, time.monotonic())
        self._schedule_running(step)
        if not step.preempted:
            self._admit_waiting(step)
        return step.output(self.kv.take_block_copies(), self.kv.take_tier_moves(bool(step.order)))

    def _schedule_running(self, step: StepBuild) -> None:
        """Each running request asks for what it has not computed yet, in policy order (a
        preempted request re-admitted later keeps its arrival-time rank). Forks (sharing
        blocks) are one unit: their room is found for all at once, so a preemption for their
        sake never splits them."""
        done_roots: set[str] = set()
        for request in sorted(self.running, key=self._policy_key):
            if step.budget == 0 or len(step.scheduled) >= self.config.max_num_seqs:
                break  # forks can make more running requests than one step may hold
            if request.status is not RequestStatus.RUNNING or request.fork_root in done_roots:
                continue  # preempted earlier in this loop, or its forks are done
            if self.policy == "priority" and len(self.waiting):
                # A better waiting request goes before this (worse) running one.
                self._admit_waiting(step, better_than=self._policy_key(request))
                if request.status is not RequestStatus.RUNNING or step.budget == 0:
                    continue
            unit = [request]
            if request.fork_root is not None:
                done_roots.add(request.fork_root)
                unit = [r for r in self.running if r.fork_root == request.fork_root]
            self._schedule_unit(step, request, unit)

    def _schedule_unit(self, step: StepBuild, request: Request, unit: list[Request]) -> None:
        """Room for every member's ask at once, preempting worse requests (or the unit itself)
        until it fits."""
        following = share_among_forks(self.kv, unit, step.scheduled) if len(unit) > 1 else set()
        asks: list[tuple[Request, int]] = []
        drafts: dict[str, list[int]] = {}
        room, seats = step.budget, self.config.max_num_seqs - len(step.scheduled)
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
            return
        while self.kv.blocks_needed_together(asks) > self.kv.num_free_blocks:
            victim = victim_for(self.running, step, request, self._policy_key)
            assert victim is not None
            self._preempt(step, victim)
            if request.status is not RequestStatus.RUNNING:
                return  # it was the victim, or one of the victim's forks
        for member, num_new in asks:
            allocated = self.kv.allocate_slots(member, num_new)
            assert allocated, "blocks_needed_together undercounted"
            step.add(member, num_new)
            if member.request_id in drafts:
                step.spec[member.request_id] = drafts[member.request_id]

    def _preempt(self, step: StepBuild, victim: Request) -> None:
        """Preempt the victim with every fork of it not scheduled in this step:
        shared blocks return to the pool only when all their holders let go."""
        forks = [victim]
        if victim.fork_root is not None:
            forks += [r for r in self.running if r is not victim
                      and r.fork_root == victim.fork_root and r.request_id not in step.scheduled]
        for member in forks:
            self.running.remove(member)
            self.kv.preempt(member)  # swapped or freed, before resetting computed tokens
            member.num_computed_tokens = 0
            member.spec_token_ids = []
            step.spec.pop(member.request_id, None)
            member.status = RequestStatus.PREEMPTED
            member.num_preemptions += 1
            self.num_preemptions += 1
            self.waiting.push(member, front=True)
            step.preempted.append(member.request_id)

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

    def _admit_waiting(self, step: StepBuild, better_than: tuple[int, float] | None = None
                       ) -> None:
        """Admit waiting requests in policy order (only those better than `better_than`)."""
        # Passed over while their grammar compiles, or while max_loras other adapters run.
        passed_over: list[Request] = []
        while (len(self.waiting) and step.budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting.peek()
            if better_than is not None and self._policy_key(request) >= better_than:
                break
            if (request.grammar is not None and request.grammar.compiling) or (
                    not self._lora_fits(request)):
                passed_over.append(self.waiting.pop())
                continue
            if request.sampling_params.use_beam_search:
                admitted = self._admit_beams(step, request, passed_over)
            else:
                admitted = self._admit_one(step, request)
            if not admitted:
                break
        for request in reversed(passed_over):
            self.waiting.push(request, front=True)

    def _admit_one(self, step: StepBuild, request: Request) -> bool:
        """Admit one waiting request, preempting worse ones if that can make room; False if
        it must wait. (Waiting requests hold no blocks: preemption resets them.)"""
        hit = self._best_hit(request, step)
        num_new = min(request.num_tokens - hit.num_tokens, step.budget)
        if not self.config.chunked_prefill and num_new < request.num_tokens - hit.num_tokens:
            return False  # whole or not at all: it waits for the next step's budget
        while not self.kv.allocate_slots(request, num_new, hit):
            victim = victim_for(self.running, step, request, self._policy_key)
            room = self.kv.num_free_blocks + reclaimable(
                self.kv, self.running, step.scheduled, request, self._policy_key)
            if victim is None or self.kv.blocks_needed(request, num_new, hit) > room:
                return False
            self._preempt(step, victim)
            # Preemption may have evicted blocks the hit counted on: look again.
            hit = self._best_hit(request, step)
            num_new = min(request.num_tokens - hit.num_tokens, step.budget)
        request.num_computed_tokens += hit.num_tokens
        self._start_running(request, hit, step)
        step.add(request, num_new)
        return True

    def _best_hit(self, request: Request, step: StepBuild) -> PrefixHit:
        """The prefix hit, or for a fork the better of it and its siblings' blocks."""
        if request.fork_root is None:
            return self.kv.find_prefix(request)
        return best_hit(self.kv, request, self.running, step.scheduled)

    def _admit_beams(self, step: StepBuild, request: Request,
                     passed_over: list[Request]) -> bool:
        """Beams move in lockstep: a search is admitted whole or not at all. One larger than
        the whole cache is unschedulable (the engine fails it); False: it waits."""
        unit = [r for r in self.waiting if r.fork_root == request.fork_root]
        if self.running and len(self.running) + len(unit) > self.config.max_num_seqs:
            return False  # its beams wait for sequence slots (alone it may outnumber them)
        need = fork_blocks(self.kv, unit)
        if need > self.kv.num_blocks:
            for member in unit:
                self.waiting.remove(member)
                passed_over.append(member)
            step.unschedulable.append((unit[0], (
                f"the KV cache ({self.kv.num_blocks} blocks of {self.kv.block_size} "
                f"tokens) cannot hold the {len(unit)} beams of this request together "
                f"({need} blocks); use a smaller beam width or max_tokens")))
            return True
        return self._admit_forks(step, unit, need)

    def _admit_forks(self, step: StepBuild, unit: list[Request], need: int) -> bool:
        """Admit every one of waiting forks, sharing their common blocks, or none
        (False: it waits, untouched)."""
        while need > self.kv.num_free_blocks:
            victim = victim_for(self.running, step, unit[0], self._policy_key)
            room = self.kv.num_free_blocks + reclaimable(
                self.kv, self.running, step.scheduled, unit[0], self._policy_key)
            if victim is None or need > room:
                return False
            self._preempt(step, victim)
        admitted: list[Request] = []
        hits: list[PrefixHit] = []
        for member in unit:
            hit = self.kv.find_prefix(member)
            hits.append(hit)
            admitted.append(member)
            ok = self.kv.allocate_slots(member, 0, hit)
            member.num_computed_tokens = hit.num_tokens if ok else 0
            following = share_among_forks(self.kv, admitted, step.scheduled) if ok else set()
            seated = len(step.scheduled) < self.config.max_num_seqs
            num_new = 0 if member.request_id in following or not seated else min(
                member.num_tokens - member.num_computed_tokens, step.budget)
            if not ok or (num_new and not self.kv.allocate_slots(member, num_new)):
                for m in admitted:  # the bound above was off: back to waiting, untouched
                    self.kv.free(m)
                    m.num_computed_tokens = 0
                    step.drop(m)
                return False
            if num_new:
                step.add(member, num_new)
        for member, hit in zip(unit, hits):
            self._start_running(member, hit, step)
        return True

    def _start_running(self, request: Request, hit: PrefixHit, step: StepBuild) -> None:
        """Move an admitted request (its blocks allocated, its hits counted as computed) from
        the waiting queue to the running list."""
        self.waiting.remove(request)
        self.kv.record_lookup(request, hit)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = request.num_computed_tokens
        if request.first_scheduled_time is None:  # its one home (outputs read it)
            request.first_scheduled_time = step.now
            step.started.append(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _lora_fits(self, request: Request) -> bool:
        """Whether the request's adapter is running already or one more adapter may run."""
        lora = request.lora_request
        if lora is None:
            return True
        active = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        return lora.lora_int_id in active or len(active) < self.config.max_loras

    # ------------------------------------------------------------ after the model ran
    def update_from_output(self, output: SchedulerOutput, ends: dict[str, Appended],
                           forked: Sequence[Request] = ()) -> list[Request]:
        """Advance computed tokens, append what each request appends and finish those that
        end, as the step's stop check decided (`ends`; engine/kserve_paged_engine/frontend/stop_check.py):
        a request that ran drafts counts only the kept ones as computed, the rejected ones'
        slots roll back. `forked`: samples forked in the step (not in its schedule), appended
        after it. Returns the requests finished here."""
        finished: list[Request] = []
        for request in output.scheduled:
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            appended = ends.get(request.request_id)
            num = output.num_scheduled_tokens[request.request_id]
            request.num_computed_tokens += num - (appended.rejected_drafts if appended else 0)
            self.kv.free_out_of_window(request)  # no-op without a sliding KV group
            if appended is None:
                continue
            if self._append(request, appended):
                finished.append(request)
            elif request.request_id in output.spec_tokens:
                self.kv.free_lookahead(request)
        for child in forked:
            appended = ends.get(child.request_id)
            if (appended is not None and child.status is RequestStatus.RUNNING
                    and self._append(child, appended)):
                finished.append(child)
        return finished

    def _append(self, request: Request, appended: Appended) -> bool:
        """Append the request's tokens and finish it if they end it; True if it ended."""
        request.output_token_ids.extend(appended.tokens)
        if appended.status is None:
            return False
        request.stop_reason = appended.stop_reason
        self.finish(request, appended.status)
        return True

    def fork(self, parent: Request, child_id: str, params: SamplingParams | None = None,
             num_computed: int | None = None) -> Request:
        """A running copy of `parent` sharing its blocks (KVCacheManager.fork), with the
        parent's tokens so far; `num_computed` when the parent's step is not yet counted."""
        if child_id in self.requests:
            raise ValueError(request_id_in_use(child_id))
        if parent.status is not RequestStatus.RUNNING:
            raise RuntimeError(f"cannot fork {parent.request_id!r}: it is {parent.status.value}")
        child = forked_request(parent, child_id, params, num_computed)
        parent.fork_root = child.fork_root
        self.kv.fork(parent, child)
        child.status = RequestStatus.RUNNING
        self.requests[child_id] = child
        self.running.append(child)
        return child

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
