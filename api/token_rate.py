"""A rate from a running total, sampled when someone asks (a status-page refresh), so nothing
runs while nobody looks."""

from __future__ import annotations

from collections import deque

WINDOW_SECONDS = 10.0


class TokenRate:
    """Tokens per second over about the last `window` seconds: since the newest sample at least
    that old, or since the oldest one when there is none."""

    def __init__(self, window: float = WINDOW_SECONDS) -> None:
        self.window = window
        self._samples: deque[tuple[float, int]] = deque()

    def update(self, total: int, at: float) -> float | None:
        """Records `total` tokens at monotonic time `at`; None until there are two samples."""
        self._samples.append((at, total))
        while len(self._samples) > 1 and self._samples[1][0] <= at - self.window:
            self._samples.popleft()
        since, base = self._samples[0]
        if at <= since:
            return None
        return (total - base) / (at - since)
