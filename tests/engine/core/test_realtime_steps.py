"""Steps sized for realtime requests beside batch work: the scheduler's invariants (module
docstring of engine/core/scheduler.py), on a machine whose step cost is known exactly.

- A step that decodes a realtime sequence costs at most its budget (PREFILL_STEP_MULTIPLE budgets
  where a realtime prefill runs beside) plus one scheduled request's share (the one batch token
  that always runs, or a realtime prefill's one-block floor).
- Batch sequences take turns and keep their blocks: with R running and at least k of them run
  in each step that runs batch work, each runs at least once every N = 2 * ceil(R / k) steps
  (a realtime prefill's step of its own, never two in a row, may come between).
- Greedy outputs of both priorities are token-identical to transformers however steps are cut.
"""

import math
import random

import pytest
from greedy_checks import GREEDY, assert_matches_oracle, assert_pool_whole, random_prompts

from pagedbatch.engine import LLM
from pagedbatch.engine.core.kv_cache_manager import KVCacheManager
from pagedbatch.engine.core.request import Request, RequestStatus
from pagedbatch.engine.core.scheduler import (
    IDLE,
    IDLE_STEP_MULTIPLE,
    PREFILL_STEP_MULTIPLE,
    SIZED,
    ScheduledRequest,
    Scheduler,
)
from pagedbatch.engine.core.step_cost import StepCost, StepCostModel, StepWork
from pagedbatch.engine.sampling_params import SamplingParams

BLOCK = 4
REALTIME, BATCH = 0, 10


def known_cost(fixed: float, per_token: float, per_context: float = 0.0) -> StepCostModel:
    model = StepCostModel()
    model.cost = StepCost(fixed, per_token, per_context)
    return model


def req(rid: str, prompt_len: int, priority: int, arrival: float) -> Request:
    prompt = [(int(70 * arrival) + i) % 5000 + 10 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(), priority=priority, arrival_time=arrival)


def run_step(sched: Scheduler):
    out = sched.schedule()
    for s in out.scheduled:
        if s.samples:
            s.request.append_output_token(1000 + s.request.num_output_tokens)
    return out


def share(cost: StepCost, s: ScheduledRequest) -> float:
    """What one scheduled request adds to its step."""
    return cost.seconds(StepWork.of_chunk(s.start, s.num_new_tokens)) - cost.fixed


@pytest.mark.parametrize("target", [None, 0.030])
def test_no_step_with_realtime_decodes_exceeds_its_budget_by_more_than_one_share(target):
    cost = known_cost(0.010, 0.001, 0.00001)
    sched = Scheduler(KVCacheManager(4096, BLOCK, True), 32, 64, "priority", None, target, cost)
    rng = random.Random(0)
    for i in range(16):
        sched.add(req(f"b{i}", rng.randint(5, 40), BATCH, i))
    # Realtime arrivals, some together, one with a prompt longer than a step's tokens.
    arrivals = {3: [6], 4: [60], 10: [9], 30: [30, 12, 5], 60: [100], 90: [7]}
    checked = shortened = widest = cut = 0
    for step in range(150):
        for n, prompt_len in enumerate(arrivals.get(step, [])):
            sched.add(req(f"rt{step}.{n}", prompt_len, REALTIME, 100 + step + n / 10))
        realtime = [r for r in sched.running if r.priority == REALTIME]
        decoding = {id(r) for r in realtime if r.num_tokens - r.num_computed_tokens == 1}
        idle = StepWork(max(1, len(realtime)), sum(r.num_computed_tokens + 1 for r in realtime))
        budget = target if target is not None else IDLE_STEP_MULTIPLE * cost.cost.seconds(idle)
        out = run_step(sched)
        assert not out.preempted
        shortened += out.deferred_tokens > 0
        if any(id(s.request) in decoding for s in out.scheduled):
            checked += 1
            kinds = {
                "batch"
                if s.request.priority == BATCH
                else "decode"
                if id(s.request) in decoding
                else "prefill"
                for s in out.scheduled
            }
            assert kinds & {"batch", "prefill"}, step  # batch work, or a prefill's own step
            limit = budget * (PREFILL_STEP_MULTIPLE if "prefill" in kinds else 1)
            largest = max(share(cost.cost, s) for s in out.scheduled)
            assert cost.cost.seconds(out.work) <= limit + largest + 1e-12, (step, out.scheduled)
            cut += "prefill" in kinds and cost.cost.seconds(out.work) > budget
            widest = max(widest, sum(s.request.priority == BATCH for s in out.scheduled))
        for r in realtime:
            if r.num_output_tokens >= 8:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
    assert checked > 25 and shortened > 40 and widest > 2  # batch tokens fill the budgets
    assert cut  # realtime prefills beside realtime decodes took their longer steps


