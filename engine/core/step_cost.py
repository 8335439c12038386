"""How long a step will take, learned from the steps the engine has run.

A step's time is close to linear in three things: a fixed cost (every weight is read once, the
step's bookkeeping), its tokens (each goes through every matmul) and its attention work (each
new token reads the keys and values of its context). `StepCostModel` fits

    seconds = fixed + per_token * tokens + per_context * context

by least squares over the last `WINDOW` steps, refitted every `REFIT_EVERY` steps, so it follows
the model, the machine and its load without being told any of them. The scheduler asks it how
much low-priority work fits in a step of a given length.

One line through steps of every size misses most where the scheduler needs it: at small steps
(on a CPU a few tokens cost little more than one, the weights being read once either way); and
a streamed token waits on more than the model: the whole engine iteration, whose outputs (and
the other threads that take them) grow with its batch. So each kind of step the scheduler names
as it schedules it (an idle realtime step, a step sized for realtime requests) also keeps how
far its iterations' times have lately been from the line, `bias(kind)`, a moving average of
their ratio, by which the scheduler scales what the line says for steps of that kind. A refit
keeps what each kind's steps took: its bias is re-expressed against the new line at the last
step of that kind, so that idle steps measured long ago (none run while batch work is present)
stay what they were, wherever the batch's steps have since moved the line.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

WINDOW = 256
REFIT_EVERY = 16
# The weight of a step in its kind's moving average of time over prediction (see `bias`).
BIAS_WEIGHT = 0.1
# Fewer steps than this, or a first fit that says more work takes less time, predict nothing:
# the caller then falls back to its token budget.
MIN_STEPS = 32


@dataclass(frozen=True)
class StepWork:
    """What a step computes: `tokens` new tokens, which attend `context` keys in all."""

    tokens: int = 0
    context: int = 0

    def __add__(self, other: StepWork) -> StepWork:
        return StepWork(self.tokens + other.tokens, self.context + other.context)

    @staticmethod
    def of_chunk(start: int, num_new: int) -> StepWork:
        """New tokens at positions start .. start + num_new - 1; position i attends i + 1 keys."""
        return StepWork(num_new, num_new * start + num_new * (num_new + 1) // 2)


@dataclass(frozen=True)
class StepCost:
    fixed: float  # seconds
    per_token: float
    per_context: float

    def seconds(self, work: StepWork) -> float:
        return self.fixed + self.per_token * work.tokens + self.per_context * work.context


class StepCostModel:
    def __init__(self) -> None:
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)
        self._since_fit = 0
        self.cost: StepCost | None = None  # None until fitted on enough, and sensible
        self._bias: dict[str, float] = {}
        self._last_work: dict[str, StepWork] = {}  # each kind's last step, where its bias holds

    def observe(self, work: StepWork, seconds: float) -> None:
        """A step of `work` ran the model for `seconds`."""
        self._steps.append((work.tokens, work.context, seconds))
        self._since_fit += 1
        if len(self._steps) >= MIN_STEPS and self._since_fit >= REFIT_EVERY:
            self._since_fit = 0
            # A window that tells nothing (steps all alike: a run of realtime steps of one size)
            # keeps the last fit: it knew more than nothing.
            fitted = self._fit()
            if fitted is not None and self.cost is not None:
                for kind, at in self._last_work.items():
                    self._bias[kind] *= self.cost.seconds(at) / fitted.seconds(at)
            self.cost = fitted or self.cost

    def observe_iteration(self, kind: str, work: StepWork, seconds: float) -> None:
        """A step of `work`, of the scheduler's `kind`, took `seconds` from its start to the
        next's, which followed it at once."""
        if self.cost is None:
            return
        ratio = seconds / self.cost.seconds(work)
        last = self._bias.get(kind)
        self._bias[kind] = ratio if last is None else last + BIAS_WEIGHT * (ratio - last)
        self._last_work[kind] = work

    def bias(self, kind: str) -> float:
        """How many times what the fit says steps of this kind have lately taken; 1.0 before
        any."""
        return self._bias.get(kind, 1.0)

    def _fit(self) -> StepCost | None:
        data = np.array(self._steps, dtype=np.float64)
        design = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        # Columns of one size, so that the rank test means something.
        scale = np.maximum(np.abs(design).max(axis=0), 1.0)
        solution, _, rank, _ = np.linalg.lstsq(design / scale, data[:, 2], rcond=None)
        fixed, per_token, per_context = (float(x) for x in solution / scale)
        if rank < 3 or per_token <= 0:  # steps all alike, or noise: the fit knows nothing yet
            return None
        # A context term the steps cannot tell from noise is left out, never made negative.
        return StepCost(max(fixed, 0.0), per_token, max(per_context, 0.0))
