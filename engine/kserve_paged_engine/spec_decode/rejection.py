"""Verification: which draft tokens a request keeps, and the token it adds after them.

Row j of a request's verification logits is the target model's next-token distribution after
the context and the first j drafts; there is one row more than drafts (the bonus row).

Greedy: keep drafts while each equals the target's argmax, then append the target's argmax at
the first mismatch (or the bonus row): exactly the tokens plain greedy decoding produces.

Sampling (Leviathan et al. 2023, Chen et al. 2023): keep draft d_j with probability
min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw from norm(max(0, p_j - q_j)) and stop;
if all are kept draw the bonus token from p_k. The output is distributed as p exactly. An
n-gram draft is a point mass (q_j = one-hot of d_j), which `draft_probs=None` stands for.
"""

from __future__ import annotations

import torch
from torch import Tensor


def accept_greedy(targets: list[int], drafts: list[int]) -> list[int]:
    """`targets[j]`: the target's argmax at row j (len(drafts) + 1 rows)."""
    out: list[int] = []
    for j, draft in enumerate(drafts):
        out.append(targets[j])
        if targets[j] != draft:
            return out
    out.append(targets[len(drafts)])
    return out


def rejection_sample(target: Tensor, drafts: list[int], draft_probs: Tensor | None,
                     generator: torch.Generator | None) -> list[int]:
    """Tokens appended: the kept drafts, then one drawn token. `target`: [k + 1, V]
    probabilities; `draft_probs`: [k, V] (None: each draft a point mass). One uniform per
    draft for its test and one for the final draw, taken from `generator` in one call."""
    k = len(drafts)
    u = torch.rand(k + 1, generator=generator, dtype=torch.float64).tolist()
    rows = torch.arange(k, device=target.device)
    index = torch.tensor(drafts, dtype=torch.long, device=target.device)
    p = target[rows, index].tolist()
    q = [1.0] * k if draft_probs is None else draft_probs[rows, index].tolist()
    for j in range(k):
        if u[j] * q[j] < p[j]:  # u < min(1, p / q), without dividing by a zero q
            continue
        if draft_probs is None:
            residual = target[j].clone()
            residual[drafts[j]] = 0.0
        else:
            residual = (target[j] - draft_probs[j]).clamp_(min=0.0)
        return drafts[:j] + [_draw(residual, u[k], target[j])]
    return drafts + [_draw(target[k], u[k], None)]


def _draw(weights: Tensor, u: float, fallback: Tensor | None) -> int:
    """Inverse CDF of the (unnormalised) weights at u; the fallback where they hold no mass
    (p all on a rejected draft, which the acceptance test makes impossible: a guard). The
    search runs on the weights' device, its point `u * total` computed there too (no host
    value in a device search), and the total and the position come back in one read."""
    cdf = weights.double().cumsum(0)
    total = cdf[-1:]
    pos = torch.searchsorted(cdf, total * u, right=True)
    mass, at = torch.cat([total, pos.double()]).tolist()
    if mass <= 0.0 and fallback is not None:
        return _draw(fallback, u, None)
    return min(int(at), weights.numel() - 1)
