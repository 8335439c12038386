"""The step cost model: fitted on observed steps, silent until it knows enough."""

import random

import pytest

from pagedbatch.engine.core.step_cost import (
    BIAS_WEIGHT,
    MIN_STEPS,
    REFIT_EVERY,
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
    assert model.bias("idle") == model.bias("sized") == 1.0  # none seen
    work = StepWork(1, 50)
    for ratio in (0.5, 0.5, 1.5):
        model.observe_iteration("idle", work, ratio * model.cost.seconds(work))
    assert model.bias("idle") == pytest.approx(0.5 + BIAS_WEIGHT * (1.5 - 0.5))
    assert model.bias("sized") == 1.0


def test_a_refit_keeps_what_each_kinds_steps_took():
    model = StepCostModel()
    for i in range(MIN_STEPS + REFIT_EVERY):
        work = StepWork(1 + i * 7 % 50, 1 + i * 13 % 900)
        model.observe(work, 0.01 + 0.001 * work.tokens)
    idle = StepWork(1, 50)
    model.observe_iteration("idle", idle, 0.02)
    for i in range(WINDOW):  # the machine's steps now cost 30 ms more, and a token twice as much
        work = StepWork(1 + i * 7 % 300, 1 + i * 13 % 9000)
        model.observe(work, 0.04 + 0.002 * work.tokens)
    assert model.cost.fixed == pytest.approx(0.04, rel=0.01)
    assert model.bias("idle") * model.cost.seconds(idle) == pytest.approx(0.02)
