"""A scripted fake runner and small builders for driving the scheduler without a model.

The fake runner keeps a fake KV cache: slot -> (token id) written at each position it feeds. Before a
step it checks that every position below start_pos of the request holds exactly the request's token at
that position, which catches a shared prefix block with the wrong content, a block reused while still
held, or a lost block table entry.
"""

from __future__ import annotations

from collections.abc import Callable

from infer.config import CacheConfig, SchedulerConfig
from infer.core.outputs import ModelRunnerOutput, RequestOutput, SchedulerOutput
from infer.core.request import Request
from infer.core.scheduler import Scheduler
from infer.sampling_params import SamplingParams

EOS = 2


def make_scheduler(
    num_blocks: int = 16,
    block_size: int = 4,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 16,
    prefill_chunk_size: int | None = None,
    enable_chunked_prefill: bool = True,
    policy: str = "fcfs",
    batching_mode: str = "continuous",
    max_model_len: int = 64,
    enable_prefix_caching: bool = True,
    kv_cache_backend: str = "paged",
) -> Scheduler:
    sched_cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        prefill_chunk_size=prefill_chunk_size,
        enable_chunked_prefill=enable_chunked_prefill,
        policy=policy,
        batching_mode=batching_mode,
        max_model_len=max_model_len,
    )
    cache_cfg = CacheConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        kv_cache_backend=kv_cache_backend,
    )
    clock = iter(range(1, 10**9))
    return Scheduler(sched_cfg, cache_cfg, clock=lambda: float(next(clock)))


_arrival = iter(range(10**9))


def make_request(
    req_id: str,
    prompt: list[int] | int,
    max_tokens: int = 4,
    priority: int = 0,
    arrival_time: float | None = None,
    **params,
) -> Request:
    """prompt: token ids, or a length (ids 10, 11, ...). Arrival times increase with each call."""
    if isinstance(prompt, int):
        prompt = list(range(10, 10 + prompt))
    return Request(
        req_id=req_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        priority=priority,
        arrival_time=float(next(_arrival)) if arrival_time is None else arrival_time,
        eos_token_ids={EOS},
    )


def default_token(req_id: str, output_index: int) -> int:
    """Deterministic per (request, output index), never EOS: outputs do not depend on scheduling."""
    return 100 + 7 * output_index + sum(map(ord, req_id)) % 50


class FakeRunner:
    def __init__(self, scheduler: Scheduler, next_token: Callable[[str, int], int] = default_token) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.cache_config.block_size
        self.next_token = next_token
        self.scripted: dict[str, list[int]] = {}  # req_id -> tokens to return, in order
        self.slots: dict[int, int] = {}  # fake KV cache: slot -> token id
        self.dropped: list[str] = []  # finished ids the scheduler told us about

    def _slot(self, block_ids: list[int], pos: int) -> int:
        assert pos // self.block_size < len(block_ids), (pos, block_ids)
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.dropped.extend(out.finished_req_ids)
        req_ids, tokens = [], []
        for s in out.scheduled:
            req = self.scheduler.requests[s.req_id]
            assert s.token_ids == req.token_ids[s.start_pos : s.start_pos + len(s.token_ids)]
            assert s.num_prompt_tokens == req.num_prompt_tokens and s.sampling_params is req.sampling_params
            for pos in range(s.start_pos):  # the KV the scheduler claims is there must be there
                got = self.slots.get(self._slot(s.block_ids, pos))
                assert got == req.token_ids[pos], f"{s.req_id} pos {pos}: cache holds {got}"
            for i, token in enumerate(s.token_ids):
                self.slots[self._slot(s.block_ids, s.start_pos + i)] = token
            if s.sample:
                script = self.scripted.get(s.req_id)
                token = script.pop(0) if script else self.next_token(s.req_id, req.num_output_tokens)
                req_ids.append(s.req_id)
                tokens.append(token)
        return ModelRunnerOutput(req_ids, tokens)


def step(
    scheduler: Scheduler, runner: FakeRunner, check: bool = True
) -> tuple[SchedulerOutput, list[RequestOutput]]:
    out = scheduler.schedule()
    if check:
        scheduler.check_integrity()
    outputs = scheduler.update(out, runner.execute(out))
    if check:
        scheduler.check_integrity()
    return out, outputs


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> list:
    """Step until nothing is left; returns the SchedulerOutputs."""
    trace = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return trace
        trace.append(step(scheduler, runner)[0])
    raise AssertionError(f"not finished after {max_steps} steps")


def plan(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(req_id, start_pos, num_tokens, sample) for each scheduled request, in order."""
    return [(s.req_id, s.start_pos, len(s.token_ids), s.sample) for s in out.scheduled]
