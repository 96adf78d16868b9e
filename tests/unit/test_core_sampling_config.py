import dataclasses

import pytest

from infer.config import CacheConfig, EngineConfig, SchedulerConfig
from infer.core.request import FINISH_REASONS, Request, RequestStatus
from infer.sampling_params import SamplingParams


def test_sampling_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed, p.max_tokens) == (1.0, 0, 1.0, 0.0, None, 16)
    assert (p.min_tokens, p.ignore_eos, p.stop, p.stop_token_ids, p.logprobs) == (0, False, [], [], None)
    assert not p.greedy and SamplingParams(temperature=0).greedy


def test_sampling_normalizes_stop():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(5,)).stop_token_ids == [5]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"min_p": -0.5}, "min_p"),
        ({"seed": "7"}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens \(5\) cannot exceed max_tokens \(4\)"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_sampling_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_accepts_edges():
    SamplingParams(temperature=0, top_k=-1, top_p=1.0, min_p=1.0, seed=0, max_tokens=1, logprobs=0)
    SamplingParams(top_k=1, min_tokens=3, max_tokens=3, stop_token_ids=[0])


def test_cache_config():
    c = CacheConfig(num_blocks=10)
    assert (c.block_size, c.enable_prefix_caching, c.kv_cache_backend, c.num_tokens) == (
        16,
        True,
        "paged",
        160,
    )
    assert c.prefix_caching
    assert not CacheConfig(num_blocks=10, kv_cache_backend="contiguous").prefix_caching
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_blocks = 3
    for kwargs, match in [
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": 4, "block_size": 0}, "block_size"),
        (
            {"num_blocks": 4, "kv_cache_backend": "ring"},
            "kv_cache_backend must be one of 'paged', 'contiguous'",
        ),
        ({"num_blocks": 4, "enable_prefix_caching": "yes"}, "enable_prefix_caching"),
    ]:
        with pytest.raises(ValueError, match=match):
            CacheConfig(**kwargs)


def test_engine_config_builds_the_cache_config():
    """The KV pool's settings are the engine's; only the block count is known later, at load."""
    engine = EngineConfig(block_size=32, enable_prefix_caching=False, kv_cache_backend="contiguous")
    c = engine.cache_config(7)
    fields = (c.num_blocks, c.block_size, c.enable_prefix_caching, c.kv_cache_backend)
    assert fields == (7, 32, False, "contiguous")
    assert EngineConfig().cache_config(5).prefix_caching
    with pytest.raises(ValueError, match="num_blocks"):
        engine.cache_config(0)


def test_scheduler_config():
    c = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    assert c.prefill_chunk_size == 64 and c.max_batch_size == 8
    assert (c.policy, c.batching_mode, c.enable_chunked_prefill) == ("fcfs", "continuous", True)
    for kwargs, match in [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        (
            {"max_num_seqs": 8, "max_num_batched_tokens": 4},
            r"max_num_batched_tokens \(4\) must be >= max_num_seqs",
        ),
        (
            {"max_num_seqs": 4, "max_num_batched_tokens": 16, "prefill_chunk_size": 17},
            r"prefill_chunk_size \(17\) cannot exceed",
        ),
        ({"prefill_chunk_size": 0}, "prefill_chunk_size"),
        ({"policy": "lifo"}, "policy"),
        ({"batching_mode": "dynamic"}, "batching_mode"),
        ({"max_model_len": -1}, "max_model_len"),
    ]:
        with pytest.raises(ValueError, match=match):
            SchedulerConfig(**kwargs)


def test_request_status_order_and_phases():
    s = RequestStatus
    assert s.WAITING < s.RUNNING < s.PREEMPTED < s.FINISHED_STOPPED < s.FINISHED_LENGTH
    assert s.FINISHED_LENGTH < s.FINISHED_ABORTED < s.FINISHED_ERROR
    assert [x.is_finished() for x in s] == [False, False, False, True, True, True, True]
    assert sorted(FINISH_REASONS.values()) == ["abort", "error", "length", "stop"]
    req = Request("r", [1, 2, 3, 4])
    assert req.num_tokens == 4 and req.is_prefill and req.finish_reason is None
    req.num_computed_tokens = 3
    assert not req.is_prefill  # decoding: only the last token is left to feed
    assert req.append_output_token(9, now=1.0) is None
    assert req.token_ids == [1, 2, 3, 4, 9] and req.num_tokens == 5 and req.num_output_tokens == 1
    assert req.prompt_token_ids == [1, 2, 3, 4]
    assert req.first_token_time == 1.0 and req.token_times == [1.0]
