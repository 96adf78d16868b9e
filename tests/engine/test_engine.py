"""Engine invariance: a request's greedy output is transformers' greedy output, whatever the engine
configuration and whatever else runs beside it."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from infer.core.slo import Objectives
from infer.engine.llm import LLM
from infer.sampling_params import SamplingParams
from tests.grids import first_fast
from tests.models.tiny_models import save_tiny_model

MAX_TOKENS = 12


def make_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(2, 256, (21,), generator=gen).tolist()
    prompts = [shared + torch.randint(2, 256, (n,), generator=gen).tolist() for n in (3, 9, 1)]
    prompts += [torch.randint(2, 256, (n,), generator=gen).tolist() for n in (1, 6, 30, 17, 44)]
    return prompts


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
    "preemption_uncached": dict(
        block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=8, enable_prefix_caching=False
    ),
    "priority": dict(
        policy="priority", block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=8
    ),
    "no_kv_cache": dict(use_kv_cache=False),
    "slo": dict(policy="slo", block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=8),
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
        assert scheduler.num_preemptions == sum(r.request.num_preemptions for r in results) > 0
    if name == "preemption_uncached":  # recompute with nothing to reuse: prompts and outputs run again
        assert scheduler.num_preemptions > 0
        assert sum(r.request.num_prefill_tokens_computed for r in results) > sum(map(len, prompts))


class OpenAIPenalties(LogitsProcessor):
    """Presence and frequency penalties for transformers' generate (which has neither), written from
    OpenAI's formula: a token's logit minus frequency x its count in the output, minus presence if > 0."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        output = input_ids[0, self.prompt_len :].tolist()
        for token in set(output):
            scores[0, token] -= self.frequency * output.count(token) + self.presence
        return scores


BIAS = {17: 2.0, 200: -1.5, 97: 1.0}
PENALTIES = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.5)


@pytest.fixture(scope="module")
def penalized(tiny, tmp_path_factory):
    """transformers' greedy outputs with BIAS (its sequence_bias), the repetition penalty (its own) and
    OpenAIPenalties, applied in vLLM's order: bias, repetition, then frequency and presence."""
    path, prompts, plain = tiny
    hf_model, _ = save_tiny_model("llama", tmp_path_factory.mktemp("penalized"))
    expected = []
    for p in prompts:
        out = hf_model.generate(
            torch.tensor([p]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            sequence_bias={(t,): b for t, b in BIAS.items()},
            repetition_penalty=PENALTIES["repetition_penalty"],
            logits_processor=LogitsProcessorList(
                [OpenAIPenalties(len(p), PENALTIES["presence_penalty"], PENALTIES["frequency_penalty"])]
            ),
        )
        expected.append(out[0, len(p) :].tolist())
    assert sum(a != b for a, b in zip(expected, plain, strict=True)) >= len(plain) // 2  # they do change it
    return path, prompts, expected, plain


@pytest.mark.parametrize("name", first_fast(["default", "odd_chunks", "preemption_uncached", "no_kv_cache"]))
def test_logit_bias_and_penalties_match_transformers(penalized, name):
    """Every token a penalty looks at reaches the sampler: whole and chunked prompts, recomputation after
    preemption, no KV cache; penalized requests beside plain ones that stay plain."""
    path, prompts, expected, unpenalized = penalized
    llm = LLM(path, dtype="float32", **{"num_kv_blocks": 256, **CONFIGS[name]})
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=BIAS, **PENALTIES
    )
    plain = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results = llm.generate(prompts + prompts[:3], [params] * len(prompts) + [plain] * 3)
    assert [r.token_ids for r in results[: len(prompts)]] == expected
    assert [r.token_ids for r in results[len(prompts) :]] == unpenalized[:3]
    if name == "preemption_uncached":  # the histories came back through recomputation
        assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.scheduler.check_integrity()
    assert llm.engine.scheduler.kv_cache_manager.num_used_blocks == 0


