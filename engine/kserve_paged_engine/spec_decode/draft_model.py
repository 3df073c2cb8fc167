"""The draft-model proposer: a small model of the target's vocabulary, loaded by the same
loader and run by the same `ModelRunner` on its own paged KV cache, proposes up to k tokens
per request with k decode passes batched over the speculating requests.

Each target request has a shadow `Request` here: the target's tokens, then the drafts fed to
the draft model, with the draft's own `num_computed_tokens`. Before proposing, the shadow is
synced to the target: drafts the target kept stay computed, the rest roll back
(`free_lookahead` returns their blocks), and the first pass computes what the draft has not
seen (the whole prompt at a request's first decode, chunked by the token budget, or the
bonus token after a verified step) and samples the first draft.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kserve_paged_engine.config.speculative import SpeculativeConfig
from kserve_paged_engine.core.kv_cache_manager import KVCacheManager
from kserve_paged_engine.core.request import Request
from kserve_paged_engine.core.scheduler_output import SchedulerOutput
from kserve_paged_engine.model_executor.model_loader import load_model, load_tokenizer
from kserve_paged_engine.sample.logits_processors import apply_penalties
from kserve_paged_engine.sample.sampler import GREEDY_EPS, greedy_tokens, target_probs
from kserve_paged_engine.sampling_params import SamplingParams
from kserve_paged_engine.worker.model_runner import ModelRunner

# A shadow never stops by itself: the target decides where a request ends.
_SHADOW_PARAMS = SamplingParams(max_tokens=None, ignore_eos=True)
GeneratorOf = Callable[[Request], torch.Generator | None]


def load_draft_model(config: SpeculativeConfig, target_vocab: int, target_tokenizer: Any,
                     dtype: torch.dtype, device: torch.device, seed: int) -> torch.nn.Module:
    """Load the draft after checking, from its config and tokenizer files (before any weight is
    read), that it speaks the target's vocabulary."""
    from transformers import AutoConfig

    folder = config.model
    hf = AutoConfig.from_pretrained(folder, local_files_only=True)
    vocab = getattr(hf.get_text_config(), "vocab_size", None)
    if vocab != target_vocab:
        raise ValueError(f"speculative_config: the draft model's vocab_size ({vocab}) differs "
                         f"from the target's ({target_vocab}); a draft must share its tokenizer")
    try:
        tokenizer = load_tokenizer(folder)
    except (OSError, ValueError, TypeError):
        tokenizer = None  # a folder of weights only: its ids are the target's by vocab size
    if tokenizer is not None and tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError("speculative_config: the draft model's tokenizer differs from the "
                         "target's (same vocab_size, different tokens)")
    model, _ = load_model(folder, dtype, device, "auto", seed)
    return model


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, num_speculative_tokens: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device, *,
                 max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> None:
        model.check_max_model_len(max_model_len)
        # No prefix caching: a shadow's blocks hold unverified drafts, rewritten on rollback.
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, self.kv, num_blocks, block_size, dtype, device,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  max_num_seqs=max_num_seqs, max_model_len=max_model_len)
        self.k = num_speculative_tokens
        self.budget = max_num_batched_tokens
        self.max_seqs = min(max_num_seqs, max_num_batched_tokens)
        self.max_model_len = max_model_len
        self._shadows: dict[str, Request] = {}
        self._real: dict[str, int] = {}  # a shadow's leading outputs that are the target's
        self.num_dropped = 0  # shadows dropped for want of draft blocks

    # ------------------------------------------------------------ draft KV lifetime
    def retain(self, live: set[str]) -> None:
        """Free the draft KV of every request not in `live` (finished, aborted, preempted:
        a preempted request's draft recomputes its context when it decodes again)."""
        for rid in [r for r in self._shadows if r not in live]:
            self._drop(rid)

    def release_all(self) -> None:
        self.retain(set())

    def _drop(self, rid: str) -> None:
        self.kv.free(self._shadows.pop(rid))
        del self._real[rid]

    def _sync(self, target: Request) -> Request:
        """The target's shadow with its tokens made the target's: fed drafts the target kept
        stay computed; from the first one it did not keep, the draft's KV rolls back."""
        rid = target.request_id
        shadow = self._shadows.get(rid)
        if shadow is None:
            shadow = Request(rid, list(target.prompt_token_ids), _SHADOW_PARAMS,
                             output_token_ids=list(target.output_token_ids))
            self._shadows[rid] = shadow
            self._real[rid] = target.num_output_tokens
            return shadow
        mine, theirs = shadow.output_token_ids, target.output_token_ids
        real = same = self._real[rid]
        while same < len(mine) and same < len(theirs) and mine[same] == theirs[same]:
            same += 1
        # The target's last token is always computed again: its logits give the first draft.
        shadow.num_computed_tokens = min(shadow.num_computed_tokens,
                                         shadow.num_prompt_tokens + same, target.num_tokens - 1)
        del mine[real:]
        mine.extend(theirs[real:])
        self._real[rid] = len(mine)
        self.kv.free_lookahead(shadow)
        return shadow

    # ------------------------------------------------------------ proposing
    def propose(self, batch: Sequence[tuple[Request, int]], generator_of: GeneratorOf
                ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """Drafts for each (request, at most this many tokens), and for the sampled
        (temperature > 0) requests the draft's distributions q the drafts were drawn from,
        [drafts, vocab] each: what rejection sampling divides by."""
        budget = self.budget
        first: list[tuple[Request, int]] = []  # shadow, tokens this pass
        active: list[tuple[Request, Request, int]] = []  # target, shadow, drafts wanted
        for target, room in batch[:self.max_seqs]:
            room = min(room, self.k, self.max_model_len - target.num_tokens)
            if room < 1 or budget < 1:
                continue
            shadow = self._sync(target)
            need = target.num_tokens - shadow.num_computed_tokens
            n = min(need, budget)
            room = room if n == need else 0  # a chunk of catch-up only: no drafts this step
            # Slots for this pass and the fed drafts (room - 1: the last draft is not fed).
            if not self.kv.allocate_slots(shadow, n + max(room - 1, 0)):
                self._drop(target.request_id)
                self.num_dropped += 1
                continue
            budget -= n
            first.append((shadow, n))
            if room:
                active.append((target, shadow, room))
        drafts: dict[str, list[int]] = {t.request_id: [] for t, _, _ in active}
        q_rows: dict[str, list[torch.Tensor]] = {}
        if not first:
            return drafts, {}
        logits = self._run(first)
        while active:
            self._choose(logits, active, drafts, q_rows, generator_of)
            active = [a for a in active if len(drafts[a[0].request_id]) < a[2]]
            if active:
                logits = self._run([(shadow, 1) for _, shadow, _ in active])
        return drafts, {rid: torch.stack(rows) for rid, rows in q_rows.items()}

    def _run(self, asks: list[tuple[Request, int]]) -> torch.Tensor:
        """One forward of the draft: logits of the shadows whose tokens it reaches the end of
        (in `asks` order), their computed tokens advanced."""
        out = SchedulerOutput({s.request_id: n for s, n in asks}, [s for s, _ in asks],
                              sum(n for _, n in asks))
        logits = self.runner.execute(out).logits
        for shadow, n in asks:
            shadow.num_computed_tokens += n
        return logits

    def _choose(self, logits: torch.Tensor, active: list[tuple[Request, Request, int]],
                drafts: dict[str, list[int]], q_rows: dict[str, list[torch.Tensor]],
                generator_of: GeneratorOf) -> None:
        """The next draft of each active request from its row: the argmax for greedy requests
        (with the target's penalties, so drafts match what greedy verification keeps), a
        draw from q (the request's temperature, top-k/p, min-p) for sampled ones."""
        targets = [t for t, _, _ in active]
        params = [t.sampling_params for t in targets]
        processed = apply_penalties(logits, params, [t.prompt_token_ids for t in targets],
                                    [t.output_token_ids + drafts[t.request_id] for t in targets])
        tokens = greedy_tokens(processed).tolist()
        sampled = [i for i, p in enumerate(params) if p.temperature >= GREEDY_EPS]
        if sampled:
            q = target_probs(processed[sampled], [params[i] for i in sampled])
            u = torch.tensor([float(torch.rand(1, generator=generator_of(targets[i]),
                                               dtype=torch.float64)) for i in sampled],
                             dtype=torch.float64, device=q.device)
            cdf = q.double().cumsum(1)
            picks = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True)
            picks = picks.squeeze(1).clamp_(max=q.shape[1] - 1).tolist()
            for row, i in enumerate(sampled):
                tokens[i] = picks[row]
                q_rows.setdefault(targets[i].request_id, []).append(q[row])
        for (target, shadow, _), token in zip(active, tokens):
            drafts[target.request_id].append(token)
            shadow.output_token_ids.append(token)
