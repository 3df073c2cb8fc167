"""Parallel samples (`n > 1`): one child request per sample, folded back into one output.

The engine adds the first child only; when its prompt is computed and it samples, the others
fork from it (Scheduler.fork) with every block shared, the partial last one included until a
sample writes into it (copy-on-write), so the prompt is computed and held once.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from kserve_paged_engine.outputs import CompletionOutput, RequestOutput
from kserve_paged_engine.sampling_params import SamplingParams

# Joins a parent request id and a sample number into a child id that users do not type.
CHILD_SEP = "\x1f"


@dataclass(slots=True)
class _Parent:
    """An n > 1 request: its children and what they produced so far."""

    children: list[str]
    latest: dict[int, CompletionOutput] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    error: str | None = None
    error_status: int | None = None


class Forks:
    """The parent/child bookkeeping of every live n > 1 request."""

    def __init__(self) -> None:
        # Both public so that callers test them for emptiness before calling in: a request of
        # n = 1 never enters this file.
        self.parents: dict[str, _Parent] = {}
        self._child_of: dict[str, tuple[str, int]] = {}
        # First child id -> the (child id, params) still to fork from it.
        self.pending: dict[str, list[tuple[str, SamplingParams]]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.parents

    @staticmethod
    def children(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
        """The child ids and their params (n = 1, seeds counted up from the parent's)."""
        out = []
        for i in range(params.n):
            child = copy.copy(params)
            child.n = 1
            if params.seed is not None:
                child.seed = params.seed + i
            out.append((f"{request_id}{CHILD_SEP}{i}", child))
        return out

    def register(self, request_id: str, children: list[str],
                 pending: list[tuple[str, SamplingParams]] | None = None) -> None:
        """Record a parent and its children; `pending` are to fork from the first one."""
        for i, child in enumerate(children):
            self._child_of[child] = (request_id, i)
        self.parents[request_id] = _Parent(list(children))
        if pending:
            self.pending[children[0]] = list(pending)

    def take_pending(self, request_id: str) -> list[tuple[str, SamplingParams]]:
        """The children still to fork from this one (handed over once)."""
        return self.pending.pop(request_id, [])

    def expand(self, request_ids: list[str]) -> list[str]:
        """The ids to abort for these: a parent stands for its children (and is forgotten)."""
        expanded: list[str] = []
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            if parent is None:
                expanded.append(rid)
                continue
            expanded.extend(parent.children)
            for child in parent.children:
                self._child_of.pop(child, None)
                self.pending.pop(child, None)
        return expanded

    def merge(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Fold the outputs of children into one output per parent request.

        A parent's output lists the samples that progressed in this step (index = sample
        number); its final output lists all n samples.
        """
        if not self._child_of:
            return outputs
        merged: list[RequestOutput] = []
        by_parent: dict[str, RequestOutput] = {}
        for out in outputs:
            link = self._child_of.get(out.request_id)
            if link is None:
                merged.append(out)
                continue
            parent_id, index = link
            parent = self.parents[parent_id]
            completion = out.outputs[0]
            completion.index = index
            parent.latest[index] = completion
            if out.finished:
                parent.finished.add(index)
                del self._child_of[out.request_id]
            if out.error and parent.error is None:
                parent.error, parent.error_status = out.error, out.error_status
            agg = by_parent.get(parent_id)
            if agg is None:
                agg = by_parent[parent_id] = RequestOutput(
                    parent_id, out.prompt, out.prompt_token_ids, [], False,
                    out.num_cached_tokens, out.metrics, prompt_logprobs=out.prompt_logprobs)
                merged.append(agg)
            agg.outputs.append(completion)
        for parent_id, agg in by_parent.items():
            parent = self.parents[parent_id]
            if len(parent.finished) == len(parent.children):
                progressed = {c.index for c in agg.outputs}
                for index, completion in sorted(parent.latest.items()):
                    if index not in progressed:
                        agg.outputs.append(dataclasses.replace(
                            completion, delta_text="", delta_token_ids=[]))
                agg.outputs.sort(key=lambda c: c.index)
                agg.finished = True
                agg.error, agg.error_status = parent.error, parent.error_status
                del self.parents[parent_id]
        return merged
