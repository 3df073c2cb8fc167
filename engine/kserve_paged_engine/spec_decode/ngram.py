"""Prompt lookup: the draft is what followed the latest earlier occurrence of the context's
last n tokens (n from prompt_lookup_max down to prompt_lookup_min). No model, a few numpy
passes over the request's tokens on the host."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class NgramProposer:
    num_speculative_tokens: int
    min_n: int
    max_n: int

    def propose(self, tokens: list[int], max_draft: int | None = None) -> list[int]:
        """Up to k draft tokens continuing `tokens`, or [] when no n-gram of the allowed sizes
        recurs. The longest matching n wins; among its matches, the latest."""
        k = self.num_speculative_tokens if max_draft is None else min(
            max_draft, self.num_speculative_tokens)
        size = len(tokens)
        if k < 1 or size < self.min_n + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        # Candidate ends: earlier positions holding the last token (the match's last token).
        ends = np.flatnonzero(arr[:-1] == arr[-1])
        best: tuple[int, int] | None = None  # (n, end)
        n = 1
        while ends.size and n <= self.max_n:
            if n >= self.min_n:
                best = (n, int(ends[-1]))
            if n == self.max_n:
                break
            # Extend the match one token to the left where the context allows.
            ends = ends[ends >= n]
            ends = ends[arr[ends - n] == arr[size - 1 - n]]
            n += 1
        if best is None:
            return []
        start = best[1] + 1
        return arr[start:start + k].tolist()
