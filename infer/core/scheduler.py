"""The scheduler: which requests run in the next step, and how many tokens each.

There are no prefill and decode phases, only a token budget per step and counts per request:

    budget = max_num_batched_tokens
      1. decodes of running requests, best key first          1 token each (1 + K with K proposals:
                                                               speculative decoding, _update_spec); a
                                                               group's rows beside other requests bounded
                                                               by the step's cost (group_decode_bound.py)
      2. prefill chunks of running, partly prefilled requests  min(remaining, chunk, budget)
      3. admissions from the waiting queue, in key order       min(remaining - prefix hit, chunk, budget)
         (none in a step where 1. or 2. had to preempt: the pool is full); the sequences of one API
         request (its n choices: a group) in waves of a fair share of max_num_seqs (group_shares.py),
         so that one request cannot take the whole batch

A request's key is (priority, arrival_time, seq) under "priority", (0, arrival_time, seq) under
"fcfs", and (0, deadline, seq) under "slo", where deadline = arrival_time + its TTFT objective
(slo_max_wait_s without one); both queues are kept sorted by it, so `running[-1]` is always the
preemption victim (lowest priority, latest arrival or deadline) and a preempted request re-enters the
waiting queue at its original position.

"slo" (infer/core/slo.py has the objectives and the step-cost model, fit online from the engine's steps):
  - admission order, each step: first the requests that have waited slo_max_wait_s or more (in arrival
    order), then those that can still meet their TTFT deadline (earliest deadline first; one without
    an objective is due slo_max_wait_s after arrival), then the ones that cannot (earliest deadline
    first): a request that will be late anyway does not make others late. Head-of-line blocking as in
    (b) below, along this order.
  - prefill beside decodes: clients judge a request's gaps by their p95, so a request with a TPOT
    objective may have SLOW_GAP_SHARE of its gaps (of max_tokens - 1) longer than it. Once a decoding
    request has spent that, the step's prefill tokens are cut so that the step is predicted to end
    within its objective (the tightest of such requests'); at least MIN_SLO_PREFILL_TOKENS a step, so
    prompts always progress. Capping every gap, or lending a request's mean-rate slack, measured worse
    (docs/slo-scheduling.md has what the policy buys).

Why no request is preempted forever:
  (a) a request is preempted only in favour of one with a strictly better key: a running request short
      of blocks preempts the worst-keyed running request (itself, if it is the worst), and under
      "priority" a waiting request preempts a running one only if that one's priority value is larger;
  (b) the waiting queue is served strictly in key order with head-of-line blocking: when the head
      cannot be admitted, nothing behind it is, so the running set drains and the head gets in. The
      exceptions pass a head that waits for its own kind to progress: a long prompt held back by
      max_long_partial_prefills; a group's sequence while its group holds its share of the batch (at
      least one sequence, which runs to its end, and then the next wave gets in) or of the step's
      rows and chunks (prefill_pacer.py, group_decode_bound.py); and, by the pacer (module
      prefill_pacer.py), a long prompt that whole short prompts pass in a step (at most one such step
      per arriving short prompt);
  (c) the best-keyed running request is never a victim, always gets budget (the others' decodes take at
      most max_num_seqs - 1 <= max_num_batched_tokens - 1 tokens), and can always get blocks, since
      add_request refused any request that the whole pool cannot hold. A group's decode that the step-cost
      bound holds back waits a finite number of steps: each step runs at least one row of every group,
      those with the fewest tokens first, so every row of a group gets its turn.
  So the best-keyed unfinished request finishes in finitely many steps, then the next one, and so on by
  induction on the key order: every request finishes, so none is preempted forever, and preemptions never
  cycle. Under fcfs the requests that can preempt R are fixed when R arrives (the earlier arrivals).
  Under "slo" (b) holds along its admission order, and no request is deferred past slo_max_wait_s: from
  then on it is served before every request that arrived after it (the urgent ones go first, in arrival
  order), so its wait is bounded by slo_max_wait_s plus the service of the urgent requests that arrived
  before it. The requests that can preempt a running R are those with an earlier deadline, hence that
  arrived before R's deadline: finitely many, so R is preempted finitely often.
  Under "priority" an endless stream of more urgent arrivals delays a less urgent request by design
  (strict priority); with equal priorities the policy is exactly fcfs, since (a) then never lets a
  waiting request preempt and both queues are ordered by arrival.
"""

from __future__ import annotations

import itertools
import math
import time
from bisect import insort
from collections.abc import Callable, Iterable

from infer.config import CacheConfig, SchedulerConfig
from infer.core.group_decode_bound import GroupDecodeBound
from infer.core.group_shares import GroupShares, crowded_groups
from infer.core.kv_cache_manager import make_kv_cache_manager
from infer.core.outputs import ModelRunnerOutput, RequestOutput, ScheduledRequest, SchedulerOutput, StepStats
from infer.core.prefill_pacer import NextPrompt, PrefillPacer
from infer.core.request import Request, RequestStatus
from infer.core.slo import LateRequest, StepCostModel

