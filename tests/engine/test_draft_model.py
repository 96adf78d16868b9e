"""Speculative decoding with a draft model: greedy outputs are the target's whatever the draft (another
random model, or the target itself, whose every proposal is kept), in every engine configuration
(chunked prefill, prefix hits, preemption); a draft of another vocabulary is refused; aborts mid-
speculation leave both KV pools idle and whole."""

from __future__ import annotations

import json

import pytest

from infer.config import SpeculativeConfig
from infer.engine.llm import LLM
from infer.runner.draft_proposer import DraftProposer
from infer.sampling_params import SamplingParams
from tests.engine.test_engine import CONFIGS, MAX_TOKENS
from tests.models.tiny_models import COMMON, save_byte_tokenizer, save_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def draft_config(path, k: int = 3) -> dict:
    # speculate in every step whatever the batch, so that the configurations with 8 requests do too
    return {
        "method": "draft_model",
        "model": str(path),
        "num_speculative_tokens": k,
        "disable_by_batch_size": 64,
        "disable_by_gain": False,
    }


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A random model of the tiny model's shape and vocabulary, other weights, no tokenizer of its own."""
    _, path = save_tiny_model("llama", tmp_path_factory.mktemp("draft"), seed=1)
    return path


def check_pools_idle(engine) -> None:
    scheduler, draft = engine.scheduler, engine.proposer
    scheduler.check_integrity()
    draft.check_integrity()
    assert scheduler.kv_cache_manager.num_used_blocks == 0
    assert draft.num_used_blocks == 0 and not draft.states


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_output_is_the_targets_with_another_model_as_draft(tiny, other_draft, name):
    path, prompts, expected = tiny
    args = {"num_kv_blocks": 256, **CONFIGS[name]}
    llm = LLM(path, dtype="float32", speculative_config=draft_config(other_draft), **args)
    assert isinstance(llm.engine.proposer, DraftProposer)
    priorities = [i % 3 for i in range(len(prompts))] if name == "priority" else None
    results = llm.generate(prompts, GREEDY, priorities)
    assert [r.token_ids for r in results] == expected
    scheduler = llm.engine.scheduler
    assert scheduler.num_spec_draft_tokens > 0
    assert scheduler.num_spec_accepted_tokens < scheduler.num_spec_draft_tokens  # another model: misses
    check_pools_idle(llm.engine)


@pytest.mark.parametrize("name", ["default", "odd_chunks", "preemption"])
def test_the_target_as_its_own_draft_has_every_proposal_accepted(tiny, name):
    """Chunked prefill (the draft prefills chunk by chunk beside the target), prefix hits (the draft
    computes what the target's cache held) and preemption (the draft forgets and recomputes)."""
    path, prompts, expected = tiny
    args = {"num_kv_blocks": 256, **CONFIGS[name]}
    llm = LLM(path, dtype="float32", speculative_config=draft_config(path), **args)
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    scheduler = llm.engine.scheduler
    assert scheduler.num_spec_draft_tokens > len(prompts) * 3
    assert scheduler.num_spec_accepted_tokens == scheduler.num_spec_draft_tokens  # 100% acceptance
    check_pools_idle(llm.engine)


@pytest.mark.parametrize("k", [1, 2])
def test_the_draft_proposes_at_most_num_speculative_tokens(tiny, k):
    """A request's room before max_tokens is far more than K: each verification carries K proposals."""
    path, prompts, expected = tiny
    llm = LLM(path, dtype="float32", num_kv_blocks=256, speculative_config=draft_config(path, k))
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    scheduler = llm.engine.scheduler
    assert scheduler.num_spec_drafts > 0
    assert scheduler.num_spec_draft_tokens <= k * scheduler.num_spec_drafts
    assert len(scheduler.num_spec_accepted_per_pos) == k


