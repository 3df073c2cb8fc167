"""Expert parallelism (`--enable-expert-parallel`): a sparse layer's tokens go to the ranks
that own their experts and come back, over torch.distributed's all-to-all (gloo on CPU, NCCL
on CUDA; `TPRanks.all_to_all`).

Under tensor parallelism every rank holds the whole batch's hidden states (attention ends in
an all-reduce), so each rank dispatches only its contiguous share of the tokens: rank r sends
its tokens' (token, expert) pairs to the experts' owners (moe_layout.py: contiguous runs of
experts), each owner runs its experts over the rows it received and sends each row's output
back, and rank r weights and sums its tokens' k outputs. An all-reduce of the rank's share
(zeros elsewhere: exact) puts the whole batch back on every rank for the residual.

Per sparse layer: four all-to-alls (pair counts, expert ids, rows out, outputs back) and one
all-reduce. The counts and ids are exchanged, not derived from the replicated routing, so the
same exchange serves ranks that hold different tokens (data-parallel attention).
The sums follow the unsharded layer's order (each token's pairs by expert id), so expert
parallelism changes only which rows share a GEMM.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kserve_paged_engine.distributed.ranks import TPRanks
from kserve_paged_engine.model_executor.tp_layout import split

# The owner's computation: rows `[R, hidden]`, each row's local expert `[R]` -> `[R, hidden]`.
LocalExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertDispatch:
    """The exchange of one sparse layer: `num_experts` spread over `tp`'s ranks."""

    def __init__(self, tp: TPRanks, num_experts: int) -> None:
        self.tp = tp
        self.num_experts = num_experts
        world = tp.world_size
        base, extra = divmod(num_experts, world)
        # split()'s rule: the first `extra` ranks own base + 1 experts, the others base.
        self._big, self._base, self._cut = base + 1, base, extra * (base + 1)

    def owner(self, experts: torch.Tensor) -> torch.Tensor:
        """The rank that owns each expert id."""
        big = torch.div(experts, self._big, rounding_mode="floor")
        if self._base == 0:
            return big
        small = (self._cut // self._big) + torch.div(experts - self._cut, self._base,
                                                     rounding_mode="floor")
        return torch.where(experts < self._cut, big, small)

    def first_expert(self, ranks: torch.Tensor) -> torch.Tensor:
        """Each rank's first expert id."""
        return ranks * self._base + torch.clamp(ranks, max=self._cut // self._big)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 run_local: LocalExperts) -> torch.Tensor:
        """x `[T, hidden]` (every rank the same), its routing `weights`/`experts` `[T, k]` ->
        the layer's output `[T, hidden]` on every rank."""
        tp, world = self.tp, self.tp.world_size
        start, count = split(x.shape[0], world, tp.rank)
        top_k = experts.shape[1]
        flat = experts[start:start + count].flatten()  # this rank's (token, slot) pairs
        order = torch.argsort(flat, stable=True)  # by expert id, hence by owner
        picked = flat[order]
        dest = self.owner(picked)
        send = torch.bincount(dest, minlength=world)
        recv = torch.empty_like(send)
        tp.all_to_all(recv, send)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        received = sum(recv_splits)
        ids = torch.empty(received, dtype=picked.dtype, device=picked.device)
        tp.all_to_all(ids, picked - self.first_expert(dest), recv_splits, send_splits)
        tokens = order // top_k
        rows = x.new_empty(received, x.shape[1])
        tp.all_to_all(rows, x[start:start + count][tokens], recv_splits, send_splits)
        done = run_local(rows, ids)
        back = x.new_empty(flat.shape[0], x.shape[1])
        tp.all_to_all(back, done, send_splits, recv_splits)
        out = torch.zeros_like(x)
        y = back * weights[start:start + count].flatten()[order, None]
        out.index_add_(0, start + tokens, y.to(out.dtype))
        return tp.all_reduce(out)
