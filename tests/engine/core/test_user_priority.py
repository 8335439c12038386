"""vLLM's per-request priority (`user_priority`) orders requests within their priority class:
lower first, then arrival; realtime requests stay ahead of batch lines whatever either asks, and
under fcfs it counts for nothing."""

import pytest

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.engine.core.kv_cache_manager import KVCacheManager
from pagedbatch.engine.core.request import Request
from pagedbatch.engine.core.scheduler import Scheduler

REALTIME, BATCH = 0, 10


def admitted_order(requests, policy="priority"):
    """The order the requests first run in, one sequence at a time."""
    scheduler = Scheduler(KVCacheManager(64, 4, enable_caching=False), 1, 64, policy)
    for request in requests:
        scheduler.add(request)
    order = []
    while scheduler.waiting:
        (scheduled,) = scheduler.schedule().scheduled
        order.append(scheduled.request.request_id)
        scheduler.finish(scheduled.request, scheduled.request.status.FINISHED_STOPPED)
    return order


def request(rid, priority, user_priority, arrival):
    return Request(
        rid,
        [1, 2, 3],
        SamplingParams(),
        priority=priority,
        user_priority=user_priority,
        arrival_time=arrival,
    )


def mixed_requests():
    return [
        request("batch-late-urgent", BATCH, -1000, 4.0),
        request("batch-default", BATCH, 0, 1.0),
        request("realtime-lax", REALTIME, 1000, 5.0),
        request("realtime-default-late", REALTIME, 0, 3.0),
        request("realtime-default", REALTIME, 0, 2.0),
        request("batch-urgent", BATCH, -5, 6.0),
    ]


def test_lower_user_priority_first_within_a_class_then_arrival():
    assert admitted_order(mixed_requests()) == [
        "realtime-default",
        "realtime-default-late",
        "realtime-lax",
        "batch-late-urgent",
        "batch-urgent",
        "batch-default",
    ]
    assert admitted_order(mixed_requests(), "fcfs") == [
        "batch-default",
        "realtime-default",
        "realtime-default-late",
        "batch-late-urgent",
        "realtime-lax",
        "batch-urgent",
    ]


def test_a_waiting_request_of_better_user_priority_preempts_a_worse_one(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64, max_num_seqs=1)
    engine = llm.engine
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.add_request("lax", [5, 6, 7], params, priority=BATCH, user_priority=7)
    engine.step()
    engine.add_request("urgent", [8, 9], params, priority=BATCH, user_priority=-7)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["urgent", "lax"]
    assert llm.get_stats()["preemptions"] == 1


@pytest.mark.parametrize("bad", [1001, -1001, True, 1.5])
def test_user_priority_is_bounded(tiny_llama, bad):
    engine = LLM(tiny_llama, num_kv_blocks=16).engine
    with pytest.raises(ValueError, match="user_priority"):
        engine.add_request("r", [1, 2], SamplingParams(), user_priority=bad)
