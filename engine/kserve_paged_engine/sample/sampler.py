"""Picks the next token of every running request from one step's logits.

Semantics follow vLLM: temperature below ``GREEDY_EPS`` is greedy argmax; otherwise the logits
are divided by the temperature, then top-k (0: off), top-p (the smallest set of most likely
tokens whose mass reaches p; the top token is always kept) and min-p (keep tokens whose
probability is at least ``min_p`` times the largest) restrict the candidates, and one token is
drawn. While a request has fewer than ``min_tokens`` outputs its EOS and stop tokens get -inf.

Why it is built this way (it runs every engine step, up to 256 rows x ~50k vocab on CPU):

* One Python pass over the rows classifies them; an all-greedy batch is a single argmax.
* Sampling is by inverse CDF: one uniform number per row, a cumulative sum and a binary
  search. An exponential race would need a random number per vocabulary entry, which costs
  more than everything else here together on CPU.
* Every filter is a threshold on the row's probabilities, so top-k, top-p and min-p combine
  into one per-row cut-off. Filtered rows find it among the row's ``topk`` candidates (64
  first; wider looks, and a full sort only for rows whose cut-off lies beyond 4096
  candidates) and draw among those candidates: no full sort in the common case.
* Reproducible seeds: a row's token depends only on its own logits and its uniform number, and
  a seeded row draws that number from its own generator. Every operation on a row gives the
  same bits whatever else is in the batch: division is exact, softmax, topk and cumsum work
  row by row, a row's path through the code depends only on the row, and candidates are put
  back in vocabulary order before the cumulative sum, so tie order inside ``topk`` does not
  matter. Rows without a seed share the sampler's generator. Checked on CPU; CUDA kernels
  may reduce differently for different batch sizes.
* On the GPU path (`ladder=False`) filtered rows skip the ladder for the full sort: the
  ladder's climb reads on the host which rows are resolved, a device sync per rung, and the
  step's one sync is the read-back of its tokens (engine/kserve_paged_engine/model_executor/host_io.py). Lists
  reach the device through pinned memory (`upload`), uniform numbers included.
* Big scratch tensors are kept between calls: allocating 50 MB every step costs more in page
  faults than the arithmetic on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kserve_paged_engine.limits import past_min_tokens
from kserve_paged_engine.model_executor.host_io import upload
from kserve_paged_engine.sample.draw import (
    MIN_P_OFF,
    TOP_P_OFF,
    cutoffs,
    draw_from_candidates,
    search,
    take_rows,
)
from kserve_paged_engine.sampling_params import SamplingParams
from kserve_paged_kernels import cpu_native

# Temperatures below this are treated as greedy (as vLLM does): dividing by them overflows.
GREEDY_EPS = 1e-5

# Candidate counts tried for filtered rows. A row starts at the first that exceeds its top_k
# (64 without top_k) and, while its cut-off lies beyond, climbs one rung; past the end it is
# sorted in full. Steps of 4x: topk's cost grows slowly with the count, so a wasted rung is
# cheap. The path depends on nothing but the row, so a row always takes the same path.
_LADDER = (64, 256, 1024, 4096)

_SEED_MASK = (1 << 64) - 1


def make_generator(seed: int | None) -> torch.Generator | None:
    """The per-request generator the engine keeps for a request's lifetime (None: no seed)."""
    if seed is None:
        return None
    # torch takes seeds in [-2**63, 2**64); any Python int the API accepts is folded into it.
    return torch.Generator(device="cpu").manual_seed(seed & _SEED_MASK)


def greedy_tokens(logits: Tensor) -> Tensor:
    """Row-wise argmax (int64), torch's tie and NaN rules. On CPU fp32 one native vector pass,
    several times faster than torch's argmax over a large vocabulary (BENCHMARKS.md)."""
    if logits.device.type == "cpu":
        out = cpu_native.argmax_rows(logits)
        if out is not None:
            return out
    return logits.argmax(-1)


