"""`TokenRate`: tokens per second from a running total, read whenever someone asks."""

from __future__ import annotations

import pytest

from pagedbatch.api.token_rate import TokenRate


def test_the_first_reading_has_no_rate():
    assert TokenRate().update(500, at=100.0) is None


def test_the_rate_is_taken_over_the_window():
    rate = TokenRate(window=10.0)
    rate.update(0, at=0.0)
    assert rate.update(100, at=1.0) == pytest.approx(100.0)
    assert rate.update(300, at=2.0) == pytest.approx(150.0)
    for second in range(3, 13):
        rate.update(300 + 10 * (second - 2), at=float(second))
    # The busy first seconds have left the window: 10 tokens/s since t=3, the newest sample at
    # least 10 s old.
    assert rate.update(410, at=13.0) == pytest.approx(10.0)


def test_after_a_long_gap_the_rate_spans_the_gap():
    rate = TokenRate(window=10.0)
    rate.update(0, at=0.0)
    assert rate.update(600, at=60.0) == pytest.approx(10.0)
    # Until the window has a sample of its own to start from.
    assert rate.update(600, at=61.0) == pytest.approx(600 / 61)
    assert rate.update(600, at=71.0) == pytest.approx(0.0)
