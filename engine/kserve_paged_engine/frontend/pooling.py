"""Pooling requests' rows to their results: each step's hidden rows added to the request's
running pool, and when its prompt is done, the pooled vector turned into what was asked: an
embedding (cut to `dimensions`, then L2-normalised) or the classification head's logits.

Pooling requests are ordinary requests to the scheduler (max_tokens=0: they end once their
prompt is computed, and their blocks are freed), so they share its token budget and batch with
each other; only the rows they read differ.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from kserve_paged_engine.core.request import Request, RequestStatus
from kserve_paged_engine.model_executor.pooler import PoolerConfig, RunningPool, chunk_parts
from kserve_paged_engine.worker.model_runner import StepResult


class PoolingPipeline:
    def __init__(self, model: Any, config: PoolerConfig) -> None:
        self.model = model
        self.config = config
        self.pools: dict[str, RunningPool] = {}

    def collect(self, result: StepResult) -> None:
        """Add the step's hidden rows to each pooling request's running pool."""
        if result.pool_hidden is None:
            return
        parts = chunk_parts(self.config.kind, result.pool_hidden,
                            [count for _, _, count in result.pool_spans])
        for (req, start, count), part in zip(result.pool_spans, parts, strict=True):
            pool = self.pools.get(req.request_id)
            if pool is None:
                pool = self.pools[req.request_id] = RunningPool(self.config.kind,
                                                                req.num_prompt_tokens)
            pool.add(start, count, part)

    def finish(self, ended: Iterable[Request]) -> dict[str, torch.Tensor]:
        """The results (float32, on the CPU) of the pooling requests that ended with their
        prompt computed; forgets every ended request's pool."""
        done = [r for r in ended if r.pooling_params is not None]
        ready = [r for r in done if r.status is RequestStatus.FINISHED_STOPPED]
        pooled = [self.pools[r.request_id].result() for r in ready]
        self.forget(r.request_id for r in done)
        if not ready:
            return {}
        vectors = torch.stack(pooled)
        results: dict[str, torch.Tensor] = {}
        embeds = [i for i, r in enumerate(ready) if r.pooling_params.task == "embed"]
        if len(embeds) < len(ready):
            rows = [i for i in range(len(ready)) if i not in embeds]
            logits = self.model.classify(vectors[rows].to(self.model_dtype())).float().cpu()
            results.update((ready[i].request_id, row) for i, row in zip(rows, logits))
        for i in embeds:
            params = ready[i].pooling_params
            vec = vectors[i, :params.dimensions] if params.dimensions else vectors[i]
            normalize = self.config.normalize if params.normalize is None else params.normalize
            if normalize:
                vec = torch.nn.functional.normalize(vec, dim=0)
            results[ready[i].request_id] = vec.cpu()
        return results

    def model_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.pools.pop(rid, None)