# A prompt whose prefill a newcomer interrupted (LLMEngine, "Interrupted steps") gets chunks of at most
# this many tokens: a later newcomer that may not stop a step waits for one such step, not a 2,048-token
# one. On a CPU they cost the prompt a few percent (docs/robustness.md, "Newcomers during a long prompt").
INTERRUPTED_CHUNK = 256
MIN_SLO_PREFILL_TOKENS = 16  # "slo": the prefill a step keeps however tight the decodes' objectives
SLOW_GAP_SHARE = 0.04  # "slo": the share of a request's gaps that may exceed its tpot (clients judge the p95)


class _StepPlan:
    """Tokens granted per request during one schedule() call; a grant can be undone by a preemption."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.num_new_tokens: dict[Request, int] = {}  # insertion order: decodes, prefill chunks, admissions
        self.cost: dict[Request, int] = {}  # what each grant took from the budget
        self.preempted_req_ids: list[str] = []
        self.paced: int | None = None  # prefill tokens the pacer leaves to running prompts' chunks
        self.paced_admissions = False  # and to admissions too (beside decodes)
        # a prompt held behind the streams, and the units of whole short prompts that may pass it
        self.held: Request | None = None
        self.spare: int | None = None
        self.crowded_units: int | None = None  # cost units left to the crowded groups' long chunks
        self.group_rows_left: int | None = None  # rows left to the groups' admissions (None: any)
        self.group_rows_used = 0  # the groups' rows this step: decodes, then admissions' prompt tokens
        self.spec_token_ids: dict[Request, list[int]] = {}  # the proposals a decode feeds after its token

    def available(self, admission: bool) -> int:
        """Budget for the next prefill grant: a running prompt's chunk, or an admission."""
        if admission and self.spare is not None:
            return min(self.budget, self.spare)
        if self.paced is None or (admission and not self.paced_admissions):
            return self.budget
        return min(self.budget, self.paced)

    def grant(self, req: Request, num_new_tokens: int, cost: int | None = None) -> None:
        self.num_new_tokens[req] = num_new_tokens
        self.cost[req] = num_new_tokens if cost is None else cost
        self.budget -= self.cost[req]
        if self.paced is not None:  # set after the decodes' grants: this one is prefill
            self.paced = max(0, self.paced - self.cost[req])
        if self.spare is not None:
            self.spare = max(0, self.spare - self.cost[req])

    def revoke(self, req: Request) -> None:
        self.num_new_tokens.pop(req, None)
        self.spec_token_ids.pop(req, None)
        self.budget += self.cost.pop(req, 0)


