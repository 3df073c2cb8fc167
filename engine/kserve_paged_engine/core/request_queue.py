"""The waiting queue and the order requests are served in (`fcfs`, or `priority`)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from kserve_paged_engine.core.request import Request


def policy_key(request: Request, policy: str) -> tuple[int, float]:
    """Sort key of the policy: smaller is served first (and preempted last)."""
    prio = request.priority if policy == "priority" else 0
    return (prio, request.arrival_time)


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

    def __iter__(self) -> Iterator[Request]:
        if self.policy == "priority":
            return (e[3] for e in sorted(self._heap))
        return iter(self._fifo)
