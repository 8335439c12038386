"""OpenAI's moderation categories, the labels a classifier guard scores; the thresholds at which
a category's score flags its input; and the shape of a tenant's content-filter settings."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, field_validator

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

# Llama Guard 3's hazard codes and the OpenAI category each is reported under (codes with no
# counterpart, such as defamation or elections, are reported under none).
GUARD_CODES = {
    "S1": ("Violent Crimes", "violence"),
    "S2": ("Non-Violent Crimes", "illicit"),
    "S3": ("Sex-Related Crimes", "sexual"),
    "S4": ("Child Sexual Exploitation", "sexual/minors"),
    "S5": ("Defamation", None),
    "S6": ("Specialized Advice", None),
    "S7": ("Privacy", None),
    "S8": ("Intellectual Property", None),
    "S9": ("Indiscriminate Weapons", "illicit/violent"),
    "S10": ("Hate", "hate"),
    "S11": ("Suicide & Self-Harm", "self-harm"),
    "S12": ("Sexual Content", "sexual"),
    "S13": ("Elections", None),
    "S14": ("Code Interpreter Abuse", None),
}

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


Threshold = Annotated[float, BeforeValidator(threshold)]
Category = Literal[CATEGORIES]  # type: ignore[valid-type]
Checks = Literal["off", "input", "output", "both"]  # which way content is screened
MAX_BLOCKLIST_PATTERNS = 1000


def blocklist(patterns: list[str]) -> list[str]:
    """`patterns`, if each is a regular expression and there are not too many."""
    if len(patterns) > MAX_BLOCKLIST_PATTERNS:
        raise ValueError(f"a blocklist holds at most {MAX_BLOCKLIST_PATTERNS} patterns")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"blocklist pattern {pattern!r} is no regular expression: {e}") from e
    return patterns


class TenantSafety(BaseModel):
    """One tenant's departures from the service's content filter; what it leaves unset, it
    inherits."""

    model_config = ConfigDict(extra="forbid")

    policy: Checks | None = None
    threshold: Threshold | None = None
    categories: dict[Category, Threshold] = {}
    blocklist: list[str] | None = None

    @field_validator("blocklist")
    @classmethod
    def _patterns(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else blocklist(value)