def test_bans_that_leave_nothing_end_that_request_alone(tiny):
    """allowed_token_ids whose one token is a bad word is refused when added; where only the output can
    show it (the word is that token twice), that request ends with "error" and a reason at its second
    token, and the request beside it completes as if alone."""
    path, prompts, plain = tiny
    llm = LLM(path, dtype="float32", num_kv_blocks=256)
    token = next(t for out in plain for t in out if llm.engine.tokenizer.decode([t]).isalpha())
    word = llm.engine.tokenizer.decode([token])
    with pytest.raises(ValueError, match="bad_words ban"):
        llm.engine.add_request(prompts[0], SamplingParams(allowed_token_ids=[token], bad_words=[word]))
    stuck = SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=[token], bad_words=[word * 2])
    fine = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results = llm.generate(prompts[:2], [stuck, fine])
    assert results[0].finish_reason == "error" and "leave no token" in results[0].error
    assert results[0].token_ids == [token]
    assert results[1].token_ids == plain[1]


@pytest.mark.slow
def test_fp8_cache_output_is_invariant(tiny, caplog):
    """An fp8 KV cache on a float32 model of head_dim 16 (the Python path, with a warning that says so):
    chunked or whole prompts, prefix hits, preemption and recompute all attend over the same rounded keys
    and values (a fresh prompt's own keys rounded as the cache holds them), so the greedy output is the
    same in every configuration; every request completes and every block comes back."""
    path, prompts, _ = tiny
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = {}
    for name in ("default", "odd_chunks", "no_chunking", "no_prefix_caching", "preemption"):
        with caplog.at_level("WARNING", logger="infer.runner"):
            llm = LLM(path, dtype="float32", kv_cache_dtype="fp8", **{"num_kv_blocks": 256, **CONFIGS[name]})
        assert llm.engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
        results = llm.generate(prompts, params)
        assert all(r.finish_reason == "length" for r in results)
        assert llm.engine.scheduler.kv_cache_manager.num_used_blocks == 0
        outputs[name] = [r.token_ids for r in results]
    assert all(out == outputs["default"] for out in outputs.values())
    assert sum("slower Python path" in r.getMessage() for r in caplog.records) == len(outputs)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_engine_output_is_invariant_over_a_16_bit_cache(tiny, half):
    """A float32 model over a 16-bit cache: chunked or whole prompts, prefix hits and preemption attend over
    the same rounded keys and values (a fresh prompt's own keys rounded as the cache holds them), so the
    greedy output is the same in every configuration; every request completes, every block comes back,
    and the cache holds twice the tokens of a float32 one in the same memory."""
    path, prompts, _ = tiny
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = {}
    for name in ("default", "odd_chunks", "no_chunking", "no_prefix_caching", "preemption"):
        llm = LLM(path, dtype="float32", kv_cache_dtype=str(half).removeprefix("torch."), **CONFIGS[name])
        assert llm.engine.runner.kv_caches[0][0].dtype == half
        results = llm.generate(prompts, params)
        assert all(r.finish_reason == "length" for r in results)
        assert llm.engine.scheduler.kv_cache_manager.num_used_blocks == 0
        outputs[name] = [r.token_ids for r in results]
    assert all(out == outputs["default"] for out in outputs.values())
    wide = LLM(path, dtype="float32")
    assert llm.engine.kv_bytes_per_token * 2 == wide.engine.kv_bytes_per_token


def test_a_bfloat16_model_over_a_float16_cache_completes(tiny):
    """A cache of another 16-bit dtype than a bf16 model's: written converted, read through the matmuls
    (the decode kernel takes queries of its cache's dtype), every request whole."""
    path, prompts, _ = tiny
    llm = LLM(path, dtype="bfloat16", kv_cache_dtype="float16")
    results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert all(r.finish_reason == "length" and len(r.token_ids) == MAX_TOKENS for r in results)
    assert llm.engine.scheduler.kv_cache_manager.num_used_blocks == 0