def test_sampled_requests_verify_the_drafts_proposals(tiny):
    path, prompts, _ = tiny
    llm = LLM(path, dtype="float32", num_kv_blocks=256, speculative_config=draft_config(path))
    # a random model's distributions are flat: at a low temperature its argmax is likely enough to be kept
    params = SamplingParams(temperature=0.2, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    results = llm.generate(prompts, params)
    assert all(len(r.token_ids) == MAX_TOKENS for r in results)
    scheduler = llm.engine.scheduler
    assert 0 < scheduler.num_spec_accepted_tokens <= scheduler.num_spec_draft_tokens
    check_pools_idle(llm.engine)


def test_aborts_mid_speculation_leave_both_pools_idle_and_whole(tiny, other_draft):
    path, prompts, _ = tiny
    llm = LLM(path, dtype="float32", num_kv_blocks=64, speculative_config=draft_config(other_draft))
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    for _ in range(50):
        engine.step()
        if any(r.spec_token_ids for r in engine.scheduler.running):
            break
    engine.step()  # verifies those proposals and makes the next
    assert engine.proposer.num_used_blocks > 0 and engine.scheduler.num_spec_draft_tokens > 0
    assert any(r.spec_token_ids for r in engine.scheduler.running)
    running = [r.req_id for r in engine.scheduler.running]
    engine.abort(running[: len(running) // 2])  # some between two steps...
    engine.step()
    engine.proposer.check_integrity()
    engine.abort(list(engine.requests))  # ...then the rest, with proposals pending
    engine.step()
    assert not engine.has_unfinished()
    check_pools_idle(engine)


def test_a_draft_of_another_vocabulary_or_a_shorter_context_is_refused(tiny, tmp_path):
    path, _, _ = tiny
    import transformers

    wider = tmp_path / "wider"
    config = transformers.LlamaConfig(**{**COMMON, "vocab_size": 300})
    transformers.LlamaForCausalLM(config).save_pretrained(wider)
    with pytest.raises(ValueError, match="300 tokens"):
        LLM(path, dtype="float32", speculative_config=draft_config(wider))
    shorter = tmp_path / "shorter"
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**{**COMMON, "max_position_embeddings": 64})
    ).save_pretrained(shorter)
    with pytest.raises(ValueError, match="64 positions"):
        LLM(path, dtype="float32", speculative_config=draft_config(shorter))
    LLM(path, dtype="float32", max_model_len=64, speculative_config=draft_config(shorter))
    _, renamed = save_tiny_model("llama", tmp_path / "renamed", seed=1)
    save_byte_tokenizer(renamed)
    tokenizer = json.loads((renamed / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (renamed / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="token id 0"):
        LLM(path, dtype="float32", speculative_config=draft_config(renamed))


def test_speculative_config_takes_vllms_draft_model_fields():
    config = SpeculativeConfig.from_value('{"model": "/m", "num_speculative_tokens": 2}')
    assert (config.method, config.model) == ("draft_model", "/m")
    ok = {
        "method": "draft_model",
        "model": "/m",
        "num_speculative_tokens": 2,
        "draft_tensor_parallel_size": 1,
    }
    assert SpeculativeConfig.from_value(ok).draft_tensor_parallel_size == 1
    for bad, message in [
        ({"method": "draft_model", "num_speculative_tokens": 2}, '"model"'),
        ({**ok, "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size must be 1"),
        ({**ok, "prompt_lookup_max": 3}, 'prompt_lookup_max is the "ngram"'),
        ({"method": "ngram", "model": "/m", "num_speculative_tokens": 2}, 'model is the "draft_model"'),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_value(bad)


@pytest.mark.parametrize("temperature", [0, 0.2])
def test_a_grammar_rejects_the_targets_own_proposals_it_does_not_allow(tiny, temperature):
    """The target as its own draft proposes its unconstrained argmax, which every step keeps without a
    grammar; under a grammar of lowercase letters, the proposals the grammar bans are rejected, and the
    output is the grammar's (greedy: exactly the output without speculation)."""
    import re

    from infer.structured_outputs.constraint import StructuredOutputs

    path, prompts, _ = tiny
    grammar = StructuredOutputs(regex="[a-z]{12}")
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=20, structured_outputs=grammar)
    llm = LLM(path, dtype="float32", num_kv_blocks=256, speculative_config=draft_config(path))
    results = llm.generate(prompts, params)
    assert all(re.fullmatch("[a-z]{12}", r.text) for r in results)
    scheduler = llm.engine.scheduler
    assert 0 < scheduler.num_spec_accepted_tokens < scheduler.num_spec_draft_tokens
    if temperature == 0:
        plain = LLM(path, dtype="float32", num_kv_blocks=256).generate(prompts, params)
        assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    check_pools_idle(llm.engine)


def test_the_server_flag_takes_a_draft_model():
    import argparse

    from infer.server.args import add_server_args, parse_server_args

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    flag = '{"method": "draft_model", "model": "/drafts/small", "num_speculative_tokens": 4}'
    config = parse_server_args(parser, ["--speculative-config", flag]).engine.speculative_config
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", "/drafts/small", 4)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size"):
        bad = '{"model": "/drafts/small", "num_speculative_tokens": 4, "draft_tensor_parallel_size": 2}'
        parse_server_args(parser, ["--speculative-config", bad])
