"""A rate (units per second) measured from the engine's own work, with a default until the
first measurement: what the swap-or-recompute choice at preemption reads (engine/kserve_paged_engine/core/kv_tier/swap.py).

An exponentially weighted mean of recent (amount, seconds) pairs: one slow disk write or one
prefill on a cold cache moves it, but does not decide alone.
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT = 0.25  # the newest measurement's share of the mean


@dataclass(slots=True)
class MeasuredRate:
    value: float  # units per second (the default until `measured`)
    measured: bool = False

    def observe(self, amount: float, seconds: float) -> None:
        """One measurement: `amount` units done in `seconds` (ignored if either is not > 0)."""
        if amount <= 0 or seconds <= 0:
            return
        rate = amount / seconds
        self.value = rate if not self.measured else (1 - WEIGHT) * self.value + WEIGHT * rate
        self.measured = True

    def seconds_for(self, amount: float) -> float:
        return amount / self.value