@pytest.mark.parametrize("enable", [True, False])
def test_prefix_cache_serves_a_later_request(tiny, enable):
    path, prompts, expected = tiny
    llm = LLM(path, dtype="float32", num_kv_blocks=64, enable_prefix_caching=enable)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate(prompts[0], params)[0]
    later = llm.generate(prompts[1:3], params)
    assert first.num_cached_tokens == 0
    assert first.request.num_prefill_tokens_computed == len(prompts[0])
    # 21 shared tokens = one full 16-token block; the output must not change
    assert [r.num_cached_tokens for r in later] == ([16, 16] if enable else [0, 0])
    assert [r.token_ids for r in later] == expected[1:3]
    hits = 16 if enable else 0
    assert [r.request.num_prefill_tokens_computed for r in later] == [len(p) - hits for p in prompts[1:3]]
    assert all(
        r.request.first_token_time >= r.request.first_scheduled_time >= r.request.arrival_time for r in later
    )
    assert all(len(r.request.token_times) == MAX_TOKENS for r in later)
    stats = llm.engine.scheduler.kv_cache_manager
    assert stats.num_hit_tokens == (32 if enable else 0)


def test_stop_token_ids_and_min_tokens(tiny):
    path, prompts, expected = tiny
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    stop_at = expected[4][5]
    first = expected[4].index(stop_at)
    (r,) = llm.generate(
        prompts[4], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_at])
    )
    assert r.finish_reason == "stop" and r.token_ids == expected[4][: first + 1]
    decode = llm.engine.tokenizer.decode
    assert r.text == decode(expected[4][:first])  # the stop token ends the text, not in it (as vLLM)
    (kept,) = llm.generate(
        prompts[4],
        SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_at], include_stop_str_in_output=True
        ),
    )
    assert kept.text == decode(expected[4][: first + 1])
    # min_tokens bans the stop token until that many tokens exist: the output must avoid it early on
    banned = expected[4][0]
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=4, stop_token_ids=[banned])
    (r,) = llm.generate(prompts[4], params)
    assert len(r.token_ids) == 4 and banned not in r.token_ids


def test_seeded_sampling_does_not_depend_on_the_batch(tiny):
    path, prompts, _ = tiny
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=MAX_TOKENS, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = LLM(path, dtype="float32", num_kv_blocks=64, seed=1).generate(prompts[5], seeded)[0]
    crowd = LLM(path, dtype="float32", num_kv_blocks=64, seed=2).generate(
        prompts[3:8], [other, other, seeded, other, other]
    )
    assert crowd[2].token_ids == alone.token_ids
    reseeded = SamplingParams(temperature=1.0, seed=43, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert (
        LLM(path, dtype="float32", num_kv_blocks=64).generate(prompts[5], reseeded)[0].token_ids
        != alone.token_ids
    )


def test_abort_in_every_state_frees_blocks(tiny):
    path, prompts, _ = tiny
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=16)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts[4:8]]  # 2 run, 2 wait
    engine.step()
    engine.step()
    assert engine.scheduler.num_running == 2 and engine.scheduler.num_waiting == 2
    ended = engine.abort([reqs[0].req_id, reqs[3].req_id, "no-such-id"])
    assert sorted(o.req_id for o in ended) == sorted([reqs[0].req_id, reqs[3].req_id])
    assert all(o.finished and o.finish_reason == "abort" for o in ended)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    finished = {o.req_id: o.finish_reason for o in outputs if o.finished}
    assert finished == {reqs[1].req_id: "length", reqs[2].req_id: "length"}
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv_cache_manager.num_used_blocks == 0
    assert engine.requests == {} and engine.detokenizers == {}


