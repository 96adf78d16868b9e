"""vLLM's prompt_logprobs: each prompt token's log-probability given the tokens before it, its rank and the
top-N, equal to transformers' forward over the prompt, whatever the engine does to the prompt (chunks,
recomputation after preemption, no KV cache, a prefix another request cached)."""

from __future__ import annotations

import pytest
import torch

from infer.engine.llm import LLM
from infer.sampling_params import SamplingParams
from tests.engine.test_engine import CONFIGS
from tests.models.tiny_models import save_tiny_model

TOP_N = 3


@pytest.fixture(scope="module")
def tiny_reference(tiny, tmp_path_factory):
    """Per prompt: [None] + (token, logprob, rank, top-N ids) of every later token, from transformers."""
    path, prompts, _ = tiny
    hf, _ = save_tiny_model("llama", tmp_path_factory.mktemp("prompt_logprobs"))  # the same weights
    expected = []
    for p in prompts:
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1)
        rows = [None]
        for pos in range(1, len(p)):
            row = logprobs[pos - 1]
            rows.append(
                (
                    p[pos],
                    float(row[p[pos]]),
                    int((row > row[p[pos]]).sum()) + 1,
                    row.topk(TOP_N).indices.tolist(),
                )
            )
        expected.append(rows)
    return expected


def check(got, expected, top_n: int = TOP_N) -> None:
    assert len(got) == len(expected) and got[0] is None
    for entry, want in zip(got[1:], expected[1:], strict=True):
        token_id, logprob, rank, top = entry
        assert (token_id, rank, [t for t, _ in top]) == (want[0], want[2], want[3][:top_n])
        assert logprob == pytest.approx(want[1], abs=1e-4)
        assert all(value >= logprob for _, value in top[: rank - 1])


@pytest.mark.parametrize(
    "name", ["default", "odd_chunks", "preemption_uncached", "no_kv_cache", "preemption"]
)
def test_prompt_logprobs_match_transformers(tiny, tiny_reference, name):
    path, prompts, plain = tiny
    llm = LLM(path, dtype="float32", **{"num_kv_blocks": 256, **CONFIGS[name]})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=TOP_N)
    results = llm.generate(prompts, params)
    for result, expected in zip(results, tiny_reference, strict=True):
        check(result.prompt_logprobs, expected)
    assert [r.token_ids for r in results] == plain  # the outputs stay the same
    if name.startswith("preemption"):
        assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.scheduler.check_integrity()
    assert not llm.engine.prompt_logprobs


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(tiny, tiny_reference):
    """The first three prompts share 21 tokens: with prefix caching the later ones would skip them."""
    path, prompts, _ = tiny
    llm = LLM(path, dtype="float32", num_kv_blocks=256, block_size=4)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # caches the shared prefix
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    results = llm.generate(prompts[1:3], params)
    for result, expected in zip(results, tiny_reference[1:3], strict=True):
        assert result.request.num_cached_tokens == 0
        check(result.prompt_logprobs, expected, top_n=0)
    later = llm.generate(prompts[1:2], SamplingParams(max_tokens=2))[0]  # without them: the cache serves
    assert later.request.num_cached_tokens > 0


def test_one_token_prompts_and_requests_without_them():
    llm = LLM(dtype="float32")
    with_, without = llm.generate(
        [[0], [0]], [SamplingParams(max_tokens=2, prompt_logprobs=1), SamplingParams(max_tokens=2)]
    )
    assert with_.prompt_logprobs == [None] and without.prompt_logprobs is None


def test_nothing_is_kept_for_a_refused_request_nor_computed_twice(tiny):
    """A request the scheduler refuses leaves no prompt-logprob or grammar state; after a request's first
    output its prompt logprobs exist, so a recomputation after preemption does not compute them again."""
    from infer.structured_outputs.constraint import StructuredOutputs

    path, prompts, plain = tiny
    llm = LLM(path, dtype="float32", **{"num_kv_blocks": 256, **CONFIGS["preemption_uncached"]})
    spec = StructuredOutputs(regex="[a-z]+")
    with pytest.raises(ValueError):
        llm.engine.add_request([5] * 5000, SamplingParams(prompt_logprobs=1, structured_outputs=spec))
    assert not llm.engine.prompt_logprobs and not llm.engine.grammars._reserved
    computed = []
    runner = llm.engine.runner
    original = runner._prompt_logprobs

    def spy(reqs, hidden, query_lens):
        found = original(reqs, hidden, query_lens)
        computed.extend((req_id, req_id in llm.engine.prompt_logprobs) for req_id in found)
        return found

    runner._prompt_logprobs = spy
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
    results = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0 and computed
    assert all(pending for _, pending in computed)  # never for a request that had its logprobs
    assert [r.token_ids for r in results] == plain


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_a_prompt_with_logprobs_is_prefilled_in_chunks_not_a_token_a_step(quantization, monkeypatch):
    """A prompt-logprob token costs its LM-head row on top of a plain token's work: a few plain tokens' cost,
    counted over every weight the model holds (prepacked and quantized ones are buffers, not parameters;
    counting parameters alone priced a token at ~1,600 plain ones, and the prompt took a step a token)."""
    llm = LLM(quantization=quantization)  # the embedded model
    engine = llm.engine
    cost = engine.scheduler.prompt_logprob_token_cost
    assert 1 < cost < 4
    steps = []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: steps.append(1) or step())
    prompt = " ".join(["And God said, Let there be light: and there was light."] * 30)
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    num_prompt = out.num_prompt_tokens
    assert num_prompt > 300
    budget = engine.scheduler_config.max_num_batched_tokens
    assert len(steps) <= 2 + num_prompt * cost / budget


def test_the_step_keeps_tensors_and_the_reader_builds_the_entries(tiny, tiny_reference):
    """A step holds the engine thread: it keeps each chunk's tensors, and the entries (tens of thousands
    of Python objects for a long prompt) are built only where they are read."""
    path, prompts, _ = tiny
    llm = LLM(path, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=16, prefill_chunk_size=16)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP_N)
    result = llm.generate(prompts[:1], params)[0]
    got = result.prompt_logprobs
    assert got._entries is None and len(got.chunks) > 1  # several chunks, none turned into entries yet
    assert all(isinstance(chunk.logprobs, torch.Tensor) for chunk in got.chunks)
    check(got, tiny_reference[0])
    assert got._entries is not None and got == list(got) and got[1:] == list(got)[1:]


@pytest.mark.parametrize("spread", [1.0, 50.0, 1000.0])
def test_logsumexp_rows_equals_torchs_on_logits_of_any_spread(spread):
    from infer.runner.model_runner import logsumexp_rows

    logits = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0)) * spread
    logits[0] = 0.0  # a flat row
    logits[1, 7] = 1e4  # one token far above the rest
    want = torch.logsumexp(logits, dim=-1, keepdim=True)
    assert torch.allclose(logsumexp_rows(logits), want, rtol=1e-6, atol=1e-5)
