"""What usage costs at the operator's prices: per model, USD per million input, cached input and
output tokens, batch tokens at the batch discount.

Costs are split into line items as OpenAI's costs API splits them: a model's uncached input,
cached input and output, each once for realtime requests and once for batch lines
("tiny, input", "tiny, input (batch)", ...). A model without a price costs 0 and says so: its
line items keep their token quantities, with an amount of 0.

Spend budgets (store/reservations.py) count whole nano-dollars: `cost_nanos` of what a request
used, `worst_case_nanos` of what it may use, both rounded up.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

PER_TOKENS = 1_000_000  # prices are per million tokens
# Spend budgets count in nano-dollars: integers, which add and subtract exactly however many
# requests settle, and fine enough for prices of a thousandth of a dollar per million tokens.
NANOS_PER_USD = 10**9


class ModelPrice(BaseModel):
    """USD per million tokens."""

    model_config = ConfigDict(extra="forbid")

    input: float = Field(ge=0, le=1e6)
    cached_input: float | None = Field(None, ge=0, le=1e6)  # None: the input price
    output: float = Field(ge=0, le=1e6)


def price_adapters(prices: dict[str, ModelPrice], adapters: list[str], model: str) -> None:
    """Price each LoRA adapter of `model` that `prices` leaves out as `model` itself, in place:
    unpriced, an adapter's usage would cost nothing and pass every spend limit. An operator's
    own price for an adapter stands."""
    price = prices.get(model)
    if price is not None:
        for adapter in adapters:
            prices.setdefault(adapter, price)


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
    factor = discount if batch else 1.0
    suffix = " (batch)" if batch else ""
    return [
        LineItem(f"{model}, {kind}{suffix}", count, count * per_million * factor / PER_TOKENS)
        for kind, count, per_million in _priced(model, tokens, prices)
        if count
    ]


def cost_nanos(
    model: str,
    batch: bool,
    tokens: tuple[int, int, int],
    prices: dict[str, ModelPrice],
    discount: float,
) -> int:
    """What `tokens` (input, of which cached, and output) cost, in nano-dollars rounded up: never
    less than their line items."""
    factor = discount if batch else 1.0
    priced = _priced(model, tokens, prices)
    exact = sum(count * per_million for _, count, per_million in priced) * factor * NANOS_PER_USD
    # Rounded first to a millionth of a nano-dollar, so that float noise in a whole amount
    # (0.15 * 1000 is 150.00000000000003) does not add a nano-dollar.
    return math.ceil(round(exact / PER_TOKENS, 6))


def worst_case_nanos(
    model: str,
    batch: bool,
    prompt_tokens: int,
    output_tokens: int,
    prices: dict[str, ModelPrice],
    discount: float,
) -> int:
    """The most a request of `prompt_tokens` generating at most `output_tokens` can cost: its
    prompt at the dearer of the input and cached input prices (which of its tokens the prefix
    cache holds is known only once it runs)."""
    return max(
        cost_nanos(model, batch, (prompt_tokens, cached, output_tokens), prices, discount)
        for cached in (0, prompt_tokens)
    )


def _priced(
    model: str, tokens: tuple[int, int, int], prices: dict[str, ModelPrice]
) -> list[tuple[str, int, float]]:
    """Each kind of token (uncached input, cached input, output): its count, and the USD a
    million of them cost at `model`'s price (0 without one)."""
    input_tokens, cached, output = tokens
    price = prices.get(model)
    per_million = {"input": 0.0, "cached input": 0.0, "output": 0.0}
    if price is not None:
        cached_price = price.cached_input if price.cached_input is not None else price.input
        per_million = {"input": price.input, "cached input": cached_price, "output": price.output}
    counts = {"input": input_tokens - cached, "cached input": cached, "output": output}
    return [(kind, count, per_million[kind]) for kind, count in counts.items()]