def test_batch_sequences_take_turns_and_keep_their_blocks():
    # 10 ms a step, 1 ms a token, steps of 15.5 ms: beside one or two realtime decodes, k >= 3
    # batch decodes a step; with R = 12 of them each runs at least once every 2 * ceil(R / k).
    cost = known_cost(0.010, 0.001)
    sched = Scheduler(KVCacheManager(1024, BLOCK, True), 32, 64, "priority", None, 0.0155, cost)
    batch = [req(f"b{i}", 4, BATCH, i) for i in range(12)]
    for r in batch:
        sched.add(r)
    run_step(sched)
    sched.add(req("rt", 6, REALTIME, 50))  # runs throughout
    period = 2 * math.ceil(len(batch) / 3)
    last_ran = dict.fromkeys(batch, 0)
    for step in range(1, 200):
        if step % 7 == 0:  # another realtime stream now and then, with a step of its own
            sched.add(req(f"rt{step}", 6, REALTIME, 50 + step))
        out = run_step(sched)
        assert not out.preempted
        ran = {s.request for s in out.scheduled}
        for r in batch:
            assert sched.kv.block_ids(r.request_id)  # deferred, never freed
            if r in ran:
                assert step - last_ran[r] <= period, (r.request_id, step)
                last_ran[r] = step
        for r in list(sched.running):
            if r.priority == REALTIME and r.request_id != "rt" and r.num_output_tokens >= 3:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
    assert all(199 - step <= period for step in last_ran.values())


def test_turns_go_round_in_arrival_order_from_where_the_last_step_stopped():
    cost = known_cost(0.010, 0.001)
    sched = Scheduler(KVCacheManager(1024, BLOCK, True), 32, 64, "priority", None, 0.0145, cost)
    for i in range(5):
        sched.add(req(f"b{i}", 4, BATCH, i))
    run_step(sched)
    sched.add(req("rt", 6, REALTIME, 9))
    assert [s.request.request_id for s in run_step(sched).scheduled] == ["rt"]  # its own step
    steps = [[s.request.request_id for s in run_step(sched).scheduled] for _ in range(3)]
    assert steps == [["rt", "b0", "b1", "b2"], ["rt", "b3", "b4", "b0"], ["rt", "b1", "b2", "b3"]]


@pytest.mark.parametrize(
    "slicing",
    [{"low_priority_token_budget": 1}, {"realtime_target_itl_ms": 0.001}],
    ids=["one-batch-token-a-step", "tiny-target"],
)
def test_greedy_outputs_of_both_priorities_match_transformers_however_steps_are_cut(
    tiny_llama, oracle, slicing
):
    prompts = random_prompts(12, 3, 40, seed=33)
    llm = LLM(tiny_llama, num_kv_blocks=512, max_num_seqs=16, **slicing)
    engine = llm.engine
    # Batch lines first, running when realtime requests join them and cut their steps.
    for i, prompt in enumerate(prompts):
        if i % 3:
            engine.add_request(str(i), prompt, GREEDY, priority=BATCH)
    engine.step()
    for i, prompt in enumerate(prompts):
        if not i % 3:
            engine.add_request(str(i), prompt, GREEDY, priority=REALTIME)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs |= {o.request_id: o for o in engine.step() if o.finished}
    assert_matches_oracle(oracle, tiny_llama, prompts, [outputs[str(i)] for i in range(12)])
    assert engine.get_stats()["batch_tokens_deferred"] > 0  # the steps were cut
    assert_pool_whole(llm)


