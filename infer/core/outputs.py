"""The dataclasses that cross the core/runner and core/engine boundaries. Plain data, no behaviour.

Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute() -> ModelRunnerOutput
Scheduler.update(SchedulerOutput, ModelRunnerOutput) -> list[RequestOutput] -> engine / detokenizer
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infer.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of a step.

            start_pos                    start_pos + len(token_ids)
                |<------ token_ids ------>|
    [ KV already in the cache ][ fed this step ][ rest of the known sequence, later steps ]

    token_ids: the tokens to feed this step, at positions start_pos, start_pos + 1, ...
    start_pos: tokens of this request already in the KV cache (= its num_computed_tokens before the step).
    block_ids: the full block table; position p lives in slot block_ids[p // block_size] * block_size
        + p % block_size. It covers at least start_pos + len(token_ids) tokens. A copy the runner may keep.
    sample: True when this step reaches the end of the known sequence, so a token must be sampled from
        the logits of its last position; False for a prefill chunk that is not the last one.
    num_prompt_tokens: so the sampler knows how many tokens were generated before the one it samples,
        start_pos + len(token_ids) - num_prompt_tokens (min_tokens masks EOS and stop_token_ids until
        then; a seed combined with this index gives the same draws before and after a preemption).
    history: the request's whole sequence so far (prompt, then outputs), when this step samples for a
        request with penalties or a grammar (SamplingParams.needs_history); None otherwise. The request's
        own list, not a copy: read it within the step (the sampler takes in only what it gained since its
        last step).
    """

    req_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    sampling_params: SamplingParams
    num_prompt_tokens: int
    history: list[int] | None = None
    prompt_logprobs: bool = False  # the runner computes the logprobs of this chunk's prompt tokens
    # speculative decoding: the proposals at the end of token_ids (after the last sampled token), whose
    # positions the runner computes logits for and verifies (infer/runner/rejection_sampler.py)
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def sampled_rows(reqs: list[ScheduledRequest], ends: list[int]) -> list[int]:
    """Rows of a step's flat batch whose logits it samples from, request i's tokens ending before row
    ends[i]: a sampling request's last row, and with K proposals its last 1 + K."""
    return [
        r
        for s, end in zip(reqs, ends, strict=True)
        if s.sample
        for r in range(end - 1 - len(s.spec_token_ids), end)
    ]


@dataclass
class StepStats:
    """Per-step counters for traces, metrics and benchmarks. Block counts are taken after scheduling."""

    num_prefill_tokens: int = 0  # prompt chunks and recomputation after preemption
    num_decode_tokens: int = 0  # one per request that was decoding, and its proposals
    num_spec_tokens: int = 0  # proposals fed to be verified (speculative decoding)
    num_preemptions: int = 0
    num_evictions: int = 0  # cached blocks evicted to make room during this step's scheduling
    num_blocks_used: int = 0
    num_blocks_cached: int = 0  # unreferenced blocks holding a reusable prefix
    num_blocks_free: int = 0
    num_running: int = 0
    num_waiting: int = 0


@dataclass
class SchedulerOutput:
    """What to run this step. `scheduled` lists decodes first, then prefill chunks.

    finished_req_ids: requests finished (and freed) since the previous step, including aborts between
        steps, so the runner can drop per-request state (seeded generators, cached tensors).
    preempted_req_ids: requests preempted during this step's scheduling; they lost their blocks and will
        be recomputed from position 0 when scheduled again.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    stats: StepStats = field(default_factory=StepStats)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """One sampled token for each scheduled request with sample=True, in any order.

    accepted_token_ids: for a request that fed proposals (ScheduledRequest.spec_token_ids), the ones
        accepted: a prefix of them, emitted before its sampled token (which follows the last accepted one).

    logprobs: None, or a list aligned with req_ids of per-request data (the sampled token's logprob and
        its top-N alternatives), passed through to RequestOutput untouched.
    """

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[Any] | None = None
    # req_id -> the runner's logprobs of the prompt tokens this step computed (a PromptLogprobChunk)
    prompt_logprobs: dict[str, Any] | None = None
    accepted_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """The delta of one request after one step (or its end, for an abort)."""

    req_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" once finished
    stop_reason: int | str | None = None  # the stop token id that ended it, if any
    logprobs: Any = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at the first schedule
