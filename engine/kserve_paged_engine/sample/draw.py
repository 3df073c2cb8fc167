"""The arithmetic of one draw, row by row: the cut-off that combines top-k, top-p and min-p,
the draw among a row's candidates, and the inverse-CDF search (engine/kserve_paged_engine/sample/sampler.py says
why it is built this way: the same bits for a row whatever else is in the batch).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Bounds past which top_p / min_p round to 1.0 / 0.0 in float32, i.e. are no filter at all.
TOP_P_OFF = 1.0 - 2.0**-25
MIN_P_OFF = 2.0**-150


def take_rows(src: Tensor, index: Tensor, out: Tensor) -> Tensor:
    """``src[index]`` written into ``out``.

    ``gather`` with a broadcast index: on CPU ``index_select`` copies large float rows many
    times slower.
    """
    return torch.gather(src, 0, index.unsqueeze(1).expand(-1, src.shape[1]), out=out)


def search(cdf: Tensor, u: Tensor) -> Tensor:
    """Position in each row of ``cdf`` (non-decreasing) where the mass ``u * total`` falls.

    The first position whose cumulative value exceeds the target has positive weight, so
    masked-out (zero-weight) entries are never picked.
    """
    total = cdf[:, -1]
    target = (u * total.double()).to(cdf.dtype)
    # Rounding may lift the target to the total itself; keep it strictly inside.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    if cdf.shape[1] <= 4096:
        # Same answer; cheaper than searchsorted's per-call threading on small rows.
        pos = (cdf <= target.unsqueeze(1)).sum(1)
    else:
        pos = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    # Only a row with no mass at all (NaN logits) gets here out of range: stay in bounds.
    return pos.clamp_(max=cdf.shape[1] - 1)


def cutoffs(vals: Tensor, k: Tensor, p: Tensor, min_p: Tensor,
             complete: bool, any_p: bool | None = None) -> tuple[Tensor, Tensor]:
    """Per-row probability cut-off combining top-k, top-p and min-p, and whether it holds.

    ``vals`` holds each row's largest probabilities in descending order (all of them when
    ``complete``). Ties at a cut-off are all kept, which makes the kept set independent of how
    ``topk`` ordered equal values. A row is resolved (``ok``) when everything at or above its
    cut-off is among ``vals``. ``any_p``: whether some row has top-p, when the caller knows
    it on the host (else it is read from ``p``: a device sync).
    """
    width = vals.shape[1]
    has_k = k > 0
    thr_k = vals.gather(1, (k.clamp(1, width) - 1).unsqueeze(1)).squeeze(1)
    thr_k = torch.where(has_k, thr_k, torch.zeros_like(thr_k))
    ok = torch.ones_like(has_k)
    if not complete:
        # Top-k's mass is only known when its tie run ends inside the candidates.
        ok &= ~has_k | ((k <= width) & (vals[:, -1] < thr_k))
    thr = thr_k
    has_p = p < 1.0
    if any_p if any_p is not None else bool(has_p.any()):
        kept = vals * (vals >= thr_k.unsqueeze(1))
        cum = kept.cumsum(1)
        # Without top-k the mass is the softmax's 1 (a sum over the row would cost a pass).
        mass = torch.where(has_k, cum[:, -1], torch.ones_like(p))
        # Past the candidates, ``first`` clamps to the last one; the check below then fails.
        first = (cum < (p * mass).unsqueeze(1)).sum(1)
        thr_p = vals.gather(1, first.clamp(max=width - 1).unsqueeze(1)).squeeze(1)
        thr = torch.maximum(thr, torch.where(has_p, thr_p, torch.zeros_like(thr_p)))
    thr = torch.maximum(thr, min_p * vals[:, 0])
    if not complete:
        ok &= vals[:, -1] < thr
    return thr, ok


def draw_from_candidates(vals: Tensor, idx: Tensor, thr: Tensor, u: Tensor,
                          vocab: int) -> Tensor:
    """Draw among the candidates at or above the cut-off, taken in vocabulary order.

    Vocabulary order (not ``topk``'s, which leaves the order of equal values open) makes the
    drawn token a function of the row's probabilities and ``u`` alone.
    """
    kept = vals >= thr.unsqueeze(1)
    key = torch.where(kept, idx, torch.full_like(idx, vocab))
    key, order = key.sort(1)
    weights = vals.gather(1, order) * (key < vocab)
    pos = search(weights.cumsum(1), u)
    return key.gather(1, pos.unsqueeze(1)).squeeze(1).clamp_(max=vocab - 1)
