"""The scheduler on its own: real requests and block tables, tokens appended by hand."""

import pytest

from pagedbatch.engine.core.kv_cache_manager import KVCacheManager
from pagedbatch.engine.core.request import Request, RequestStatus
from pagedbatch.engine.core.scheduler import LINGER_STEPS, Scheduler
from pagedbatch.engine.core.step_cost import MIN_STEPS, REFIT_EVERY, StepCostModel, StepWork
from pagedbatch.engine.sampling_params import SamplingParams

BLOCK = 4


def make_scheduler(
    num_blocks=64, max_seqs=8, budget=32, policy="priority", caching=True, low_budget=None
):
    kv = KVCacheManager(num_blocks, BLOCK, enable_caching=caching)
    return Scheduler(kv, max_seqs, budget, policy, low_budget)


def req(rid, prompt_len=6, priority=0, arrival=0.0, first=0):
    prompt = list(range(first, first + prompt_len))
    return Request(rid, prompt, SamplingParams(), priority=priority, arrival_time=arrival)


def run_step(sched):
    out = sched.schedule()
    for s in out.scheduled:
        if s.samples:
            s.request.append_output_token(1000 + s.request.num_output_tokens)
    return out


def test_prefill_then_decode_within_budget():
    sched = make_scheduler(budget=32)
    a, b = req("a", 10, arrival=0), req("b", 7, arrival=1, first=100)
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 10),
        ("b", 7),
    ]
    out = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 1)]
    assert out.num_tokens == 2


def test_long_prompt_is_chunked_to_the_budget():
    sched = make_scheduler(budget=8)
    a = req("a", 20)
    sched.add(a)
    chunks = []
    while a.num_output_tokens == 0:
        out = run_step(sched)
        chunks.append(
            (out.scheduled[0].start, out.scheduled[0].num_new_tokens, out.scheduled[0].samples)
        )
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]


def test_running_decodes_come_before_new_prefills():
    sched = make_scheduler(budget=8)
    a = req("a", 4, arrival=0)
    sched.add(a)
    run_step(sched)
    sched.add(req("b", 20, arrival=1))
    out = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]


def test_max_num_seqs_bounds_the_batch():
    sched = make_scheduler(max_seqs=2)
    for i in range(3):
        sched.add(req(f"r{i}", 4, arrival=i))
    out = run_step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 1


def test_out_of_blocks_preempts_the_latest_lowest_priority_request():
    # 6 blocks of 4 tokens: three 8-token prompts fill the pool.
    sched = make_scheduler(num_blocks=6, budget=64)
    a, b, c = (req(rid, 8, arrival=i, first=100 * i) for i, rid in enumerate("abc"))
    for r in (a, b, c):
        sched.add(r)
    run_step(sched)
    out = run_step(sched)  # each now needs a third block for its 9th token: none free
    assert c in out.preempted and c.status is RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0 and sched.kv.block_ids("c") == []
    assert {s.request.request_id for s in out.scheduled} == {"a", "b"}


def test_higher_priority_waiting_request_preempts_a_running_one():
    sched = make_scheduler(max_seqs=1)
    low = req("low", 4, priority=5, arrival=0)
    sched.add(low)
    run_step(sched)
    high = req("high", 4, priority=0, arrival=1, first=40)
    sched.add(high)
    out = run_step(sched)
    assert low in out.preempted
    assert [s.request.request_id for s in out.scheduled] == ["high"]


def test_fcfs_ignores_priority():
    sched = make_scheduler(max_seqs=1, policy="fcfs")
    first = req("first", 4, priority=5, arrival=0)
    sched.add(first)
    run_step(sched)
    sched.add(req("urgent", 4, priority=0, arrival=1))
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["first"]


def scheduled(out):
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_a_realtime_prefill_gets_a_step_of_its_own_then_batch_work_resumes():
    sched = make_scheduler(budget=64)
    batch = [req(f"b{i}", 4, priority=10, arrival=i, first=10 * i) for i in range(3)]
    for r in batch:
        sched.add(r)
    run_step(sched)
    sched.add(req("rt", 6, priority=0, arrival=5, first=100))
    assert scheduled(run_step(sched)) == [("rt", 6)]  # its first token, from a short step
    assert scheduled(run_step(sched)) == [("rt", 1), ("b0", 1), ("b1", 1), ("b2", 1)]


def test_realtime_arrivals_every_step_leave_batch_work_every_other_step():
    sched = make_scheduler(budget=64)
    sched.add(req("b", 4, priority=10))
    run_step(sched)
    steps = []
    for i in range(3):
        sched.add(req(f"rt{i}", 4, priority=0, arrival=1 + i, first=100 * (i + 1)))
        steps.append(scheduled(run_step(sched)))
    assert steps == [
        [("rt0", 4)],
        [("rt0", 1), ("rt1", 4), ("b", 1)],
        [("rt0", 1), ("rt1", 1), ("rt2", 4)],
    ]


def test_while_realtime_requests_run_batch_work_gets_at_most_its_own_budget():
    sched = make_scheduler(budget=64, low_budget=3)
    batch = [req(f"b{i}", 4, priority=10, arrival=i, first=10 * i) for i in range(4)]
    for r in batch:
        sched.add(r)
    assert len(run_step(sched).scheduled) == 4  # alone, batch work has the whole budget
    sched.add(req("rt", 6, priority=0, arrival=5, first=100))
    run_step(sched)
    # The earliest batch lines go on; the last waits for a step with room, and goes first in it.
    assert scheduled(run_step(sched)) == [("rt", 1), ("b0", 1), ("b1", 1), ("b2", 1)]
    assert scheduled(run_step(sched)) == [("rt", 1), ("b3", 1), ("b0", 1), ("b1", 1)]
    sched.finish(sched.running[0], RequestStatus.FINISHED_STOPPED)
    # The steps stay short a while for the realtime client's next request, then the bound goes.
    assert [len(run_step(sched).scheduled) for _ in range(LINGER_STEPS)] == [3] * LINGER_STEPS
    assert len(run_step(sched).scheduled) == 4


