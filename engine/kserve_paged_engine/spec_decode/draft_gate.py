"""Whether a draft model pays for itself in this batch, measured, so that speculation switches
itself off when it does not.

A draft step spends `t_draft` of a step of `t_step` seconds to add the kept drafts to the one
token each request gets anyway. Without the draft the step would take about `t_step - t_draft`,
so speculation pays when the kept drafts per speculating request exceed
`t_draft / (t_step - t_draft)`. The per-request pause after misses (decoder.py) cannot see
this: a draft pass costs nearly the same for one request as for many, and requests pause out
of phase, so a batch of poor drafts would still run draft passes on most steps. Over each
window of draft steps the gate sums both sides; when the kept drafts fall short, the whole
batch stops drafting for a pause that doubles while the draft keeps losing, then probes again.
N-gram drafts cost almost nothing on the host, so only the draft model is gated.
"""

from __future__ import annotations

from dataclasses import dataclass

WINDOW = 8  # draft steps per decision
PAUSE_MIN, PAUSE_MAX = 8, 256  # steps without drafting after a losing window


@dataclass(slots=True)
class DraftGate:
    pause: int = 0  # steps left without drafting
    next_pause: int = PAUSE_MIN
    num_paused_steps: int = 0  # in total, for the stats
    _gain: float = 0.0  # kept drafts per speculating request, summed over the window
    _cost: float = 0.0  # t_draft / (t_step - t_draft), summed over the window
    _steps: int = 0

    def open(self) -> bool:
        """Whether this step drafts (a pause counts down one step)."""
        if self.pause > 0:
            self.pause -= 1
            self.num_paused_steps += 1
            return False
        return True

    def record(self, draft_seconds: float, step_seconds: float, kept_per_request: float) -> None:
        """One verified step with draft-model drafts."""
        rest = step_seconds - draft_seconds
        if rest <= 0:
            return
        self._gain += kept_per_request
        self._cost += draft_seconds / rest
        self._steps += 1
        if self._steps < WINDOW:
            return
        if self._gain < self._cost:
            self.pause = self.next_pause
            self.next_pause = min(2 * self.next_pause, PAUSE_MAX)
        else:
            self.next_pause = PAUSE_MIN
        self._gain = self._cost = 0.0
        self._steps = 0
