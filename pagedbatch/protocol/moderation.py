"""OpenAI's moderation categories, the labels a classifier guard scores, and the thresholds at
which a category's score flags its input."""

from __future__ import annotations

CATEGORIES = (
    "harassment",
    "harassment/threatening",
    "hate",
    "hate/threatening",
    "illicit",
    "illicit/violent",
    "self-harm",
    "self-harm/intent",
    "self-harm/instructions",
    "sexual",
    "sexual/minors",
    "violence",
    "violence/graphic",
)

# A level names the least severe content it filters, as content filters' levels do: `low`
# filters the most (anything scored from 0.25 up), `high` only what the guard is sure of.
LEVELS = {"low": 0.25, "medium": 0.5, "high": 0.75}


def threshold(value: object) -> float:
    """A threshold from a level's name or a number in [0, 1]; ValueError for anything else."""
    if isinstance(value, str):
        if value in LEVELS:
            return LEVELS[value]
        try:
            value = float(value)
        except ValueError:
            value = None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValueError(f"a threshold is one of {sorted(LEVELS)} or a number in [0, 1]")
    return float(value)
