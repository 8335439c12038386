"""Token-level continuous batching: which requests run this step, and how many tokens each.

Every step has one token budget. Running requests are served first (one decode token each, or the
next chunk of their prefill), best priority first; waiting requests then fill what is left, their
prefills cut into chunks that fit. A running prefill's chunk leaves a token for each running
decode behind it and room for the first waiting prompt (up to half the budget), so that a 128K
prompt, prefilled over many steps, holds up neither the others' decoding nor a new request.

Under the priority policy the best priority present (realtime requests) is served that way
before any other, and alone in a step where one of them prefills (but never in two steps
running), so that its first token is not held up by batch work. Otherwise a step that holds
realtime work is sized for it: every running realtime sequence decodes, and the others (batch
lines) add only what fits in the step's budget, `realtime_target_seconds` or, unset,
`IDLE_STEP_MULTIPLE` times what a step of the realtime decodes alone costs, by the engine's
measure of its steps (`step_cost`: its fit, plus what idle and sized steps have lately really
taken beyond it), and never more than `low_priority_token_budget` tokens.
Invariants of such a step:
- it costs at most its budget plus one scheduled request's share: at least one batch token
  runs, so realtime traffic slows batch work and never stops it; a realtime prefill chunk
  beside realtime decodes is cut to PREFILL_STEP_MULTIPLE budgets (to no less than a block), so
  that one long prompt does not stall the other streams, while a short one, run whole, gets its
  first token from one step;
- the batch's running sequences keep their KV blocks and take turns, round robin in arrival
  order from where the last step stopped, and none is preempted for it: with R of them and at
  least k of them run in each step that runs batch work (k >= 1), each runs at least once every
  N = 2 * ceil(R / k) steps (a realtime prefill's step of its own, never two in a row, may come
  between); 2R steps at worst.
The steps stay short for `LINGER_STEPS` steps after the last realtime request leaves: a
client's next request usually follows soon, and a full batch step begun just before it arrives
would hold its first token up by up to a whole step. With no realtime request present or
lingering, steps are as large as the token budget allows. When the KV pool runs dry, the worst
running request (lowest priority, latest arrival) is preempted: its blocks are freed and it is
recomputed later, mostly from the prefix cache.

An encoder-only model's requests (bidirectional attention: an embedding model such as BERT) hold
no KV blocks: each runs whole in one step, never in chunks, and finishes there. A decoder's
pooling requests run through the paged path like any prefill and finish at its end.

With LoRA adapters served (`max_loras`), the running requests hold at most `max_loras` distinct
adapters, so that no step holds more than the model has slots for. A waiting request of another
adapter waits for one of them to drain; base-model requests behind it may start, but no request
of any adapter may (`_AdapterGate`), so that a steady stream of one adapter's requests cannot
keep another's out: it waits at most until the running requests of one adapter have finished.
A request of a better priority or user priority (a realtime one) does not wait: it preempts the
running requests of one adapter that are all worse than it, the fewest such.

A request's images and audio clips are encoded in the step that first reaches their
placeholders, within a per-step encoder budget and the encoder cache's room (`encoder_cache`): a
chunk is cut before the first item whose embeddings cannot be had this step. A chunk may end
inside an item; the next goes on from the cached embeddings.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedbatch.engine.core.encoder_cache import EncoderCache
from pagedbatch.engine.core.kv_cache_manager import KVCacheManager, cdiv
from pagedbatch.engine.core.request import Request, RequestStatus
from pagedbatch.engine.core.step_cost import IDLE, SIZED, StepCostModel, StepWork

# Unless a target is set, a step holding realtime work may cost this many times a step of the
# realtime decodes alone: their inter-token latency then stays within about this much of idle.
# Not 1.9: a margin for the noise of a shared machine (at 1.9, in a loaded run, sized steps took
# 2.07 idle steps and ITL p50 was 2.09x idle).
IDLE_STEP_MULTIPLE = 1.8
# A realtime prefill beside realtime decodes may take a step this many budgets long: a gap of
# about twice the target for the other streams (their inter-token p99), one step for its TTFT.
PREFILL_STEP_MULTIPLE = 2.0
# Steps stay sized for realtime requests for this many steps after the last one leaves.
LINGER_STEPS = 20
# Waiting requests a step passes over (waiting for a LoRA slot) looking for ones that may start:
# a bound on each step's scan of a long queue.
MAX_PASSED_OVER = 64


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start: int  # position of the first new token
    # True when this step reaches the request's last known token, so its logits are sampled.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.end == self.request.num_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Tokens of lower-priority running requests that a step sized for realtime work left to later
    # steps: one for each decode not run, the next chunk (up to a step's) of each prefill.
    deferred_tokens: int = 0
    kind: str | None = None  # SIZED, IDLE or neither (None): for StepCostModel's averages

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def work(self) -> StepWork:
        return sum(
            (StepWork.of_chunk(s.start, s.num_new_tokens) for s in self.scheduled), StepWork()
        )


def _insort(
    queue: list[Request], request: Request, key: Callable[[Request], tuple[int, int, float]]
) -> None:
    """`bisect.insort` by `key`, without the search where the request goes last, as most do
    (arrivals, in arrival order): a batch of thousands is admitted in linear time."""
    if not queue or key(queue[-1]) <= key(request):
        queue.append(request)
    else:
        bisect.insort(queue, request, key=key)


class _AdapterGate:
    """Which waiting requests may start for their LoRA adapter: at most `limit` adapters among
    the running requests; once a request waits for a slot, no later request of any adapter
    starts (see the module docstring)."""

    def __init__(self, running: list[Request], limit: int):
        self.held = {r.lora_name for r in running if r.lora_name is not None}
        self.limit = limit
        self.blocked = False

    def admits(self, request: Request) -> bool:
        name = request.lora_name
        if name is None:
            return True
        if not self.blocked and (name in self.held or len(self.held) < self.limit):
            return True
        self.blocked = True
        return False

    def started(self, request: Request) -> None:
        if request.lora_name is not None:
            self.held.add(request.lora_name)


def _decoding(request: Request, only: int | None) -> bool:
    """Whether the request (of priority `only`, if given) wants one token: its next decode."""
    return request.num_tokens - request.num_computed_tokens == 1 and (
        only is None or request.priority == only
    )


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "priority",
        low_priority_token_budget: int | None = None,
        realtime_target_seconds: float | None = None,
        step_cost: StepCostModel | None = None,
        encoder_cache: EncoderCache | None = None,
        max_num_encoder_tokens: int = 0,
        encoder_only: bool = False,
        max_loras: int | None = None,
    ):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {policy!r}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        # While better-priority requests are in the engine, the others' tokens per step: short
        # steps for realtime requests under a batch (None: max_num_batched_tokens bounds them).
        self.low_priority_token_budget = low_priority_token_budget
        # ... and no more than fit in a step this long (None: IDLE_STEP_MULTIPLE times a step of
        # the realtime decodes alone), once `step_cost` can tell.
        self.realtime_target_seconds = realtime_target_seconds
        self.step_cost = step_cost
        # A multimodal model's: which items' embeddings the runner holds, and how many
        # embeddings it may encode in one step.
        self.encoder_cache = encoder_cache
        self.max_num_encoder_tokens = max_num_encoder_tokens
        # Requests run whole and without KV blocks (see the module docstring).
        self.encoder_only = encoder_only
        # LoRA adapters the running requests may hold (None: no adapters are served).
        self.max_loras = max_loras
        self._encoder_budget = 0  # left in the step being scheduled
        # (request id, item hash) whose placeholders the last step finished: released next step,
        # once the runner has read them.
        self._media_passed: list[tuple[str, bytes]] = []
        self.waiting: list[Request] = []  # sorted, best first
        self.running: list[Request] = []  # sorted, best first
        self.num_preemptions = 0
        self._last_step_alone = False  # the last step served the best priority alone
        # The priority steps are sized for, and for how many more steps once none is present.
        self._lead: int | None = None
        self._lead_left = 0
        # The lower-priority running request whose turn comes next in a step sized for realtime
        # work (None: the earliest).
        self._turn: Request | None = None
        # Seconds of realtime prefill the step being scheduled may still take (None: unbounded).
        self._prefill_room: float | None = None
        # Seconds that sized steps have lately taken beyond what the step cost's fit says.
        self._offset = 0.0
        # The budgets of all sized steps so far, in seconds (for reports: against what they took).
        self.sized_budget_seconds = 0.0

    def _key(self, request: Request) -> tuple[int, int, float]:
        return request.sort_key if self.policy == "priority" else (0, 0, request.arrival_time)

    def add(self, request: Request) -> None:
        _insort(self.waiting, request, self._key)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request in any live state, releasing its blocks."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.transition(status)
        request.finished_time = time.monotonic()
        self.kv.forget(request)
        self._release_media(request)

    def _release_media(self, request: Request) -> None:
        if self.encoder_cache is not None and request.media:
            self.encoder_cache.release(request.request_id)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        self._release_media(request)
        request.transition(RequestStatus.PREEMPTED)
        request.num_computed_tokens = 0
        request.pooled = None  # its chunks run again
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.add(request)

    def _blocks_needed(self, request: Request) -> int:
        if self.encoder_only:
            return 0
        first_chunk = min(request.num_tokens, self.max_num_batched_tokens)
        return cdiv(first_chunk, self.kv.block_size)

    def _make_room_for_better_waiting(self, out: SchedulerOutput) -> None:
        """A waiting request that outranks running ones takes their seats, blocks or LoRA slot."""
        free_blocks = self.kv.pool.num_free_blocks
        free_seats = self.max_num_seqs - len(self.running)
        promised: set[str] = set()  # adapters of the waiting requests given room so far

        def evict(victim: Request) -> None:
            nonlocal free_blocks, free_seats
            free_blocks += len(self.kv.block_ids(victim.request_id))
            free_seats += 1
            self._preempt(victim)
            out.preempted.append(victim)

        for waiting in list(self.waiting):
            victims = self._adapter_slot_victims(waiting, promised)
            if victims is None:
                return
            for victim in victims:
                evict(victim)
            need = self._blocks_needed(waiting)
            while (free_seats < 1 or free_blocks < need) and self.running:
                victim = self.running[-1]
                if self._key(victim) <= self._key(waiting):
                    return
                evict(victim)
            if free_seats < 1 or free_blocks < need:
                return
            free_seats -= 1
            free_blocks -= need
            if waiting.lora_name is not None:
                promised.add(waiting.lora_name)

    def _adapter_slot_victims(self, waiting: Request, promised: set[str]) -> list[Request] | None:
        """What `waiting` must preempt to hold its LoRA adapter among at most `max_loras` (with
        those `promised` to better waiting requests): nothing where its adapter runs or a slot
        is free; else the running requests of one adapter, every one of a worse priority or
        user priority than `waiting`'s (arrival alone never preempts), the adapter with fewest
        of them; None where no adapter's are all worse. So a realtime request never waits for
        batch lines of other adapters to finish, and the lines it preempts, being worse, cannot
        preempt it back."""
        name = waiting.lora_name
        if name is None or self.max_loras is None:
            return []
        held: dict[str, list[Request]] = {}
        for request in self.running:
            if request.lora_name is not None:
                held.setdefault(request.lora_name, []).append(request)
        taken = held.keys() | promised
        if name in taken or len(taken) < self.max_loras:
            return []
        rank = self._key(waiting)[:2]
        worse = [group for group in held.values() if all(self._key(r)[:2] > rank for r in group)]
        return min(worse, key=len) if worse else None

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.encoder_cache is not None:
            for request_id, content_hash in self._media_passed:
                self.encoder_cache.release(request_id, content_hash)
            self._media_passed.clear()
            self._encoder_budget = self.max_num_encoder_tokens
        if self.policy == "priority":
            self._make_room_for_better_waiting(out)
        budget = self.max_num_batched_tokens
        # The lead priority (realtime) goes first, running then waiting: a realtime request's
        # prefill is not left behind batch work. Then the rest, within the step's budget.
        lead = self._lead_priority(self._top_priority())
        # Lower-priority work is present (each queue's worst lies last): the step is sized.
        queues = (self.running, self.waiting)
        sized = lead is not None and any(q and q[-1].priority != lead for q in queues)
        step_seconds = self._step_seconds(lead) if sized else None
        if step_seconds is not None:
            self._offset = self.step_cost.offset(SIZED)
        self._prefill_room = self._realtime_prefill_room(lead, step_seconds)
        budget = self._schedule_running(out, budget, lead)
        budget = self._schedule_waiting(out, budget, lead)
        if not sized:
            # One stream's decode alone, the step a sized one is held to.
            if len(out.scheduled) == 1 and out.scheduled[0].num_new_tokens == 1:
                out.kind = IDLE if out.scheduled[0].samples else None
            return out
        placed = sum(1 for r in self.running if r.priority == lead)  # they lie first
        low = min(budget, self.low_priority_token_budget or self.max_num_batched_tokens)
        room = None
        if step_seconds is not None:
            room = step_seconds - self._offset - self.step_cost.cost.seconds(out.work)
        prefilling = any(s.start < s.request.num_tokens - 1 for s in out.scheduled)
        # A best-priority request is prefilling: its first token comes sooner from a step of
        # its own. Never twice in a row, so a stream of them takes at most half the steps.
        alone = prefilling and not self._last_step_alone
        self._last_step_alone = alone
        if alone:
            low = 0
        else:  # a prefill's step of its own is no measure of the others
            out.kind = SIZED
            self.sized_budget_seconds += step_seconds or 0.0
        ran = len(out.scheduled)
        left, room = self._take_turns(out, placed, low, room)
        if room is not None:
            # New prompts in what is left, each chunk costed as if from position 0; a first
            # token where nothing else of theirs ran, as for running ones.
            fits = self._tokens_fitting(0, room)
            left = min(left, fits if fits or len(out.scheduled) > ran else 1)
        self._schedule_waiting(out, left, None)
        return out

    def _lead_priority(self, top: int | None) -> int | None:
        """The priority steps are sized for: the best present, or a better one that left less
        than LINGER_STEPS steps ago. None under fcfs or with nothing to run."""
        if top is None:
            return None
        if self._lead is None or top <= self._lead or self._lead_left <= 0:
            self._lead, self._lead_left = top, LINGER_STEPS
        else:
            self._lead_left -= 1
        return self._lead

    def _step_seconds(self, lead: int) -> float | None:
        """How long a step that holds lead-priority work may take; None until the engine can
        tell what its steps cost."""
        if self.step_cost is None or self.step_cost.cost is None:
            return None
        if self.realtime_target_seconds is not None:
            return self.realtime_target_seconds
        # An idle engine's step for the same realtime traffic: a stream's decode alone, as the
        # engine last measured it (the fit, before it has), and by the fit the others' decodes.
        leads = [r for r in self.running if r.priority == lead]
        streams = max(1, len(leads))
        idle = StepWork(streams, sum(r.num_computed_tokens + 1 for r in leads))
        one = StepWork(1, idle.context // streams)
        cost = self.step_cost
        alone = cost.recent_seconds(IDLE)
        alone = cost.cost.seconds(one) if alone is None else alone
        return IDLE_STEP_MULTIPLE * (alone + cost.cost.seconds(idle) - cost.cost.seconds(one))

    def _realtime_prefill_room(self, lead: int | None, step_seconds: float | None) -> float | None:
        """Seconds the lead priority's prefill chunks may take beside its decodes in a sized step:
        what a step of PREFILL_STEP_MULTIPLE budgets leaves them; None (unbounded) when none of
        them decodes, nothing then waiting on the step but the prefills' own first tokens."""
        if step_seconds is None:
            return None
        decodes = [r for r in self.running if _decoding(r, lead)]
        if not decodes:
            return None
        work = sum((StepWork.of_chunk(r.num_computed_tokens, 1) for r in decodes), StepWork())
        decoding = self._offset + self.step_cost.cost.seconds(work)
        return PREFILL_STEP_MULTIPLE * step_seconds - decoding

    def _cut_prefill(self, start: int, num_new: int) -> int:
        """A lead-priority prefill chunk of `num_new` tokens from `start`, cut to the prefill
        room left (to no less than a block, so that a prompt advances however full the step),
        which it then takes."""
        if self._prefill_room is None:
            return num_new
        fits = self._tokens_fitting(start, self._prefill_room)
        num_new = min(num_new, max(self.kv.block_size, fits))
        self._prefill_room -= self._chunk_seconds(start, num_new)
        return num_new

    def _chunk_seconds(self, start: int, num_new: int) -> float:
        """What `num_new` tokens of one sequence from position `start` add to a sized step."""
        cost = self.step_cost.cost
        return cost.seconds(StepWork.of_chunk(start, num_new)) - cost.fixed

    def _tokens_fitting(self, start: int, seconds: float) -> int:
        """How many tokens of one sequence from position `start` add at most `seconds` to a sized
        step: each costs its matmuls and reading its keys."""
        if seconds <= 0:
            return 0
        cost = self.step_cost.cost
        # per_token * n + per_context * (n * start + n * (n + 1) / 2) <= seconds, solved for n.
        a = cost.per_context / 2
        b = cost.per_token + cost.per_context * (start + 0.5)
        n = seconds / b if a == 0 else (math.sqrt(b * b + 4 * a * seconds) - b) / (2 * a)
        return int(n)

    def _take_turns(
        self, out: SchedulerOutput, first: int, budget: int, room: float | None
    ) -> tuple[int, float | None]:
        """The lower-priority running requests (`running[first:]`) within `budget` tokens and
        `room` seconds (None: unbounded), in turns: arrival order, from the one whose turn is
        next, wrapping round; those left out keep their blocks and come first next step. Returns
        the budget and the room left."""
        others = self.running[first:]
        if not others:
            return budget, room
        start = self._turn_index(others)
        order = others[start:] + others[:start]
        served: set[int] = set()
        self._turn = None
        for request in order:
            if request.status is not RequestStatus.RUNNING:  # preempted for blocks this step
                continue
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, budget)
            if room is not None and num_new > 0:
                fits = self._tokens_fitting(request.num_computed_tokens, room)
                # At least one token a step: realtime traffic slows the others, never stops them.
                num_new = min(num_new, fits if served or fits else 1)
            if num_new <= 0:  # the step is full: its turn comes first in the next
                budget = 0
                self._turn = self._turn or request
                out.deferred_tokens += min(remaining, self.max_num_batched_tokens)
                continue
            if request.media:
                num_new = self._fit_media(request, request.num_computed_tokens, num_new)
                if num_new == 0:  # its next item cannot be encoded this step
                    continue
            if not self._allocate_turn(out, request, num_new, first, served):
                continue  # preempted itself: no blocks for it until others finish
            start_at = request.num_computed_tokens
            out.scheduled.append(ScheduledRequest(request, num_new, start_at))
            request.num_computed_tokens += num_new
            budget -= num_new
            if room is not None:
                room -= self._chunk_seconds(start_at, num_new)
            served.add(id(request))
        return budget, room

    def _turn_index(self, others: list[Request]) -> int:
        """Where in `others` the turns start: at the request whose turn is next, or, were it gone,
        at the first after it in arrival order."""
        turn = self._turn
        if turn is None:
            return 0
        for i, request in enumerate(others):
            if request is turn:
                return i
        i = bisect.bisect_left(others, self._key(turn), key=self._key)
        return i if i < len(others) else 0

    def _allocate_turn(
        self, out: SchedulerOutput, request: Request, num_new: int, first: int, served: set[int]
    ) -> bool:
        """Blocks for a turn's tokens, preempting, when the pool is dry, the worst lower-priority
        request not yet served this step (last, the request itself: False)."""
        while not self.kv.allocate(request, num_new):
            # The request itself is not served yet: there is always one.
            victim = next(r for r in reversed(self.running[first:]) if id(r) not in served)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _fit_media(self, request: Request, start: int, num_new: int) -> int:
        """`num_new` tokens from `start`, cut before the first image or clip the chunk reaches
        whose embeddings cannot be had this step; takes the request's hold on the others
        (encoding those not cached, within the step's encoder budget)."""
        cache = self.encoder_cache
        end = start + num_new
        for item in request.media:
            if item.end <= start or item.offset >= end:
                continue
            h = item.content_hash
            if not cache.holds(request.request_id, h):
                if not cache.cached(h):
                    if item.length > self._encoder_budget or not cache.room_for(item.length):
                        return max(0, item.offset - start)
                    self._encoder_budget -= item.length
                cache.hold(request.request_id, item)
            if item.end <= end:
                self._media_passed.append((request.request_id, h))
        return num_new

    def _top_priority(self) -> int | None:
        """The best priority in the engine; None under fcfs, where all are one class."""
        if self.policy != "priority":
            return None
        heads = [queue[0].priority for queue in (self.running, self.waiting) if queue]
        return min(heads) if heads else None

    def _schedule_running(self, out: SchedulerOutput, budget: int, only: int | None) -> int:
        """Running requests, best first (of priority `only`, if given); returns the budget left.
        Victims are taken from the end, so never one already placed."""
        i = 0
        # A prefill chunk leaves a token for each decode behind it and room for the next waiting
        # prompt: a long prompt's prefill never stalls the others' decoding, nor a new request.
        decodes = sum(1 for r in self.running if _decoding(r, only))
        newcomer = 0
        # Waiting requests lie best first: the first is of priority `only` if any is.
        if self.waiting and len(self.running) < self.max_num_seqs:
            first = self.waiting[0]
            if only is None or first.priority == only:
                newcomer = min(first.num_tokens, self.max_num_batched_tokens // 2)
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if only is not None and request.priority != only:
                break
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if _decoding(request, only):
                decodes -= 1
            else:
                num_new = min(num_new, max(1, budget - decodes - newcomer))
                if only is not None:
                    num_new = self._cut_prefill(request.num_computed_tokens, num_new)
            if request.media:
                num_new = self._fit_media(request, request.num_computed_tokens, num_new)
                if num_new == 0:  # its next item cannot be encoded this step
                    i += 1
                    continue
            while not self.kv.allocate(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(
                    ScheduledRequest(request, num_new, request.num_computed_tokens)
                )
                request.num_computed_tokens += num_new
                budget -= num_new
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, only: int | None) -> int:
        """Waiting requests (of priority `only`, if given) fill the budget, unless the pool was
        just found short; returns the budget left."""
        gate = None if self.max_loras is None else _AdapterGate(self.running, self.max_loras)
        i = 0  # the first waiting request not passed over for want of a LoRA slot
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            if out.preempted and self.policy == "fcfs":
                break
            request = self.waiting[i]
            if only is not None and request.priority != only:
                break
            if request in out.preempted:
                break  # preempted for lack of room this very step
            if gate is not None and not gate.admits(request):
                i += 1
                if i >= MAX_PASSED_OVER:
                    break
                continue
            if self.encoder_only:
                if request.num_tokens > budget:
                    break  # it runs whole: in a later step
                self._start(out, request, request.num_tokens, 0, i)
                budget -= request.num_tokens
                continue
            cached = self.kv.find_cached_prefix(request) if request.reads_prefix_cache else []
            num_cached = len(cached) * self.kv.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if only is not None:
                num_new = self._cut_prefill(num_cached, num_new)
            if request.media:
                num_new = self._fit_media(request, num_cached, num_new)
            if num_new == 0 or not self.kv.allocate(request, num_new, cached):
                self._release_media(request)
                break
            self._start(out, request, num_new, num_cached, i)
            if gate is not None:
                gate.started(request)
            budget -= num_new
        return budget

    def _start(
        self, out: SchedulerOutput, request: Request, num_new: int, num_cached: int, index: int = 0
    ) -> None:
        """Waiting request `index` runs: its first `num_new` tokens after `num_cached`."""
        self.waiting.pop(index)
        request.transition(RequestStatus.RUNNING)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = num_cached
        request.num_computed_tokens = num_cached
        out.scheduled.append(ScheduledRequest(request, num_new, num_cached))
        request.num_computed_tokens += num_new
        _insort(self.running, request, self._key)
