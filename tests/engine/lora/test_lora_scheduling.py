"""The scheduler with LoRA adapters served (`max_loras`): the running requests, and so every
step, hold at most `max_loras` distinct adapters; a request waiting for a slot lets base-model
requests behind it start but no adapter's, so that it is not starved by a stream of requests of
the adapters already running."""

from pagedbatch.engine.core.kv_cache_manager import KVCacheManager
from pagedbatch.engine.core.request import Request, RequestStatus
from pagedbatch.engine.core.scheduler import Scheduler
from pagedbatch.engine.sampling_params import SamplingParams

BLOCK = 4


def make_scheduler(max_loras: int, max_seqs: int = 8) -> Scheduler:
    kv = KVCacheManager(256, BLOCK, enable_caching=True)
    return Scheduler(kv, max_seqs, 64, "priority", max_loras=max_loras)


def req(rid: str, lora: str | None, arrival: float, priority: int = 1) -> Request:
    """A request of `priority` (0: realtime, 1: a batch line)."""
    request = Request(rid, [1, 2, 3, 4, 5], SamplingParams(), arrival_time=arrival)
    request.lora_name = lora
    request.priority = priority
    return request


def step(sched: Scheduler) -> list[str]:
    out = sched.schedule()
    for s in out.scheduled:
        if s.samples:
            s.request.append_output_token(7)
    return [s.request.request_id for s in out.scheduled]


def adapters(sched: Scheduler) -> set[str]:
    return {r.lora_name for r in sched.running if r.lora_name is not None}


def test_no_more_than_max_loras_adapters_run_and_base_requests_pass_a_waiting_one():
    sched = make_scheduler(max_loras=2)
    for i, lora in enumerate(["a", "b", "c", None, "a"]):
        sched.add(req(f"{i}-{lora}", lora, arrival=i))
    assert step(sched) == ["0-a", "1-b", "3-None"]
    # "2-c" waits for a slot; "4-a", behind it, waits too though "a" runs: else a stream of
    # "a" requests could keep "c" out for ever.
    assert [r.request_id for r in sched.waiting] == ["2-c", "4-a"]
    assert step(sched) == ["0-a", "1-b", "3-None"]
    sched.finish(sched.running[1], RequestStatus.FINISHED_STOPPED)  # "1-b": b's slot frees
    # "2-c" takes it; "4-a" follows, "a" being among the two.
    assert step(sched) == ["0-a", "3-None", "2-c", "4-a"]
    assert adapters(sched) == {"a", "c"} and not sched.waiting


def test_every_request_of_many_adapters_over_few_slots_runs_and_no_step_holds_more():
    sched = make_scheduler(max_loras=2, max_seqs=4)
    names = ["a", "b", "c", "d", None]
    requests = [req(f"r{i}", names[i % len(names)], arrival=i) for i in range(30)]
    for request in requests:
        sched.add(request)
    steps = 0
    while sched.num_unfinished:
        step(sched)
        assert len(adapters(sched)) <= 2
        for request in list(sched.running):
            if request.num_output_tokens >= 3:
                sched.finish(request, RequestStatus.FINISHED_STOPPED)
        steps += 1
        assert steps < 200
    assert all(r.status is RequestStatus.FINISHED_STOPPED for r in requests)


def test_a_realtime_request_preempts_the_fewest_batch_lines_of_one_adapter_for_a_slot():
    sched = make_scheduler(max_loras=2)
    for i, lora in enumerate(["a", "a", "b", None]):
        sched.add(req(f"batch-{i}-{lora}", lora, arrival=i))
    step(sched)
    assert adapters(sched) == {"a", "b"}
    sched.add(req("rt-c", "c", arrival=10, priority=0))
    out = sched.schedule()
    # "b" has one line running, "a" two: b's line makes way, and rt-c runs in this very step.
    assert [r.request_id for r in out.preempted] == ["batch-2-b"]
    assert "rt-c" in [s.request.request_id for s in out.scheduled]
    assert adapters(sched) == {"a", "c"}
    # The preempted line, a batch line, cannot take the slot back from a realtime request: it
    # waits for one, as any line does.
    for _ in range(3):
        step(sched)
        assert [r.request_id for r in sched.waiting] == ["batch-2-b"]


def test_arrival_alone_never_preempts_for_an_adapter_slot():
    sched = make_scheduler(max_loras=1)
    sched.add(req("late-a", "a", arrival=5))
    step(sched)
    sched.add(req("early-b", "b", arrival=0))  # an earlier line of the same priority
    out = sched.schedule()
    assert not out.preempted and [r.request_id for r in sched.waiting] == ["early-b"]
    urgent = req("urgent-b", "b", arrival=9)
    urgent.user_priority = -5  # a batch line of better user priority
    sched.add(urgent)
    assert [r.request_id for r in sched.schedule().preempted] == ["late-a"]


def test_without_adapters_served_the_waiting_queue_is_unchanged():
    kv = KVCacheManager(256, BLOCK, enable_caching=True)
    sched = Scheduler(kv, 8, 64, "priority")
    for i, lora in enumerate(["a", "b", "c"]):
        sched.add(req(f"{i}", lora, arrival=i))
    assert step(sched) == ["0", "1", "2"]