class Scheduler:
    """Owns the requests and the KV cache manager; the engine drives it one step at a time:

        out = scheduler.schedule()        # never empty while a request can run
        runner_out = runner.execute(out)  # one sampled token per ScheduledRequest with sample=True
        deltas = scheduler.update(out, runner_out)

    Invariants (checked by `check_integrity`): every unfinished request is in exactly one of `waiting`
    (WAITING or PREEMPTED, no blocks, num_computed_tokens == 0) and `running` (RUNNING, holding blocks
    for its computed tokens); both are sorted by key; len(running) <= max_num_seqs.
    clock: the time source of request timestamps (injectable for tests).
    cost_model: the "slo" policy's step-cost model (injectable for tests; the engine feeds it through
        observe_step).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        clock: Callable[[], float] = time.monotonic,
        cost_model: StepCostModel | None = None,
    ) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.kv_cache_manager = make_kv_cache_manager(cache_config, scheduler_config.max_model_len)
        self.clock = clock
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self.waiting: list[Request] = []  # sorted by key; WAITING and PREEMPTED requests, no blocks
        self.running: list[Request] = []  # sorted by key; RUNNING requests, holding blocks
        self.num_preemptions = 0
        self._by_priority = scheduler_config.policy == "priority"
        self._slo = scheduler_config.policy == "slo"
        self.cost_model = cost_model or StepCostModel()
        self._static = scheduler_config.batching_mode == "static"
        self._wave_slots = 0  # static batching: admissions left in the current wave
        self._finished_req_ids: list[str] = []  # since the last schedule()
        self._last_decodes: list[Request] = []  # "slo": the decodes of the last step, for observe_step
        self.pacer = PrefillPacer(scheduler_config.max_decode_slowdown)
        self._crowded: set[str] = set()  # this step's groups of several requests (group_shares.py)
        self._held_for_newcomer = False  # the last paced step held the groups' decodes for a newcomer
        self._group_chunk = 0  # this step's cap on their prompts' chunks (0: none)
        self.group_decode_bound = GroupDecodeBound(self.pacer)
        # the last step's decodes and prefill cost units, for observe_step
        self._last_step: tuple[list[Request], int] = ([], 0)
        # What a prompt token whose logprobs are asked for costs in the budget, in tokens: its row of the
        # LM head (and the log-softmax over the vocabulary) comes on top. Set by the engine from the model.
        self.prompt_logprob_token_cost = 1.0
        # Speculative decoding's counters (vLLM's spec_decode metrics): proposals verified, accepted, and
        # accepted at each position (0 = the first proposal of a step).
        self.num_spec_drafts = 0  # steps of a request that verified proposals
        self.num_spec_draft_tokens = 0
        self.num_spec_accepted_tokens = 0
        self.num_spec_accepted_per_pos: list[int] = []
        self._spec_in_flight: dict[str, int] = {}  # req_id -> proposals fed in the step not yet updated

    def _key(self, req: Request) -> tuple[int, float, int]:
        if self._slo:
            return (0, self.deadline(req), req.seq)
        return (req.priority if self._by_priority else 0, req.arrival_time, req.seq)

    def deadline(self, req: Request) -> float:
        """When req's first token is due: arrival + its TTFT objective, or + slo_max_wait_s without one."""
        ttft = req.slo.ttft_s if req.slo is not None and req.slo.ttft_s is not None else None
        return req.arrival_time + (ttft if ttft is not None else self.config.slo_max_wait_s)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """The last step, of num_tokens, took seconds: what the "slo" policy's cost model learns from,
        and a slow gap for each of its decodes whose TPOT objective it exceeded. Nothing under the other
        policies (no work on their steps). The prefill pacer learns from every step."""
        self.pacer.observe(*self._last_step, seconds)
        self._last_step = ([], 0)
        if not self._slo:
            return
        self.cost_model.observe(num_tokens, seconds)
        for req in self._last_decodes:
            if req.slo is not None and req.slo.tpot_s is not None and seconds > req.slo.tpot_s:
                req.num_slow_gaps += 1
        self._last_decodes = []

    def is_crowded(self, req_id: str) -> bool:
        """Whether the request belongs to a group of several requests at the last schedule (one
        client's flood, or one request's n choices)."""
        req = self.requests.get(req_id)
        return req is not None and req.group_id in self._crowded

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- admission -----------------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a new request. ValueError if its id is taken or it could never run to completion."""
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use by an unfinished request")
        if req.status != RequestStatus.WAITING or req.output_token_ids:
            raise ValueError(f"request {req.req_id!r} was already run; build a new Request")
        self._check_fits(req)
        if self._slo and self.config.slo_reject_late:
            self._check_on_time(req)
        self.requests[req.req_id] = req
        insort(self.waiting, req, key=self._key)

    def _check_on_time(self, req: Request) -> None:
        """LateRequest if even a lower bound of req's first token misses its TTFT deadline: the prefill
        tokens ahead of it (waiting with an earlier deadline, running still in prefill) and its own, in
        full steps back to back at the cost model's rate, decodes ignored."""
        if req.slo is None or req.slo.ttft_s is None:
            return
        key = self._key(req)
        ahead = [r for r in self.waiting if self._key(r) < key]
        tokens = req.num_tokens + sum(r.num_tokens - r.num_computed_tokens for r in ahead)
        tokens += sum(r.num_tokens - 1 - r.num_computed_tokens for r in self.running if r.is_prefill)
        budget = self.config.max_num_batched_tokens
        predicted = -(-tokens // budget) * self.cost_model.a + self.cost_model.b * tokens
        if self.clock() + predicted > self.deadline(req):
            raise LateRequest(
                f"request {req.req_id!r} cannot meet its time-to-first-token objective of "
                f"{req.slo.ttft_s * 1000:.0f} ms: {tokens} prompt tokens are queued up to and including it, "
                f"at least {predicted * 1000:.0f} ms of prefill on this server now; retry later or relax it"
            )

    def _check_fits(self, req: Request) -> None:
        cfg, kv = self.config, self.kv_cache_manager
        num_prompt, max_tokens = req.num_prompt_tokens, req.sampling_params.max_tokens
        if num_prompt == 0:
            raise ValueError(f"request {req.req_id!r} has an empty prompt; send at least one token")
        num_total = num_prompt + max_tokens
        if num_total > cfg.max_model_len:
            raise ValueError(
                f"request {req.req_id!r}: prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = "
                f"{num_total} exceeds max_model_len ({cfg.max_model_len}); "
                "shorten the prompt or lower max_tokens"
            )
        num_kv = num_total - 1  # the last sampled token is never fed back, so it needs no KV
        if num_kv > kv.max_request_tokens:
            raise ValueError(
                f"request {req.req_id!r} needs KV for up to {num_kv} tokens but the cache holds at most "
                f"{kv.max_request_tokens} per request ({kv.num_blocks} blocks of {kv.block_size}); "
                "lower max_tokens, shorten the prompt or give the cache more blocks"
            )
        if not cfg.enable_chunked_prefill and num_kv > cfg.max_num_batched_tokens:
            raise ValueError(
                f"request {req.req_id!r}: with chunked prefill off, up to {num_kv} tokens (prompt + "
                "generated tokens, recomputed after a preemption) must fit one step's "
                f"max_num_batched_tokens ({cfg.max_num_batched_tokens}); enable chunked prefill, raise the "
                "budget or lower max_tokens"
            )

    # -- one step ------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work. Advances num_computed_tokens of every scheduled request (the runner
        is trusted to compute them); `update` must follow with the runner's output."""
        if self._static and not self.running:
            self._wave_slots = self.config.max_num_seqs  # the previous wave is done: open a new one
        num_evictions = self.kv_cache_manager.num_evictions
        self._crowded = crowded_groups([*self.running, *self.waiting])  # a group of one request is a single
        self._group_chunk = 0
        if self.pacer.enabled and self._crowded:
            num_decodes = sum(not r.is_prefill for r in self.running)
            others = any(r.group_id not in self._crowded for r in (*self.running, *self.waiting))
            self._group_chunk = self.pacer.group_chunk(num_decodes, others)
        plan = self._plan(paced=True)
        if not plan.num_new_tokens and not plan.preempted_req_ids and self.running:
            # what pacing left (a short newcomer that could not get in, a decode-only step whose rows
            # the group bound held back) would idle the step: it runs unpaced instead
            plan = self._plan(paced=False)
        return self._emit(plan, self.kv_cache_manager.num_evictions - num_evictions)

    def _plan(self, paced: bool) -> _StepPlan:
        plan = _StepPlan(self.config.max_num_batched_tokens)
        plan.crowded_units = self._group_chunk or None
        self._schedule_running(plan, paced)
        if not plan.preempted_req_ids:  # memory is short: admitting more would only preempt more
            self._schedule_waiting(plan)
        return plan

    def _num_new_tokens(
        self, req: Request, num_computed: int, budget: int, crowded_units: int | None = None
    ) -> int:
        """Tokens req may feed now (0 = none): a chunk if chunking, else all remaining or nothing. A long
        prompt's chunk is at most long_prefill_token_threshold; the crowded groups' long prompts' chunks
        of a step together at most crowded_units (what is left of the pacer's group_chunk);
        prompt-logprob tokens cost more."""
        num_new = req.num_tokens - num_computed
        budget = int(budget // self._token_cost(req, num_computed))
        if self.config.enable_chunked_prefill:
            threshold = self.config.long_prefill_token_threshold
            if 0 < threshold < num_new:
                num_new = threshold
            if req.num_interruptions:  # newcomers came while it was prefilled: more may (INTERRUPTED_CHUNK)
                num_new = min(num_new, INTERRUPTED_CHUNK)
            if crowded_units is not None and self._cut(req, num_computed):
                num_new = min(num_new, int(crowded_units // self._token_cost(req, num_computed)))
            return min(num_new, self.config.prefill_chunk_size, budget)
        return num_new if num_new <= budget else 0

    def _token_cost(self, req: Request, start: int) -> float:
        return self.prompt_logprob_token_cost if _wants_prompt_logprobs(req, start) else 1.0

    def _grant(self, plan: _StepPlan, req: Request, num_new: int, start: int) -> None:
        units = self._units(req, num_new, start)
        plan.grant(req, num_new, min(plan.budget, units))
        if plan.crowded_units is not None and self._cut(req, start):
            plan.crowded_units = max(0, plan.crowded_units - units)

    def _units(self, req: Request, num_tokens: int, start: int) -> int:
        """The cost units of req's num_tokens from position start (prompt-logprob tokens cost more)."""
        return math.ceil(num_tokens * self._token_cost(req, start))

    def _cut(self, req: Request, num_computed: int) -> bool:
        """Whether req's chunks count in the crowded groups' share of a step: a crowded group's prompt
        longer than the group chunk (its whole short prompts go in whole, as anyone's)."""
        return req.group_id in self._crowded and req.num_tokens - num_computed > self._group_chunk

    def _schedule_running(self, plan: _StepPlan, paced: bool) -> None:
        """Decodes first (a group's rows bounded beside other requests: group_decode_bound.py), then
        prefill chunks of running requests, each pass best key first. paced: False leaves both bounds
        and the pacer out."""
        held_back = self._held_back_decodes(plan) if paced else set()
        num_decodes_left = sum(not r.is_prefill and r not in held_back for r in self.running)
        for decode_pass in (True, False):
            if not decode_pass:
                if paced:
                    self._pace_prefill(plan)
                if self._slo:
                    self._cap_prefill(plan)
            for req in list(self.running):
                if plan.available(admission=False) == 0:
                    return
                if req.status != RequestStatus.RUNNING or req.is_prefill == decode_pass or req in held_back:
                    continue  # preempted earlier in this loop, not this pass's kind, or its group's row waits
                budget = plan.budget if decode_pass else plan.available(admission=False)
                num_new = self._num_new_tokens(req, req.num_computed_tokens, budget, plan.crowded_units)
                spec = []
                if decode_pass:
                    num_decodes_left -= 1  # the decodes after this one keep a token each
                    spec = self._spec_tokens(req, plan.budget - 1 - num_decodes_left) if num_new else []
                if not num_new or not self._allocate_or_preempt(req, num_new, plan, len(spec)):
                    continue
                if spec:
                    plan.spec_token_ids[req] = spec
                    plan.grant(req, num_new, num_new + len(spec))  # a decode with K proposals: 1 + K
                else:
                    self._grant(plan, req, num_new, req.num_computed_tokens)

    def _held_back_decodes(self, plan: _StepPlan) -> set[Request]:
        """The groups' decodes that wait this step so that the step costs the requests outside any group
        at most max_decode_slowdown x their own (those running and those the step may admit); the rows
        that bound leaves to the groups' admissions go to plan.group_rows_left. A step that may admit a
        short newcomer from outside the groups holds all of their decodes (not two steps in a row)."""
        crowded = self._crowded
        if not crowded:
            return set()
        running_others = sum(r.group_id not in crowded for r in self.running)
        seats = self.config.max_num_seqs - len(self.running)
        waiting_others = min(seats, sum(r.group_id not in crowded for r in self.waiting))
        decodes = [r for r in self.running if not r.is_prefill and r.group_id in crowded]
        newcomer = seats > 0 and any(
            r.group_id not in crowded and self._is_short(r, plan.budget)
            for r in itertools.islice(self.waiting, seats)
        )
        if newcomer and not self._held_for_newcomer:
            # a short newcomer's prefill beside no group row: its first token waits for no flood's
            # decodes (every other step at most, so that newcomers never starve the groups)
            self._held_for_newcomer = True
            plan.group_rows_used, plan.group_rows_left = 0, 0
            return set(decodes)
        self._held_for_newcomer = False
        held, limit = self.group_decode_bound.held_back(decodes, running_others + waiting_others)
        plan.group_rows_used = len(decodes) - len(held)
        plan.group_rows_left = None if limit is None else max(0, limit - plan.group_rows_used)
        return held

    def _spec_tokens(self, req: Request, budget: int) -> list[int]:
        """The proposals a decode verifies this step: its own, as many as the budget leaves and as can
        be emitted (with the sampled token, the step emits up to 1 + K tokens: never past max_tokens)."""
        room = req.sampling_params.max_tokens - req.num_output_tokens - 1
        return req.spec_token_ids[: max(0, min(room, budget))]

    def _pace_prefill(self, plan: _StepPlan) -> None:
        """Beside running decodes, leave the step only the prefill the pacer allows (prefill_pacer.py),
        admissions included. With no decode but requests waiting, running prompts' chunks leave room for
        the first of them: a new request does not wait behind a long prompt's whole prefill."""
        if not self.pacer.enabled:
            return
        decodes = list(plan.num_new_tokens)  # the decodes granted so far
        if decodes:
            wanted = self._unpaced_prefill_units(plan)
            if wanted:  # else a decode-only step anyway (a stream's credit is earned when asked for)
                prompt = self._next_prompt()
                plan.paced = self.pacer.prefill_limit(decodes, wanted, prompt)
                plan.paced_admissions = True
                if plan.paced == 0 and self.pacer.spare and prompt is not None:
                    # held behind the streams, the prompt does not hold up a newcomer the credit pays for
                    plan.held, plan.spare = prompt.req, self.pacer.spare
        elif self.waiting and len(self.running) < self.config.max_num_seqs:
            # a short newcomer's prefill first, alone, so that its first token waits neither for a long
            # prompt's chunk nor for the long prompts queued before it (it is paced like any stream once
            # it decodes); else a long head shares the step with the running prompts' chunks
            short = [self._is_short(r, plan.budget) for r in self.waiting]
            if short[0]:
                plan.paced = 0
            elif any(short):
                plan.paced, plan.spare = 0, plan.budget  # only whole short prompts pass the long ones
            else:
                plan.paced = plan.budget // 2

    def _next_prompt(self) -> NextPrompt | None:
        """The prompt this step's prefill serves first (a running prompt's chunk, else the head of the
        queue), for the pacer's choice of order."""
        req = next((r for r in self.running if r.is_prefill), None) or next(iter(self.waiting), None)
        if req is None:
            return None
        total = self._units(req, req.num_tokens, 0)
        done = self._units(req, req.num_computed_tokens, 0)
        return NextPrompt(req, max(1, total - done), total, self.clock() - req.arrival_time)

    def _unpaced_prefill_units(self, plan: _StepPlan) -> int:
        """The cost units of the prefill chunks this step would carry unpaced: running prompts' next
        chunks, then the first ones of the waiting requests the batch has seats for, up to the budget
        left (the seats bound the walk: a flood of 512 short requests is not walked every step)."""
        units, crowded_left = 0, plan.crowded_units
        seats = max(0, self.config.max_num_seqs - len(self.running))
        for req in (*(r for r in self.running if r.is_prefill), *itertools.islice(self.waiting, seats)):
            if units >= plan.budget:
                break
            start = req.num_computed_tokens
            num_new = self._num_new_tokens(req, start, plan.budget - units, crowded_left)
            chunk = self._units(req, num_new, start)
            units += chunk
            if crowded_left is not None and self._cut(req, start):
                crowded_left = max(0, crowded_left - chunk)
        return min(units, plan.budget)

    def _cap_prefill(self, plan: _StepPlan) -> None:
        """ "slo": leave the step only the prefill tokens that let it end within the tightest TPOT
        objective of the decodes granted so far that have no slow gap left to spend (module docstring);
        at least MIN_SLO_PREFILL_TOKENS."""
        limit = None
        for req in plan.num_new_tokens:  # the decodes granted so far
            tpot = req.slo.tpot_s if req.slo is not None else None
            allowed = int(SLOW_GAP_SHARE * (req.sampling_params.max_tokens - 1))
            if tpot is not None and req.num_slow_gaps >= allowed:
                limit = tpot if limit is None else min(limit, tpot)
        if limit is None:
            return
        num_decode = sum(plan.num_new_tokens.values())
        prefill = max(MIN_SLO_PREFILL_TOKENS, self.cost_model.tokens_within(limit) - num_decode)
        plan.budget = min(plan.budget, prefill)

    def _allocate_or_preempt(
        self, req: Request, num_new_tokens: int, plan: _StepPlan, num_spec_tokens: int = 0
    ) -> bool:
        """Get blocks for req (and its proposals), preempting the worst-keyed running requests until they
        fit. False when req itself was the worst and got preempted."""
        kv = self.kv_cache_manager
        while kv.allocate_slots(req, num_new_tokens, num_lookahead_tokens=num_spec_tokens) is None:
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is req:
                return False
        return True

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Admit waiting requests in key order while the budget, max_num_seqs and the pool allow.
        Stops at the first request that cannot be admitted (head-of-line blocking, see module doc), but
        for a long prompt held back by max_long_partial_prefills, which shorter prompts may pass, and a
        group's sequence past its group's share, which other requests may pass."""
        kv = self.kv_cache_manager
        order = self._slo_order() if self._slo else list(self.waiting)
        partial, long_partial = self._partial_prefills(plan)
        groups = GroupShares(self.config.max_num_seqs, self.running, self.waiting)
        i = 0
        wave_full = self._static and self._wave_slots == 0
        while i < len(order) and plan.available(admission=True) > 0 and not wave_full:
            req = order[i]
            if len(self.running) >= self.config.max_num_seqs:
                if self._preempt_for(req, plan):
                    order = self._slo_order() if self._slo else list(self.waiting)
                    continue
                return
            if not groups.may_admit(req) or (plan.group_rows_left == 0 and req.group_id in self._crowded):
                i += 1  # its group holds its share of the batch or of the step: others may pass
                continue
            computed_blocks, num_hit = kv.get_computed_blocks(req)
            num_new = self._num_new_tokens(req, num_hit, plan.available(admission=True), plan.crowded_units)
            if self._over_group_rows(plan, req, num_new):
                i += 1  # its prompt's tokens are rows of the step, as decodes are: more than are left
                continue
            if num_new == 0 and plan.crowded_units is not None and self._cut(req, num_hit):
                i += 1  # its group's chunks for this step are spent: others may pass
                continue
            if plan.spare is not None and (req is plan.held or num_hit + num_new < req.num_tokens):
                i += 1  # only whole short prompts pass a prompt held behind the streams
                continue
            if num_new == 0:
                return
            if num_hit + num_new < req.num_tokens:  # its prefill goes on after this step
                if 0 < self.config.max_num_partial_prefills <= partial:
                    return
                if self._is_long(req) and 0 < self.config.max_long_partial_prefills <= long_partial:
                    i += 1  # a shorter prompt behind it may go first
                    continue
            if kv.allocate_slots(req, num_new, computed_blocks) is None:
                if self._preempt_for(req, plan):
                    order = self._slo_order() if self._slo else list(self.waiting)
                    continue  # look up the prefix again: the victim's blocks may now be hits
                return
            order.pop(i)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self.clock()
                req.num_cached_tokens = num_hit
            insort(self.running, req, key=self._key)
            self._grant(plan, req, num_new, num_hit)
            groups.admitted(req)
            if plan.group_rows_left is not None and req.group_id in self._crowded:
                plan.group_rows_left = max(0, plan.group_rows_left - num_new)
                plan.group_rows_used += num_new
            if num_hit + num_new < req.num_tokens:
                partial += 1
                long_partial += self._is_long(req)
            if self._static:
                self._wave_slots -= 1
                wave_full = self._wave_slots == 0

    def _over_group_rows(self, plan: _StepPlan, req: Request, num_new: int) -> bool:
        """Whether admitting req's num_new prompt tokens would pass the rows the group bound leaves the
        groups (group_decode_bound.py); a step with no group row yet admits one whatever its length, so
        that the groups progress."""
        if plan.group_rows_left is None or req.group_id not in self._crowded:
            return False
        return num_new > plan.group_rows_left and plan.group_rows_used > 0

    def _is_short(self, req: Request, budget: int) -> bool:
        """Whether req's whole prompt is a short newcomer's, which a step runs first, alone: at most half
        the step's budget (AsyncEngine counts such arrivals by the same rule, in tokens)."""
        return self._units(req, req.num_tokens, 0) <= budget // 2

    def _is_long(self, req: Request) -> bool:
        threshold = self.config.long_prefill_token_threshold
        return 0 < threshold < req.num_prompt_tokens

    def _partial_prefills(self, plan: _StepPlan) -> tuple[int, int]:
        """Running requests whose prefill goes on after this step's grants: (all, long ones)."""
        partial = [
            r
            for r in self.running
            if r.num_computed_tokens + plan.num_new_tokens.get(r, 0) < r.num_tokens - 1
        ]
        return len(partial), sum(self._is_long(r) for r in partial)

    def _slo_order(self) -> list[Request]:
        """ "slo" admission order: waited slo_max_wait_s or more (arrival order), then able to meet the
        TTFT deadline (by deadline), then not (by deadline). Able: its tokens, prefilled alone from now,
        would end by its deadline (the cost model's time for them; waiting requests hold no KV)."""
        now, max_wait = self.clock(), self.config.slo_max_wait_s
        urgent, feasible, late = [], [], []
        for req in self.waiting:  # by deadline
            if now - req.arrival_time >= max_wait:
                urgent.append(req)
            elif now + self.cost_model.seconds(req.num_tokens) <= self.deadline(req):
                feasible.append(req)
            else:
                late.append(req)
        urgent.sort(key=lambda r: (r.arrival_time, r.seq))
        return urgent + feasible + late

    def _preempt_for(self, req: Request, plan: _StepPlan) -> bool:
        """Under "priority", preempt the worst running request if it is strictly less urgent than req."""
        if not self._by_priority or not self.running or self.running[-1].priority <= req.priority:
            return False
        self._preempt(self.running[-1], plan)
        return True

    def _preempt(self, req: Request, plan: _StepPlan) -> None:
        """Recompute-style preemption: drop req's blocks (full ones stay in the prefix cache), undo its
        grant for this step, and put it back in the waiting queue at its original position."""
        self.running.remove(req)
        plan.revoke(req)
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        insort(self.waiting, req, key=self._key)
        plan.preempted_req_ids.append(req.req_id)
        if self._static:
            self._wave_slots += 1  # the slot goes back to the wave the request belonged to

    def _emit(self, plan: _StepPlan, num_evictions: int) -> SchedulerOutput:
        kv = self.kv_cache_manager
        scheduled, num_prefill, num_decode, num_spec = [], 0, 0, 0
        decodes, prefill_units = [], 0
        for req, num_new in plan.num_new_tokens.items():
            start = req.num_computed_tokens
            end = start + num_new
            sample = end == req.num_tokens
            spec = plan.spec_token_ids.get(req, [])
            req.spec_token_ids = []  # consumed: the next step's are proposed after this one
            scheduled.append(
                ScheduledRequest(
                    req_id=req.req_id,
                    token_ids=req.token_ids[start:end] + spec,
                    start_pos=start,
                    block_ids=kv.block_ids(req),
                    sample=sample,
                    sampling_params=req.sampling_params,
                    num_prompt_tokens=req.num_prompt_tokens,
                    history=req.token_ids if _needs_history(req, start, sample) else None,
                    prompt_logprobs=_wants_prompt_logprobs(req, start),
                    spec_token_ids=spec,
                )
            )
            if req.decodes_from(start):
                num_decode += num_new + len(spec)
                num_spec += len(spec)
                decodes.append(req)
                if self._slo:
                    self._last_decodes.append(req)
            else:
                num_prefill += num_new
                prefill_units += plan.cost[req]
                req.num_prefill_tokens_computed += num_new
            # past the known sequence while proposals are in flight: update() rolls back the rejected
            req.num_computed_tokens = end + len(spec)
            if spec:
                self._spec_in_flight[req.req_id] = len(spec)
        self._last_step = (decodes, prefill_units)
        stats = StepStats(
            num_prefill_tokens=num_prefill,
            num_decode_tokens=num_decode,
            num_spec_tokens=num_spec,
            num_preemptions=len(plan.preempted_req_ids),
            num_evictions=num_evictions,
            num_blocks_used=kv.num_used_blocks,
            num_blocks_cached=kv.num_cached_blocks,
            num_blocks_free=kv.num_free_blocks,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
        )
        finished, self._finished_req_ids = self._finished_req_ids, []
        return SchedulerOutput(scheduled, num_prefill + num_decode, finished, plan.preempted_req_ids, stats)

    def undo(self, sched_out: SchedulerOutput, seconds: float) -> None:
        """Forget a step that was stopped before its end (LLMEngine: a long step interrupted for a
        newcomer), in place of `update`: each request's computed tokens go back to where the step
        started (nothing was sampled). Its blocks stay its own, and none of them was cached (cache_blocks
        runs in update), so the keys and values the step wrote are overwritten when it runs again."""
        for sched in sched_out.scheduled:
            assert not sched.spec_token_ids, "a step that verifies proposals is not undone"
            req = self.requests.get(sched.req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens = sched.start_pos
            if not req.decodes_from(sched.start_pos):
                req.num_prefill_tokens_computed -= sched.num_tokens
            req.num_interruptions += 1
            req.seconds_lost += seconds
        self._last_step = ([], 0)
        self._last_decodes = []

    def update(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[RequestOutput]:
        """Apply a step's results: cache newly full blocks, append sampled tokens, finish on EOS / stop
        token ids / max_tokens (min_tokens and ignore_eos respected) and free finished requests' blocks.
        Requests finished between schedule() and update() (aborts) are skipped."""
        now = self.clock()
        self._spec_in_flight.clear()
        sampled = dict(zip(runner_out.req_ids, runner_out.sampled_token_ids, strict=True))
        logprobs = {}
        if runner_out.logprobs is not None:
            logprobs = dict(zip(runner_out.req_ids, runner_out.logprobs, strict=True))
        outputs = []
        for sched in sched_out.scheduled:
            req = self.requests.get(sched.req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            if sched.spec_token_ids:
                accepted = runner_out.accepted_token_ids.get(req.req_id, [])
                outputs.append(self._update_spec(req, sched, accepted, sampled[req.req_id], now))
                continue
            self.kv_cache_manager.cache_blocks(req)  # before a finish frees them, so they stay reusable
            if not sched.sample:
                continue
            assert sched.req_id in sampled, f"the runner sampled no token for {sched.req_id}"
            token_id = sampled[sched.req_id]
            status = req.append_output_token(token_id, now)
            if status is not None:
                self._finish(req, status, now)
            outputs.append(
                RequestOutput(
                    req_id=req.req_id,
                    new_token_ids=[token_id],
                    finished=req.is_finished(),
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                    logprobs=logprobs.get(req.req_id),
                    num_cached_tokens=req.num_cached_tokens,
                )
            )
        return outputs

    def _update_spec(
        self, req: Request, sched: ScheduledRequest, accepted: list[int], sampled: int, now: float
    ) -> RequestOutput:
        """A decode that verified proposals: keep the accepted ones and the token sampled after them.

            positions:  N-1      N    ...  N-1+a    N+a  ...  N-1+K
            fed:      [ last | d1  ...   da     | d(a+1) ... dK ]     KV written for all of them
                        <-- kept: accepted --->  <--- rejected --->   num_computed_tokens = N + a
            emitted:           d1  ...   da  + the token sampled at position N-1+a

        Rolling back is lowering num_computed_tokens: the rejected tokens' slots are overwritten by the
        next step, and no block holding them is ever hashed (cache_blocks runs after the rollback and
        stops at num_computed_tokens). Emission stops at a stop token or max_tokens."""
        assert accepted == sched.spec_token_ids[: len(accepted)], (req.req_id, accepted)
        req.num_computed_tokens -= len(sched.spec_token_ids) - len(accepted)
        new_token_ids, status = [], None
        for token_id in (*accepted, sampled):
            new_token_ids.append(token_id)
            status = req.append_output_token(token_id, now)
            if status is not None:
                break
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
        self.kv_cache_manager.cache_blocks(req)
        self.num_spec_drafts += 1
        self.num_spec_draft_tokens += len(sched.spec_token_ids)
        self.num_spec_accepted_tokens += len(accepted)
        per_pos = self.num_spec_accepted_per_pos
        per_pos.extend([0] * (len(accepted) - len(per_pos)))
        for pos in range(len(accepted)):
            per_pos[pos] += 1
        if status is not None:
            self._finish(req, status, now)
        return RequestOutput(  # no logprobs: requests that want them are given no proposals
            req_id=req.req_id,
            new_token_ids=new_token_ids,
            finished=req.is_finished(),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            num_cached_tokens=req.num_cached_tokens,
        )

    # -- ending requests -----------------------------------------------------------------------------

    def finish_requests(
        self, req_ids: str | Iterable[str], status: RequestStatus, stop_reason: str | None = None
    ) -> list[RequestOutput]:
        """End requests from outside (abort, a stop string found by the engine, an error) in any state.

        Unknown or already finished ids are ignored. Returns one final output per request ended here.
        """
        if not status.is_finished():
            raise ValueError(f"finish_requests needs a FINISHED_* status, got {status.name}")
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        now = self.clock()
        outputs = []
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if stop_reason is not None:
                req.stop_reason = stop_reason
            self._finish(req, status, now)
            outputs.append(
                RequestOutput(
                    req_id=req_id,
                    new_token_ids=[],
                    finished=True,
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                    num_cached_tokens=req.num_cached_tokens,
                )
            )
        return outputs

    def _finish(self, req: Request, status: RequestStatus, now: float) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self.kv_cache_manager.free(req)
        else:
            self.waiting.remove(req)
        req.status = status
        req.finished_time = now
        del self.requests[req.req_id]
        self._finished_req_ids.append(req.req_id)

    def check_integrity(self) -> None:
        """Queues sorted and disjoint, statuses consistent with them, blocks held only by running requests."""
        kv = self.kv_cache_manager
        kv.check_integrity()
        assert self.running == sorted(self.running, key=self._key), "running is out of key order"
        assert self.waiting == sorted(self.waiting, key=self._key), "waiting is out of key order"
        assert len(self.running) <= self.config.max_num_seqs, len(self.running)
        ids = [r.req_id for r in self.running] + [r.req_id for r in self.waiting]
        assert sorted(ids) == sorted(self.requests), "running + waiting != unfinished requests"
        for req in self.running:
            assert req.status == RequestStatus.RUNNING and kv.holds(req), req.req_id
            num_known = req.num_tokens + self._spec_in_flight.get(req.req_id, 0)  # proposals fed count
            # 0: admitted by a step that was undone, its first chunk not yet run
            assert 0 <= req.num_computed_tokens <= num_known, (req.req_id, req.num_computed_tokens)
        for req in self.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), (req.req_id, req.status)
            assert not kv.holds(req) and req.num_computed_tokens == 0, req.req_id


def _wants_prompt_logprobs(req: Request, start: int) -> bool:
    """The chunk holds prompt positions whose logprobs do not exist yet (after the first output they all
    do: a recomputation after preemption does not compute them again)."""
    params = req.sampling_params
    return (
        params.prompt_logprobs is not None and not req.output_token_ids and start < req.num_prompt_tokens - 1
    )


def _needs_history(req: Request, start: int, sample: bool) -> bool:
    """The sampler reads it (penalties, a grammar, bad words), or the runner does: the prompt tokens past
    a chunk that it computes prompt logprobs for."""
    return (sample and req.sampling_params.needs_history) or _wants_prompt_logprobs(req, start)
