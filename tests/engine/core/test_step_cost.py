"""The step cost model: fitted on observed steps, silent until it knows enough."""

import random

import pytest

from pagedbatch.engine.core.step_cost import (
    IDLE,
    MIN_STEPS,
    OFFSET_WEIGHTS,
    REFIT_EVERY,
    SIZED,
    WINDOW,
    StepCostModel,
    StepWork,
)


def test_a_chunk_attends_each_of_its_positions_context():
    # Positions 3, 4, 5 attend 4, 5 and 6 keys.
    assert StepWork.of_chunk(3, 3) == StepWork(3, 15)
    assert StepWork.of_chunk(0, 1) + StepWork.of_chunk(9, 1) == StepWork(2, 11)


def test_the_fit_recovers_a_linear_cost_from_noisy_steps():
    rng = random.Random(0)
    model = StepCostModel()
    for _ in range(MIN_STEPS + REFIT_EVERY):
        work = StepWork(rng.randint(1, 2048), rng.randint(1, 400_000))
        seconds = 0.030 + 0.0004 * work.tokens + 2e-7 * work.context
        model.observe(work, seconds * rng.uniform(0.97, 1.03))
    cost = model.cost
    assert cost is not None
    assert cost.fixed == pytest.approx(0.030, rel=0.2)
    assert cost.per_token == pytest.approx(0.0004, rel=0.05)
    assert cost.per_context == pytest.approx(2e-7, rel=0.1)
    assert cost.seconds(StepWork(100, 10_000)) == pytest.approx(0.072, rel=0.05)


def test_too_few_steps_predict_nothing():
    model = StepCostModel()
    for i in range(MIN_STEPS - 1):
        model.observe(StepWork(i + 1, i + 1), 0.01 * (i + 1))
    assert model.cost is None


def test_steps_that_tell_nothing_about_tokens_predict_nothing():
    model = StepCostModel()
    for _ in range(MIN_STEPS + REFIT_EVERY):
        model.observe(StepWork(64, 1000), 0.05)  # all alike: per-token cost unknowable
    assert model.cost is None


def test_steps_that_tell_nothing_keep_the_last_fit():
    model = StepCostModel()
    for i in range(MIN_STEPS + REFIT_EVERY):
        work = StepWork(1 + i * 7 % 50, 1 + i * 13 % 900)
        model.observe(work, 0.01 + 0.001 * work.tokens)
    assert model.cost is not None
    for _ in range(300):  # a whole window of steps alike: the last refits know nothing
        model.observe(StepWork(9, 900), 0.019)
    assert model.cost is not None
    assert model.cost.seconds(StepWork(9, 900)) == pytest.approx(0.019, rel=0.01)


def test_each_kind_of_step_keeps_how_far_its_steps_are_from_the_fit():
    model = StepCostModel()
    for i in range(MIN_STEPS + REFIT_EVERY):
        work = StepWork(1 + i * 7 % 50, 1 + i * 13 % 900)
        model.observe(work, 0.01 + 0.001 * work.tokens)
    assert model.offset(IDLE) == model.offset(SIZED) == 0.0  # none seen
    assert model.recent_seconds(IDLE) is None
    work = StepWork(1, 50)
    for beyond in (0.004, 0.004, 0.010):
        model.observe_iteration(IDLE, work, model.cost.seconds(work) + beyond)
    assert model.offset(IDLE) == pytest.approx(0.004 + OFFSET_WEIGHTS[IDLE] * (0.010 - 0.004))
    recent = model.cost.seconds(work) + model.offset(IDLE)
    assert model.recent_seconds(IDLE) == pytest.approx(recent)
    assert model.offset(SIZED) == 0.0
    # Sized steps follow their last few: the scheduler steers each step by them.
    for beyond in (-0.004, 0.010):
        model.observe_iteration(SIZED, work, model.cost.seconds(work) + beyond)
    assert model.offset(SIZED) == pytest.approx(-0.004 + OFFSET_WEIGHTS[SIZED] * 0.014)
    assert OFFSET_WEIGHTS[SIZED] >= 0.5 > OFFSET_WEIGHTS[IDLE]


def test_an_offset_is_a_fixed_cost_the_line_missed_not_a_share_of_every_token():
    model = StepCostModel()
    for i in range(MIN_STEPS + REFIT_EVERY):  # big steps: a line through them misses 20 ms
        work = StepWork(100 + i * 7 % 200, 1 + i * 13 % 900)
        model.observe(work, 0.01 + 0.001 * work.tokens)
    one, seven = StepWork(1, 50), StepWork(7, 350)
    model.observe_iteration(SIZED, one, 0.031)  # one token's step really takes 31 ms
    # Seven take the 20 ms the line misses plus seven tokens' 7 ms, not seven times 31 ms.
    assert model.cost.seconds(seven) + model.offset(SIZED) == pytest.approx(0.037, rel=0.01)


def test_a_refit_keeps_what_each_kinds_steps_took():
    model = StepCostModel()
    for i in range(MIN_STEPS + REFIT_EVERY):
        work = StepWork(1 + i * 7 % 50, 1 + i * 13 % 900)
        model.observe(work, 0.01 + 0.001 * work.tokens)
    idle = StepWork(1, 50)
    model.observe_iteration(IDLE, idle, 0.02)
    for i in range(WINDOW):  # the machine's steps now cost 30 ms more, and a token twice as much
        work = StepWork(1 + i * 7 % 300, 1 + i * 13 % 9000)
        model.observe(work, 0.04 + 0.002 * work.tokens)
    assert model.cost.fixed == pytest.approx(0.04, rel=0.01)
    assert model.cost.seconds(idle) + model.offset(IDLE) == pytest.approx(0.02)
