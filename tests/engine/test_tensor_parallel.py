"""Tensor parallelism (infer.runner.parallel, infer.layers.parallel): two ranks in two processes over
gloo give the same greedy tokens as one, for every architecture, through chunked prefill, prefix caching
and preemption; and the pieces that decide who holds what, without processes."""

from __future__ import annotations

import os

import pytest
import torch

from infer.engine.llm import LLM
from infer.layers.parallel import VOCAB, TensorParallel, shard_range
from infer.models.loader import load_model
from infer.sampling_params import SamplingParams
from tests.models.tiny_models import VARIANTS, save_byte_tokenizer, save_tiny_model

MAX_TOKENS = 10
# chunks of 8 in a 32-token budget, a pool of 24 blocks of 4 tokens: requests are preempted
PRESSURE = dict(
    block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, prefill_chunk_size=8, max_num_seqs=8
)
# one KV head for 2 ranks (replicated on both) and a vocabulary that does not split evenly (padded)
EXTRA = {"mqa_odd_vocab": ("LlamaConfig", dict(num_key_value_heads=1, vocab_size=251))}


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(2, 250, (17,), generator=gen).tolist()
    out = [shared + torch.randint(2, 250, (n,), generator=gen).tolist() for n in (5, 11)]
    return out + [torch.randint(2, 250, (n,), generator=gen).tolist() for n in (1, 9, 26, 40)]


def generate(path, tp: int) -> tuple[list[list[int]], dict]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(path), dtype="float32", tensor_parallel_size=tp, **PRESSURE) as llm:
        first = llm.generate(prompts()[0], params)  # caches the shared prefix for the others
        results = first + llm.generate(prompts()[1:], params)
        scheduler = llm.engine.scheduler
        scheduler.check_integrity()
        counts = {
            "preemptions": scheduler.num_preemptions,
            "hit_tokens": scheduler.kv_cache_manager.num_hit_tokens,
            "used_blocks": scheduler.kv_cache_manager.num_used_blocks,
        }
    return [r.token_ids for r in results], counts


@pytest.mark.slow  # two ranks in two processes, for each model family
@pytest.mark.parametrize("name", sorted(VARIANTS) + sorted(EXTRA))
def test_two_ranks_generate_what_one_does(tmp_path, monkeypatch, name):
    if name in EXTRA:
        monkeypatch.setitem(VARIANTS, name, EXTRA[name])
    _, path = save_tiny_model(name, tmp_path)
    save_byte_tokenizer(path)
    one, _ = generate(path, 1)
    two, counts = generate(path, 2)
    assert two == one
    assert all(len(t) == MAX_TOKENS for t in two)
    assert counts["preemptions"] > 0 and counts["hit_tokens"] > 0 and counts["used_blocks"] == 0


def test_shards_of_heads_vocabulary_and_dimensions():
    ranks = [TensorParallel(r, 4) for r in range(4)]
    assert [tp.kv_heads(8) for tp in ranks] == [2] * 4
    assert [tp.kv_heads(2) for tp in ranks] == [1] * 4  # replicated: 2 ranks per KV head
    # rank r holds KV head r // 2 (each of 64 dims) when 4 ranks share 2 heads
    assert [shard_range("column", 128, 64, tp) for tp in ranks] == [(0, 64), (0, 64), (64, 64), (64, 64)]
    assert [shard_range("row", 512, 128, tp) for tp in ranks] == [(r * 128, 128) for r in range(4)]
    assert ranks[0].vocab_rows(10) == 3
    assert [shard_range(VOCAB, 10, 3, tp) for tp in ranks] == [(0, 3), (3, 3), (6, 3), (9, 1)]
    with pytest.raises(ValueError, match="must divide evenly"):
        ranks[0].split(6, "the number of attention heads")
    with pytest.raises(ValueError, match="key/value heads"):
        TensorParallel(0, 4).kv_heads(3)


def test_a_size_beyond_the_cores_or_the_heads_is_refused(tmp_path):
    _, path = save_tiny_model("llama", tmp_path)  # 4 attention heads, 2 KV heads
    save_byte_tokenizer(path)
    with pytest.raises(ValueError, match="needs a CPU core per rank"):
        LLM(str(path), tensor_parallel_size=len(os.sched_getaffinity(0)) + 1)
    with pytest.raises(ValueError, match="attention heads \\(4\\) must divide evenly"):
        load_model(str(path), tp=TensorParallel(0, 3))  # rank 0's shard, built before any collective


def test_a_rank_reads_only_its_slice(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from infer.models.loader import LazyTensor

    stored = torch.arange(24.0).view(4, 6)  # as GPT-2's Conv1D: [in, out]
    save_file({"w": stored}, tmp_path / "w.safetensors")
    with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
        lazy = LazyTensor(f.get_slice("w")).t()  # [out, in], nothing read
        assert lazy.shape == (6, 4)
        part = lazy.narrow(0, 2, 3).narrow(1, 1, 2)
        assert part.shape == (3, 2)
        assert torch.equal(part.load(), stored.t()[2:5, 1:3])