def test_shared_prefix_is_served_from_cache():
    sched = make_scheduler()
    a = req("a", 10)
    sched.add(a)
    run_step(sched)
    b = req("b", 10, arrival=1)  # same 10 prompt tokens
    sched.add(b)
    out = run_step(sched)
    placed = {s.request.request_id: s for s in out.scheduled}
    # Two full blocks (8 tokens) hit; the rest is computed.
    assert b.num_cached_tokens == 8 and placed["b"].start == 8 and placed["b"].num_new_tokens == 2
    assert sched.kv.block_ids("a")[:2] == sched.kv.block_ids("b")[:2]
    assert sched.kv.pool.prefix_hits == 8


def test_fully_cached_prompt_still_computes_its_last_token():
    sched = make_scheduler()
    a = req("a", 8)
    sched.add(a)
    run_step(sched)
    b = req("b", 8, arrival=1)
    sched.add(b)
    out = run_step(sched)
    placed = {s.request.request_id: s for s in out.scheduled}
    assert placed["b"].num_new_tokens == 4 and placed["b"].samples  # one block reused, not two


def test_block_table_rows_follow_the_blocks_through_preemption():
    sched = make_scheduler(num_blocks=6, budget=64)
    requests = [req(rid, 8, arrival=i, first=100 * i) for i, rid in enumerate("abc")]
    for r in requests:
        sched.add(r)
    preempted = False
    for _ in range(6):
        out = run_step(sched)
        preempted |= bool(out.preempted)
        for r in sched.running:
            ids = sched.kv.block_ids(r.request_id)
            assert sched.kv.block_table.gather([r.request_id])[0].tolist() == ids
    assert preempted


def test_blocks_filled_while_decoding_are_cached_for_others():
    sched = make_scheduler()
    a = req("a", 6)
    sched.add(a)
    while a.num_output_tokens < 4:  # its 9th token's KV is in: two full blocks
        run_step(sched)
    b = Request("b", a.all_token_ids[:8] + [7], SamplingParams(), arrival_time=1.0)
    sched.add(b)
    run_step(sched)
    assert b.num_cached_tokens == 8


def test_finishing_every_request_returns_every_block():
    sched = make_scheduler(num_blocks=10, budget=16)
    requests = [req(f"r{i}", 5 + i, arrival=i, first=10 * i) for i in range(5)]
    for r in requests:
        sched.add(r)
    for _ in range(12):
        run_step(sched)
    for r in list(sched.running) + list(sched.waiting):
        sched.finish(r, RequestStatus.FINISHED_ABORTED)
    assert sched.kv.pool.num_free_blocks == 10
    assert sched.num_unfinished == 0


def test_bad_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        make_scheduler(policy="random")


def fitted_cost(fixed, per_token, per_context=0.0):
    """A cost model that has seen enough steps of a machine of exactly this cost."""
    model = StepCostModel()
    for i in range(MIN_STEPS + REFIT_EVERY):
        work = StepWork(1 + i * 7 % 50, 1 + i * 13 % 900)
        model.observe(work, fixed + per_token * work.tokens + per_context * work.context)
    return model


def test_while_realtime_requests_run_batch_work_fills_the_step_time_it_is_given():
    # 10 ms a step and 1 ms a token: a 15.5 ms step holds the realtime decode and 4 more tokens.
    cost = fitted_cost(0.010, 0.001)
    kv = KVCacheManager(64, BLOCK, enable_caching=True)
    sched = Scheduler(kv, 8, 64, "priority", None, 0.0155, cost)
    for i in range(6):
        sched.add(req(f"b{i}", 4, priority=10, arrival=i, first=10 * i))
    assert len(run_step(sched).scheduled) == 6
    sched.add(req("rt", 6, priority=0, arrival=9, first=100))
    run_step(sched)  # the realtime prefill, alone
    step = scheduled(run_step(sched))
    assert step == [("rt", 1), ("b0", 1), ("b1", 1), ("b2", 1), ("b3", 1)]
    sched.finish(sched.running[0], RequestStatus.FINISHED_STOPPED)
    for _ in range(LINGER_STEPS):
        run_step(sched)
    assert len(run_step(sched).scheduled) == 6  # the realtime request long gone, so is the bound


def test_batch_work_goes_on_when_realtime_work_fills_the_step_alone():
    cost = fitted_cost(0.010, 0.001)
    kv = KVCacheManager(64, BLOCK, enable_caching=True)
    sched = Scheduler(kv, 8, 64, "priority", None, 0.005, cost)  # shorter than the fixed cost
    sched.add(req("b0", 4, priority=10))
    sched.add(req("b1", 4, priority=10, arrival=1, first=10))
    run_step(sched)
    sched.add(req("rt", 6, priority=0, arrival=2, first=100))
    run_step(sched)
    assert scheduled(run_step(sched)) == [("rt", 1), ("b0", 1)]


def test_without_a_fitted_cost_the_token_budget_bounds_batch_work():
    kv = KVCacheManager(64, BLOCK, enable_caching=True)
    sched = Scheduler(kv, 8, 64, "priority", 2, 0.001, StepCostModel())
    for i in range(4):
        sched.add(req(f"b{i}", 4, priority=10, arrival=i, first=10 * i))
    run_step(sched)
    sched.add(req("rt", 6, priority=0, arrival=5, first=100))
    run_step(sched)
    assert scheduled(run_step(sched)) == [("rt", 1), ("b0", 1), ("b1", 1)]
