"""A generation request: its tokens, its progress through the engine, its timestamps.

Phases are derived from counts, never stored (STYLE rule 3). For a request with token sequence
`token_ids = prompt + outputs`:

    token_ids:  [ p0 p1 p2 p3 p4 p5 | o0 o1 o2 ]            num_tokens = 9
                 <---- computed ---->                       num_computed_tokens = 6 (KV in the cache)
                                      <- new ->             still to feed: num_tokens - num_computed_tokens

* in prefill while `num_computed_tokens < num_tokens - 1` (more than one token to feed). This covers
  a fresh prompt, a chunk boundary, and a preempted request recomputing prompt + generated tokens;
* decoding when `num_computed_tokens == num_tokens - 1`: the last token (just sampled) is fed next.

A step that feeds tokens up to `num_tokens` samples one more token; a shorter prefill chunk samples none.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from infer.core.slo import Objectives
from infer.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: everything from FINISHED_STOPPED on is final, so `is_finished()` is one comparison."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue with no blocks; will recompute prompt + outputs
    FINISHED_STOPPED = 3  # EOS, a stop token id, or a stop string (the engine)
    FINISHED_LENGTH = 4  # max_tokens reached
    FINISHED_ABORTED = 5  # client went away / cancelled
    FINISHED_ERROR = 6  # the engine failed the request

    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

_arrival_counter = itertools.count()


@dataclass(eq=False)  # identity semantics: requests are hashable and compared by object
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower is served first under the "priority" policy
    slo: Objectives | None = None  # TTFT / TPOT objectives, used by the "slo" policy
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: frozenset[int] = frozenset()
    # The engine requests of one API request (its n choices, its prompts) share a group: the scheduler
    # admits a group's sequences in waves of a fair share of the batch (None: a request of its own).
    group_id: str | None = None

    # Progress, owned by the scheduler.
    token_ids: list[int] = field(init=False)  # prompt + outputs, appended in place
    output_token_ids: list[int] = field(init=False, default_factory=list)
    num_computed_tokens: int = field(init=False, default=0)  # tokens whose KV is in the cache
    num_cached_tokens: int = field(init=False, default=0)  # prefix-cache hit at the first schedule
    # tokens this request ran through the model as prefill: prompt minus cache hits, plus recomputation
    num_prefill_tokens_computed: int = field(init=False, default=0)
    status: RequestStatus = field(init=False, default=RequestStatus.WAITING)
    stop_reason: int | str | None = field(init=False, default=None)  # the stop token id or stop string
    num_preemptions: int = field(init=False, default=0)
    num_slow_gaps: int = field(init=False, default=0)  # "slo": its decode steps longer than its tpot
    # its steps stopped for a newcomer (Scheduler.undo), and the seconds they are counted for (llm_engine.py)
    num_interruptions: int = field(init=False, default=0)
    seconds_lost: float = field(init=False, default=0.0)
    # the prefill pacer's: seconds this stream may still be slowed by, and the tokens it was credited for
    pace_credit: float = field(init=False, default=0.0)
    pace_credited_tokens: int = field(init=False, default=0)
    block_hashes: list[bytes] = field(init=False, default_factory=list)  # of full blocks, filled lazily
    # speculative decoding: tokens proposed to follow token_ids, verified in the next step that feeds it
    # (set by the engine after each step, consumed by schedule())
    spec_token_ids: list[int] = field(init=False, default_factory=list)

    # Timestamps (the scheduler's clock, time.monotonic by default).
    first_scheduled_time: float | None = field(init=False, default=None)
    first_token_time: float | None = field(init=False, default=None)
    token_times: list[float] = field(init=False, default_factory=list)
    finished_time: float | None = field(init=False, default=None)

    # Tie-break among equal arrival times: order of construction.
    seq: int = field(init=False, default_factory=lambda: next(_arrival_counter))

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.token_ids = list(self.prompt_token_ids)
        self.eos_token_ids = frozenset(self.eos_token_ids)
        self._stop_token_ids = frozenset(self.sampling_params.stop_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1

    def decodes_from(self, start: int) -> bool:
        """Whether a step that feeds this request's tokens from position start is a decode: it feeds
        the last sampled token."""
        return bool(self.num_output_tokens) and start == self.num_tokens - 1

    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int, now: float) -> RequestStatus | None:
        """Append a sampled token; return the finished status it causes, or None to keep going.

        A stop token (EOS unless ignore_eos, or one of stop_token_ids) counts only once min_tokens
        outputs exist, and wins over max_tokens when both hold: the model did stop on its own.
        """
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now
        params = self.sampling_params
        is_eos = token_id in self.eos_token_ids and not params.ignore_eos
        is_stop = is_eos or token_id in self._stop_token_ids
        if is_stop and self.num_output_tokens >= params.min_tokens:
            self.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def drop_output_tail(self, num_tokens: int) -> None:
        """Forget the last num_tokens outputs of a request that ends before them (a stop string completed
        earlier among the tokens one speculative step emitted), so that its counts are those emitted."""
        if num_tokens > 0:
            del self.token_ids[-num_tokens:], self.output_token_ids[-num_tokens:]
            del self.token_times[-num_tokens:]