def test_bad_requests_are_refused_and_nothing_leaks(tiny):
    path, prompts, _ = tiny
    llm = LLM(path, dtype="float32", num_kv_blocks=8, block_size=4)
    engine = llm.engine
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.add_request([1, 2, 999])
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"^logit_bias token ids must be in \[0, {vocab}\)"):
        engine.add_request([1, 2], SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match=rf"^stop_token_ids token ids must be in \[0, {vocab}\)"):
        engine.add_request([1, 2], SamplingParams(stop_token_ids=[vocab + 5]))
    with pytest.raises(ValueError, match="^allowed_token_ids holds only tokens that bad_words ban, or stop"):
        engine.add_request([1, 2], SamplingParams(allowed_token_ids=[7], stop_token_ids=[7], min_tokens=2))
    with pytest.raises(ValueError):  # 30 + 16 tokens can never fit a 32-token pool
        engine.add_request(prompts[5], SamplingParams(max_tokens=16))
    assert not engine.has_unfinished() and engine.requests == {}


def test_stop_strings_cut_the_text_on_the_embedded_model():
    llm = LLM(num_kv_blocks=64)
    prompt = "And the LORD spake unto Moses, saying,"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    stop = full.text[10:16]  # a stop string from the middle of the greedy text, likely split across tokens
    cut = full.text.index(stop)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=["@@never@@", stop])
    (r,) = llm.generate(prompt, params)
    assert r.finish_reason == "stop" and r.text == full.text[:cut]
    assert stop not in r.text and len(r.token_ids) < len(full.token_ids)
    assert r.request.stop_reason == stop


def test_slo_classes_give_requests_objectives_and_steps_feed_the_cost_model(tiny, tmp_path):
    path, _, _ = tiny
    (tmp_path / "slo.yaml").write_text(
        "classes:\n  - {name: short, prompt_tokens: [0, 16], ttft_ms: 500, tpot_ms: 100}\n"
    )
    llm = LLM(path, dtype="float32", policy="slo", slo_config=str(tmp_path / "slo.yaml"), num_kv_blocks=256)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    short = engine.add_request(list(range(5, 15)), params)
    long = engine.add_request(list(range(5, 45)), params)
    own = engine.add_request(list(range(5, 15)), params, slo=Objectives(ttft_s=9.0))
    assert short.slo == Objectives(ttft_s=0.5, tpot_s=0.1) and long.slo is None and own.slo.ttft_s == 9.0
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.cost_model.num_steps > 0
    assert all(r.finish_reason == "length" for r in (short, long, own))


def test_default_token_budget_is_vllms_on_every_cpu(monkeypatch):
    """No budget given: 2048 tokens a step, with AMX or without (docs/optimizations.md, "The step
    budget"); a given budget is kept, also through dataclasses.replace."""
    import dataclasses

    from infer import kernels
    from infer.config import EngineConfig

    for amx in (True, False):
        monkeypatch.setattr(kernels, "cpu_has_amx", lambda amx=amx: amx)
        assert EngineConfig().max_num_batched_tokens == 2048
    given = EngineConfig(max_num_batched_tokens=96)
    assert given.max_num_batched_tokens == 96
    assert dataclasses.replace(given, max_num_seqs=8).max_num_batched_tokens == 96


def test_default_max_num_seqs_is_vllms_within_the_budget():
    """No max_num_seqs given: 128, as vLLM's CPU server, or the token budget where that is smaller (so a
    small --max-num-batched-tokens alone is no error); a given one is kept and checked."""
    from infer.config import DEFAULT_MAX_NUM_SEQS, EngineConfig

    assert DEFAULT_MAX_NUM_SEQS == 128
    assert EngineConfig(max_num_batched_tokens=2048).max_num_seqs == 128
    assert EngineConfig(max_num_batched_tokens=96).max_num_seqs == 96
    assert EngineConfig(max_num_batched_tokens=2048, max_num_seqs=8).max_num_seqs == 8
    with pytest.raises(ValueError, match="must be >= max_num_seqs"):
        LLM(max_num_batched_tokens=16, max_num_seqs=32)