def batch_tokens_in_a_sized_step(idle_beyond: float, sized_beyond: float) -> int:
    """With idle and sized steps seen taking these many seconds beyond the fit."""
    cost = known_cost(0.010, 0.001)
    for kind, beyond in ((IDLE, idle_beyond), (SIZED, sized_beyond)):
        cost.observe_iteration(kind, StepWork(1, 8), cost.cost.seconds(StepWork(1, 8)) + beyond)
    sched = Scheduler(KVCacheManager(1024, BLOCK, True), 32, 64, "priority", None, None, cost)
    for i in range(24):
        sched.add(req(f"b{i}", 4, BATCH, i))
    assert run_step(sched).kind is None  # a batch's prefills: no measure of either kind
    sched.add(req("rt", 6, REALTIME, 50))
    assert run_step(sched).kind is None  # the realtime prefill's step of its own
    out = run_step(sched)
    assert out.kind == SIZED
    return sum(s.request.priority == BATCH for s in out.scheduled)


def test_sized_steps_follow_what_idle_and_sized_steps_have_really_taken():
    as_fitted = batch_tokens_in_a_sized_step(0.0, 0.0)
    assert as_fitted > 2
    # Sized steps 4 ms longer than the fit says: 4 batch tokens (1 ms each) fewer fit.
    assert batch_tokens_in_a_sized_step(0.0, 0.004) == as_fitted - 4
    # Idle steps 4 ms longer: the budget grows by IDLE_STEP_MULTIPLE (1.8) times that, 7.2
    # tokens (7 or 8, with the room's fraction); the sized steps' 4 ms more take 4 of them back.
    assert as_fitted + 7 <= batch_tokens_in_a_sized_step(0.004, 0.0) <= as_fitted + 8
    assert as_fitted + 3 <= batch_tokens_in_a_sized_step(0.004, 0.004) <= as_fitted + 4


def test_a_realtime_stream_alone_runs_idle_steps():
    sched = Scheduler(
        KVCacheManager(64, BLOCK, True), 8, 64, "priority", None, None, known_cost(0.01, 0.001)
    )
    sched.add(req("rt", 6, REALTIME, 0))
    assert run_step(sched).kind is None  # its prefill
    assert run_step(sched).kind == IDLE


def test_sized_steps_reach_their_budget_where_the_fit_misjudges_what_a_token_costs():
    # The fit says 10 ms a step and 2 ms a token; the machine takes 20 ms and 0.5 ms (a CPU's
    # small steps: the weights are read once whatever the tokens). Steered by what sized steps
    # really take, 20 steps on they fill their budget to within one token as fitted (a step
    # takes a batch token only where the last ones' error, and that token's fitted cost, fit).
    def really(work: StepWork) -> float:
        return 0.020 + 0.0005 * work.tokens

    cost = known_cost(0.010, 0.002)
    cost.observe_iteration(IDLE, StepWork(1, 7), really(StepWork(1, 7)))
    sched = Scheduler(KVCacheManager(4096, BLOCK, True), 128, 512, "priority", None, None, cost)
    for i in range(100):
        sched.add(req(f"b{i}", 4, BATCH, i))
    run_step(sched)
    sched.add(req("rt", 6, REALTIME, 200))
    took = []
    for _ in range(30):
        out = run_step(sched)
        if out.kind == SIZED:
            cost.observe_iteration(SIZED, out.work, really(out.work))
            took.append(really(out.work))
    budget = IDLE_STEP_MULTIPLE * really(StepWork(1, 7))
    assert took[0] < 0.75 * budget  # as fitted, a batch token looked four times its cost
    assert all(budget - 0.002 <= t <= budget for t in took[20:]), (budget, took)
