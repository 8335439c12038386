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
as it schedules it keeps what its iterations have lately taken: an idle step (one realtime
decode alone), `recent_seconds(IDLE)`, the measure a sized step is held to; a step sized for
realtime requests, `offset(SIZED)`, how much longer than the line, in seconds, which the
scheduler adds to what the line says for the next. An offset, not a ratio: what the line misses
at a small step is mostly a fixed cost, which a ratio would wrongly scale with the step's tokens.
Sized steps average their last few, so that the scheduler, steering each step by the last ones'
error, reaches its budget within a few steps wherever the line's slope is wrong. A refit
re-expresses each kind's offset against the new line at that kind's last step, so that what
those steps took stays what it was, wherever other steps have since moved the line.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

WINDOW = 256
REFIT_EVERY = 16
# The kinds of step the scheduler names: steps sized for realtime requests, and idle steps (one
# realtime decode and nothing else), which a sized step is measured against.
SIZED, IDLE = "sized", "idle"
# The weight of a step in its kind's moving averages (`offset`, `recent_seconds`): the
# scheduler steers sized steps by the last few; idle ones, long measured, by the last ten or so.
OFFSET_WEIGHTS = {SIZED: 0.5, IDLE: 0.1}
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
        self._offset: dict[str, float] = {}
        self._seconds: dict[str, float] = {}
        self._last_work: dict[str, StepWork] = {}  # each kind's last step, where its offset holds
        # Each kind's iterations so far: how many, and their seconds in all (for reports).
        self.iterations: dict[str, int] = {}
        self.iteration_seconds: dict[str, float] = {}

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
                    self._offset[kind] += self.cost.seconds(at) - fitted.seconds(at)
            self.cost = fitted or self.cost

    def observe_iteration(self, kind: str, work: StepWork, seconds: float) -> None:
        """A step of `work`, of the scheduler's `kind`, took `seconds` from its start to the
        next's, which followed it at once."""
        self.iterations[kind] = self.iterations.get(kind, 0) + 1
        self.iteration_seconds[kind] = self.iteration_seconds.get(kind, 0.0) + seconds
        weight = OFFSET_WEIGHTS[kind]
        last = self._seconds.get(kind)
        self._seconds[kind] = seconds if last is None else last + weight * (seconds - last)
        if self.cost is None:
            return
        beyond = seconds - self.cost.seconds(work)
        last = self._offset.get(kind)
        self._offset[kind] = beyond if last is None else last + weight * (beyond - last)
        self._last_work[kind] = work

    def recent_seconds(self, kind: str) -> float | None:
        """What steps of this kind have lately taken, from start to the next's start; None
        before any."""
        return self._seconds.get(kind)

    def offset(self, kind: str) -> float:
        """Seconds that steps of this kind have lately taken beyond what the fit says (less,
        where negative); 0.0 before any."""
        return self._offset.get(kind, 0.0)

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
