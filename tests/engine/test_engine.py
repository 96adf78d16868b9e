"""Engine invariance: a request's greedy output is transformers' greedy output, whatever the engine
configuration and whatever else runs beside it."""

from __future__ import annotations

import pytest
import torch

from infer.engine.llm import LLM
from infer.sampling_params import SamplingParams
from tests.models.tiny_models import save_byte_tokenizer, save_tiny_model

MAX_TOKENS = 12


def make_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(2, 256, (21,), generator=gen).tolist()
    prompts = [shared + torch.randint(2, 256, (n,), generator=gen).tolist() for n in (3, 9, 1)]
    prompts += [torch.randint(2, 256, (n,), generator=gen).tolist() for n in (1, 6, 30, 17, 44)]
    return prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf_model, path = save_tiny_model("llama", tmp_path_factory.mktemp("engine"))
    save_byte_tokenizer(path)
    prompts = make_prompts()
    expected = []
    for p in prompts:
        out = hf_model.generate(
            torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        expected.append(out[0, len(p) :].tolist())
    return str(path), prompts, expected


CONFIGS = {
    "default": {},
    "odd_chunks": dict(max_num_batched_tokens=16, prefill_chunk_size=7, max_num_seqs=4),
    "no_chunking": dict(enable_chunked_prefill=False, max_num_batched_tokens=128),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "contiguous": dict(kv_cache_backend="contiguous", max_model_len=64, num_kv_blocks=64),
    "static": dict(batching_mode="static", max_num_seqs=3),
    "one_at_a_time": dict(max_num_seqs=1),
    "preemption": dict(
        block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, prefill_chunk_size=8, max_num_seqs=8
    ),
    "priority": dict(
        policy="priority", block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=8
    ),
    "no_kv_cache": dict(use_kv_cache=False),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_output_is_invariant(tiny, name):
    path, prompts, expected = tiny
    args = {"num_kv_blocks": 256, **CONFIGS[name]}
    llm = LLM(path, dtype="float32", **args)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    priorities = [i % 3 for i in range(len(prompts))] if name == "priority" else None
    results = llm.generate(prompts, params, priorities)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    scheduler = llm.engine.scheduler
    scheduler.check_integrity()
    assert scheduler.kv_cache_manager.num_used_blocks == 0
    if name in ("preemption", "priority"):
        assert scheduler.num_preemptions > 0


@pytest.mark.parametrize("enable", [True, False])
def test_prefix_cache_serves_a_later_request(tiny, enable):
    path, prompts, expected = tiny
    llm = LLM(path, dtype="float32", num_kv_blocks=64, enable_prefix_caching=enable)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate(prompts[0], params)[0]
    later = llm.generate(prompts[1:3], params)
    assert first.num_cached_tokens == 0
    # 21 shared tokens = one full 16-token block; the output must not change
    assert [r.num_cached_tokens for r in later] == ([16, 16] if enable else [0, 0])
    assert [r.token_ids for r in later] == expected[1:3]
    stats = llm.engine.scheduler.kv_cache_manager
    assert stats.num_hit_tokens == (32 if enable else 0)