@dataclass(slots=True)
class _RowPlan:
    """How each non-greedy row of a step is drawn (indices: position among those rows)."""

    temps: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    u: Tensor  # float64 on the host: its uniform number
    plain: list[int]  # no top-k/top-p/min-p: drawn from the whole row
    ladder: dict[int, list[int]]  # candidate count -> rows starting there
    bans: list[tuple[int, list[int]]]  # min_tokens: tokens at -inf


class Sampler:
    """Batched sampler; one per engine, called once per step."""

    def __init__(self, seed: int = 0, ladder: bool = True) -> None:
        # False on the GPU path: filtered rows go straight to the full sort, whose draw needs
        # no host read (the ladder's climb asks the host which rows are done: a sync).
        self.ladder = ladder
        # Shared by every row that has no seed of its own.
        self.generator = torch.Generator(device="cpu").manual_seed(seed & _SEED_MASK)
        self._scratch: dict[str, Tensor] = {}

    def _buffer(self, name: str, rows: int, like: Tensor) -> Tensor:
        """A reused [rows, vocab] float scratch tensor (grown, never shrunk)."""
        buf = self._scratch.get(name)
        vocab = like.shape[1]
        if (buf is None or buf.shape[0] < rows or buf.shape[1] != vocab
                or buf.device != like.device or buf.dtype != like.dtype):
            cap = max(rows, buf.shape[0] if buf is not None and buf.shape[1] == vocab else 0)
            buf = torch.empty((cap, vocab), dtype=like.dtype, device=like.device)
            self._scratch[name] = buf
        return buf[:rows]

    def _rows(self, name: str, src: Tensor, rows: list[int], all_rows: bool) -> Tensor:
        """``src[rows]`` copied into scratch ``name``, or ``src`` itself when it is every row."""
        if all_rows:
            return src
        index = upload(rows, torch.long, src.device)
        return take_rows(src, index, self._buffer(name, len(rows), src))

    def sample(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        num_output_tokens: Sequence[int],
        eos_token_ids: Sequence[int | None],
    ) -> Tensor:
        """Next token id of each row (int64 [N]). ``logits`` ([N, V], float32 preferred: other
        dtypes are converted for sampled rows) is not modified.

        ``generators[i]`` is row i's own generator (``make_generator(seed)``, CPU), reused
        every step; ``num_output_tokens[i]`` counts the outputs before this step.
        """
        n, vocab = logits.shape
        device = logits.device
        if n == 0:
            return torch.empty(0, dtype=torch.long, device=device)

        # The only per-row Python work: classify rows and collect min_tokens bans.
        greedy: list[int] = []
        sampled: list[int] = []
        banned: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            if p.temperature < GREEDY_EPS:
                greedy.append(i)
            else:
                sampled.append(i)
            if not past_min_tokens(num_output_tokens[i], p.min_tokens):
                eos = eos_token_ids[i]
                toks = [t for t in p.stop_token_ids if t < vocab]
                if eos is not None and 0 <= eos < vocab:
                    toks.append(eos)
                if toks:
                    banned[i] = toks
        if not sampled and not banned:
            return greedy_tokens(logits)

        out = torch.empty(n, dtype=torch.long, device=device)
        if greedy:
            rows = self._rows("aux", logits, greedy, len(greedy) == n)
            bans = [(j, banned[i]) for j, i in enumerate(greedy) if i in banned]
            if bans:
                if rows is logits:
                    rows = torch.clone(logits)  # all greedy, some banned: keep the input intact
                self._ban(rows, bans)
            if len(greedy) == n:
                return greedy_tokens(rows)
            out[upload(greedy, torch.long, device)] = greedy_tokens(rows)

        self._sample_rows(logits, sampled, params, generators, banned, out)
        return out

    @staticmethod
    def _ban(rows: Tensor, bans: list[tuple[int, list[int]]]) -> None:
        r = [j for j, toks in bans for _ in toks]
        t = [tok for _, toks in bans for tok in toks]
        rows[upload(r, torch.long, rows.device), upload(t, torch.long, rows.device)] = (
            float("-inf"))

    def _sample_rows(
        self,
        logits: Tensor,
        sampled: list[int],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        banned: dict[int, list[int]],
        out: Tensor,
    ) -> None:
        """Draw the non-greedy rows `sampled` into `out`: per-row settings and uniform numbers
        first (`_plan`), then the probabilities of all of them at once, then each row's draw
        among its candidates (the ladder) or its whole row."""
        if logits.dtype != torch.float32:
            logits = logits.float()  # half-precision cumulative sums would be too coarse
        device = logits.device
        plan = self._plan(sampled, params, generators, banned, logits.shape[1])
        w = self._probabilities(logits, sampled, plan)
        s = len(sampled)

        def col(values: list, dtype: torch.dtype) -> Tensor:
            return upload(values, dtype, device)

        cols = (col(plan.top_k, torch.long), col(plan.top_p, logits.dtype),
                col(plan.min_p, logits.dtype), upload(plan.u, torch.float64, device))
        picked_rows: list[Tensor] = []
        picked_toks: list[Tensor] = []
        # Rows drawn from the whole row, with their cut-offs (0 keeps everything).
        full_rows: list[Tensor] = []
        full_thr: list[Tensor] = []
        if plan.plain:
            full_rows.append(upload(plan.plain, torch.long, device))
            full_thr.append(torch.zeros(len(plan.plain), dtype=w.dtype, device=device))
        from_plain = len(full_rows)
        self._draw_ladder(w, plan.ladder, cols, plan.top_p, picked_rows, picked_toks, full_rows,
                          full_thr)
        if full_rows:
            rows_f = torch.cat(full_rows)
            thr = torch.cat(full_thr)
            sorted_rows = len(full_rows) > from_plain  # rows the ladder sent to a full sort
            every = not sorted_rows and plan.plain == list(range(s))
            sub = w if every else take_rows(w, rows_f, self._buffer("aux", rows_f.numel(), w))
            if sorted_rows:
                # Only rows that needed a full sort have a cut-off here (rare and already slow).
                sub.masked_fill_(sub < thr.unsqueeze(1), 0.0)
            picked_rows.append(rows_f)
            picked_toks.append(search(sub.cumsum_(1), cols[3][rows_f]))
        rows_all = torch.cat(picked_rows)
        toks_all = torch.cat(picked_toks)
        dest = upload(sampled, torch.long, device)[rows_all]
        out[dest] = toks_all

    def _plan(self, sampled: list[int], params: Sequence[SamplingParams],
              generators: Sequence[torch.Generator | None], banned: dict[int, list[int]],
              vocab: int) -> _RowPlan:
        """Each sampled row's settings, its uniform number (its own generator's, or one of the
        shared generator's draws), and where its draw starts."""
        plan = _RowPlan([], [], [], [], torch.zeros(len(sampled), dtype=torch.float64), [],
                        {}, [])
        shared: list[int] = []
        for j, i in enumerate(sampled):
            p = params[i]
            plan.temps.append(p.temperature)
            k = p.top_k if 0 < p.top_k < vocab else 0
            plan.top_k.append(k)
            plan.top_p.append(p.top_p)
            plan.min_p.append(p.min_p)
            g = generators[i]
            if g is None:
                shared.append(j)
            else:
                plan.u[j] = torch.rand((), generator=g, dtype=torch.float64)
            if k or p.top_p < TOP_P_OFF or p.min_p > MIN_P_OFF:
                width = (next((w for w in _LADDER if w > k and w < vocab), vocab)
                         if self.ladder else vocab)
                plan.ladder.setdefault(width, []).append(j)
            else:
                plan.plain.append(j)
            if i in banned:
                plan.bans.append((j, banned[i]))
        if shared:
            draws = torch.rand(len(shared), generator=self.generator, dtype=torch.float64)
            plan.u[shared] = draws
        return plan

    def _probabilities(self, logits: Tensor, sampled: list[int], plan: _RowPlan) -> Tensor:
        """softmax(logits / T) of the sampled rows, bans applied, in scratch "w" (the scaled
        logits in "aux" on the way)."""
        s, n = len(sampled), logits.shape[0]
        scaled = self._buffer("aux", s, logits)
        temp = upload(plan.temps, logits.dtype, logits.device).unsqueeze(1)
        if s == n:
            torch.div(logits, temp, out=scaled)
        else:
            take_rows(logits, upload(sampled, torch.long, logits.device), scaled)
            scaled.div_(temp)
        if plan.bans:
            self._ban(scaled, plan.bans)
        w = self._buffer("w", s, logits)
        # The fused softmax kernel (one row per thread) into scratch: about twice as fast as
        # max/sub/exp passes over the whole tensor, and no 50 MB allocation.
        torch.ops.aten._softmax.out(scaled, 1, False, out=w)
        return w

    def _draw_ladder(self, w: Tensor, ladder: dict[int, list[int]],
                     cols: tuple[Tensor, Tensor, Tensor, Tensor], top_p: list[float],
                     picked_rows: list[Tensor],
                     picked_toks: list[Tensor], full_rows: list[Tensor],
                     full_thr: list[Tensor]) -> None:
        """Draw the filtered rows among their top candidates, climbing the ladder for rows
        whose cut-off lies beyond; rows past its end go to the full-row draw, sorted."""
        k_all, p_all, mp_all, u_all = cols
        s, vocab = w.shape
        device = w.device
        while ladder:
            width = min(ladder)
            rows_l = sorted(ladder.pop(width))
            idx_rows = upload(rows_l, torch.long, device)
            sub = self._rows("aux", w, rows_l, len(rows_l) == s)
            k, p, mp = k_all[idx_rows], p_all[idx_rows], mp_all[idx_rows]
            any_p = any(top_p[j] < TOP_P_OFF for j in rows_l)
            if width >= vocab:
                vals = torch.sort(sub, dim=1, descending=True).values
                thr, _ = cutoffs(vals, k, p, mp, complete=True, any_p=any_p)
                full_rows.append(idx_rows)
                full_thr.append(thr)
                continue
            vals, idx = torch.topk(sub, width, dim=1)
            thr, ok = cutoffs(vals, k, p, mp, complete=False, any_p=any_p)
            if bool(ok.all()):
                done = None
            else:
                done = ok.nonzero().squeeze(1)
                wider = next((x for x in _LADDER if x > width and x < vocab), vocab)
                ladder.setdefault(wider, []).extend(idx_rows[~ok].tolist())
            if done is None:
                picked_rows.append(idx_rows)
                picked_toks.append(
                    draw_from_candidates(vals, idx, thr, u_all[idx_rows], vocab))
            elif done.numel():
                picked_rows.append(idx_rows[done])
                picked_toks.append(draw_from_candidates(
                    vals[done], idx[done], thr[done], u_all[idx_rows[done]], vocab))


def target_probs(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Each row's sampling distribution (float32 [N, V]): softmax(logits / T) with top-k,
    top-p and min-p applied by the cut-off rule `Sampler` draws with, renormalised. What
    speculative verification compares drafts against (rows are sorted in full: few rows)."""
    logits = logits.float()
    temps = upload([p.temperature for p in params], torch.float32, logits.device).unsqueeze(1)
    probs = torch.softmax(logits / temps, dim=1)
    vocab = logits.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    k = upload(ks, torch.long, logits.device)
    p_top = upload([p.top_p for p in params], torch.float32, logits.device)
    mp = upload([p.min_p for p in params], torch.float32, logits.device)
    if any(ks) or any(p.top_p < TOP_P_OFF or p.min_p > MIN_P_OFF for p in params):
        vals = torch.sort(probs, dim=1, descending=True).values
        thr, _ = cutoffs(vals, k, p_top, mp, complete=True,
                         any_p=any(p.top_p < TOP_P_OFF for p in params))
        probs = probs * (probs >= thr.unsqueeze(1))
        probs = probs / probs.sum(1, keepdim=True)
    return probs
