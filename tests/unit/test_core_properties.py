"""Property-based tests of the pure-Python core (hypothesis): random interleavings of add / schedule /
update / abort over random pool sizes, block sizes, budgets, policies and batching modes.

At every step the scheduler's and the cache's integrity hold (free + used + cached == total, ref counts
equal the block tables holding them, queues sorted and disjoint), and the fake runner finds in every slot
the token the scheduler says is there: a block handed to two owners (other than a shared prefix block,
which holds the same tokens for both) would break that. At the end every request finished or was
refused when added, and every block is back in the pool.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.core.request import RequestStatus
from infer.core.slo import Objectives
from tests.unit.core_fakes import EOS, FakeRunner, make_request, make_scheduler


@st.composite
def configs(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max_num_seqs, 40))
    chunked = draw(st.booleans())
    max_model_len = draw(st.integers(4, 48))
    backend = draw(st.sampled_from(["paged", "paged", "contiguous"]))
    min_blocks = -(-max_model_len // block_size) if backend == "contiguous" else 1  # one slot at least
    return dict(
        block_size=block_size,
        num_blocks=draw(st.integers(min_blocks, max(40, min_blocks))),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        prefill_chunk_size=draw(st.integers(1, budget)) if chunked else None,
        policy=draw(st.sampled_from(["fcfs", "priority", "slo"])),
        batching_mode=draw(st.sampled_from(["continuous", "static"])),
        enable_prefix_caching=draw(st.booleans()),
        kv_cache_backend=backend,
        max_model_len=max_model_len,
    )


# one action per step: (kind, request index or choice, a random number for its details)
actions = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "step", "step", "step", "abort", "abort_mid"]), st.integers(0, 10**6)
    ),
    min_size=1,
    max_size=80,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), script=actions, prefix=st.lists(st.integers(3, 50), min_size=0, max_size=9))
def test_random_interleavings_keep_the_core_consistent(config, script, prefix):
    s = make_scheduler(**config)
    runner = FakeRunner(s, lambda req_id, i: EOS if (hash(req_id) + i) % 11 == 0 else 100 + i)
    added, refused, ids = [], 0, iter(range(10**6))

    def step(abort_mid: int | None = None) -> None:
        out = s.schedule()
        s.check_integrity()
        runner_out = runner.execute(out)
        if abort_mid is not None and out.scheduled:  # a client leaves while the step runs
            s.finish_requests(
                out.scheduled[abort_mid % len(out.scheduled)].req_id, RequestStatus.FINISHED_ABORTED
            )
        s.update(out, runner_out)
        s.check_integrity()

    for kind, n in script:
        if kind == "add":
            prompt = prefix[: n % (len(prefix) + 1)] + [3 + (n >> k) % 40 for k in range(1 + n % 7)]
            req = make_request(f"r{next(ids)}", prompt, max_tokens=1 + n % 9, priority=n % 3)
            if n % 4:  # objectives (used under "slo"; the clock ticks 1 a call): some tight, some loose
                req.slo = Objectives(ttft_s=1 + n % 50, tpot_s=0.5 + n % 7)
            try:
                s.add_request(req)
            except ValueError:  # can never fit this configuration: refused, nothing queued
                refused += 1
                assert req.req_id not in s.requests
                continue
            added.append(req)
        elif kind == "abort" and s.requests:
            victim = sorted(s.requests)[n % len(s.requests)]
            s.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        elif kind.startswith("step") or kind == "abort_mid":
            step(n if kind == "abort_mid" else None)
        s.check_integrity()

    for _ in range(2000):  # drain: every admitted request must finish
        if not s.has_unfinished():
            break
        step()
    else:
        raise AssertionError("requests left unfinished: a stuck queue")
    assert all(req.is_finished() and req.finish_reason in ("stop", "length", "abort") for req in added)
    kv = s.kv_cache_manager
    assert kv.num_used_blocks == 0 and s.num_running == s.num_waiting == 0
    kv.check_integrity()
