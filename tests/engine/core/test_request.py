import math

import pytest

from pagedbatch.engine.core.request import IllegalTransition, Request, RequestStatus
from pagedbatch.engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    SamplingParams,
)


def make_request() -> Request:
    return Request("r", [1, 2, 3], SamplingParams())


def test_request_moves_through_its_states():
    r = make_request()
    assert r.status is RequestStatus.WAITING
    r.transition(RequestStatus.RUNNING)
    r.transition(RequestStatus.PREEMPTED)
    r.transition(RequestStatus.RUNNING)
    r.transition(RequestStatus.FINISHED_LENGTH)
    assert r.finished and r.finish_reason == "length"


def test_all_token_ids_is_the_prompt_then_the_output_as_it_grows():
    r = make_request()
    tokens = r.all_token_ids
    r.append_output_token(7)
    r.append_output_token(8)
    assert r.all_token_ids is tokens  # kept, not rebuilt
    assert tokens == [1, 2, 3, 7, 8] and r.output_token_ids == [7, 8]
    assert r.prompt_token_ids == [1, 2, 3] and r.num_tokens == 5


@pytest.mark.parametrize(
    "path",
    [
        [RequestStatus.PREEMPTED],  # waiting cannot be preempted
        [RequestStatus.FINISHED_STOPPED],  # nothing was generated while waiting
        [RequestStatus.RUNNING, RequestStatus.FINISHED_ABORTED, RequestStatus.RUNNING],
        [RequestStatus.RUNNING, RequestStatus.WAITING],
    ],
)
def test_illegal_transitions_raise(path):
    r = make_request()
    with pytest.raises(IllegalTransition):
        for status in path:
            r.transition(status)


def test_waiting_and_preempted_requests_can_be_aborted():
    r = make_request()
    r.transition(RequestStatus.FINISHED_ABORTED)
    assert r.finish_reason == "abort"
    r = make_request()
    r.transition(RequestStatus.RUNNING)
    r.transition(RequestStatus.PREEMPTED)
    r.transition(RequestStatus.FINISHED_ABORTED)


def test_sort_key_puts_lower_priority_number_then_earlier_arrival_first():
    a = Request("a", [1], SamplingParams(), priority=1, arrival_time=1.0)
    b = Request("b", [1], SamplingParams(), priority=0, arrival_time=2.0)
    c = Request("c", [1], SamplingParams(), priority=0, arrival_time=3.0)
    assert sorted([a, c, b], key=lambda r: r.sort_key) == [b, c, a]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        # Bounds that keep one request from costing everyone: see sampling_params.py.
        ({"n": MAX_N + 1}, "n"),
        ({"top_k": 1.5}, "top_k"),
        ({"seed": "7"}, "seed"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop"),
        ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: math.nan}}, "logit_bias"),
        ({"logit_bias": {5: -math.inf}}, "logit_bias"),
        ({"logit_bias": {5: True}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_bad_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_the_bounds_themselves_are_accepted():
    SamplingParams(
        n=MAX_N,
        top_k=2**63,
        seed=-(2**200),
        stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS,
        logit_bias={i: (-100.0 if i % 2 else 100) for i in range(MAX_LOGIT_BIAS)},
    )


def test_sampling_params_normalise_stop_and_top_k():
    p = SamplingParams(stop="END", top_k=-1)
    assert p.stop == ["END"] and p.top_k == 0
