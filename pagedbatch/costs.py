"""What usage costs at the operator's prices: per model, USD per million input, cached input and
output tokens, batch tokens at the batch discount.

Costs are split into line items as OpenAI's costs API splits them: a model's uncached input,
cached input and output, each once for realtime requests and once for batch lines
("tiny, input", "tiny, input (batch)", ...). A model without a price costs 0 and says so: its
line items keep their token quantities, with an amount of 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

PER_TOKENS = 1_000_000  # prices are per million tokens


class ModelPrice(BaseModel):
    """USD per million tokens."""

    model_config = ConfigDict(extra="forbid")

    input: float = Field(ge=0, le=1e6)
    cached_input: float | None = Field(None, ge=0, le=1e6)  # None: the input price
    output: float = Field(ge=0, le=1e6)


def prices_from(value: Any) -> Any:
    """The prices setting: inline JSON, or the path of a JSON file holding it."""
    if isinstance(value, str) and not value.lstrip().startswith("{"):
        try:
            return json.loads(Path(value).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"prices: {value} is no JSON file ({e})") from e
    if isinstance(value, str):
        return json.loads(value)
    return value


@dataclass(frozen=True)
class LineItem:
    name: str
    tokens: int
    usd: float


def line_items(
    model: str,
    batch: bool,
    tokens: tuple[int, int, int],
    prices: dict[str, ModelPrice],
    discount: float,
) -> list[LineItem]:
    """The line items of `tokens` (input, of which cached, and output) of one model, realtime or
    batch."""
    input_tokens, cached, output = tokens
    price = prices.get(model)
    factor = discount if batch else 1.0
    suffix = " (batch)" if batch else ""
    per_token = {"input": 0.0, "cached input": 0.0, "output": 0.0}
    if price is not None:
        cached_price = price.cached_input if price.cached_input is not None else price.input
        per_token = {"input": price.input, "cached input": cached_price, "output": price.output}
    counts = {"input": input_tokens - cached, "cached input": cached, "output": output}
    return [
        LineItem(f"{model}, {kind}{suffix}", count, count * per_token[kind] * factor / PER_TOKENS)
        for kind, count in counts.items()
        if count
    ]
