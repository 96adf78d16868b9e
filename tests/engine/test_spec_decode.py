"""Speculative decoding end to end: greedy outputs equal those without it (the tiny model in every engine
configuration of test_engine, the embedded model with every sampling feature, every architecture), the
proposals are accepted where the text repeats, and an abort mid-speculation gives every block back."""

from __future__ import annotations

import pytest
from scipy.stats import chisquare

from infer.config import SpeculativeConfig
from infer.core.request import Request
from infer.core.speculation_gate import MIN_PLAIN, MIN_VERIFY
from infer.engine.llm import LLM
from infer.models.loader import EMBEDDED_MODEL
from infer.sampling_params import SamplingParams
from infer.structured_outputs.constraint import StructuredOutputs
from tests.engine.test_engine import CONFIGS, MAX_TOKENS
from tests.models.tiny_models import VARIANTS, save_tiny_model

# every step speculates (no gain gate: its choices depend on timings; tests/unit/test_speculation_gate.py)
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_gain": False,
}
SPEC_ALWAYS = {**SPEC, "disable_by_batch_size": 64}  # whatever the batch: CONFIGS' 8 requests too
# texts that repeat themselves, as the embedded model (trained on the King James Bible) continues them
REPEATING = [
    "And God said, Let there be light: and there was light. And God said, Let there be light: and there",
    "The LORD is my shepherd; I shall not want. The LORD is my shepherd; I shall not",
    "In the beginning God created the heaven and the earth.",
]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_output_is_invariant_under_speculation(tiny, name):
    """Chunked prefill, prefix hits, preemption, recomputation, every policy: the tokens are
    transformers' greedy tokens with proposals verified beside them."""
    path, prompts, expected = tiny
    args = {"num_kv_blocks": 256, **CONFIGS[name]}
    llm = LLM(path, dtype="float32", speculative_config=SPEC_ALWAYS, **args)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    priorities = [i % 3 for i in range(len(prompts))] if name == "priority" else None
    results = llm.generate(prompts, params, priorities)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    scheduler = llm.engine.scheduler
    scheduler.check_integrity()
    assert scheduler.kv_cache_manager.num_used_blocks == 0
    assert scheduler.num_spec_draft_tokens > 0


@pytest.fixture(scope="module")
def embedded():
    """The embedded model without and with speculation (float32: the same logits either way)."""
    return (
        LLM(str(EMBEDDED_MODEL), dtype="float32", num_kv_blocks=256),
        LLM(str(EMBEDDED_MODEL), dtype="float32", num_kv_blocks=256, speculative_config=SPEC),
    )


def generate_both(embedded, params, prompts=REPEATING):
    plain, spec = embedded
    return plain.generate(prompts, params), spec.generate(prompts, params)


@pytest.mark.slow
def test_embedded_model_accepts_proposals_and_keeps_its_greedy_output(embedded):
    scheduler = embedded[1].engine.scheduler
    drafted, accepted = scheduler.num_spec_draft_tokens, scheduler.num_spec_accepted_tokens
    without, with_spec = generate_both(embedded, SamplingParams(temperature=0, max_tokens=40))
    assert [r.token_ids for r in with_spec] == [r.token_ids for r in without]
    assert [r.text for r in with_spec] == [r.text for r in without]
    assert scheduler.num_spec_draft_tokens - drafted > 20
    assert scheduler.num_spec_accepted_tokens - accepted > 10  # the repeated verse is proposed and kept
    steps_saved = scheduler.num_spec_accepted_tokens - accepted
    assert sum(len(r.token_ids) for r in with_spec) == 120 and steps_saved > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=40, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(temperature=0, max_tokens=40, logit_bias={262: 3.0}),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=30, stop_token_ids=[13]),
        SamplingParams(temperature=0, max_tokens=40, stop=["The"]),
        SamplingParams(temperature=0, max_tokens=40, stop=["And"], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=7),
        SamplingParams(temperature=0, max_tokens=40, bad_words=["LORD"]),
    ],
    ids=["repetition", "presence", "logit_bias", "min_tokens", "stop", "stop_included", "max_tokens", "bad"],
)
def test_sampling_features_are_unchanged_by_speculation(embedded, params):
    without, with_spec = generate_both(embedded, params)
    for a, b in zip(without, with_spec, strict=True):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert b.request.num_output_tokens == a.request.num_output_tokens == len(a.token_ids)


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["The", "And"])
def test_a_stop_string_among_accepted_proposals_ends_the_output_there(embedded, monkeypatch, stop):
    """These stop strings complete on an accepted proposal with more tokens emitted after it in the same
    step: those are dropped, from the output and from the request's count."""
    dropped = []
    drop = Request.drop_output_tail
    monkeypatch.setattr(Request, "drop_output_tail", lambda req, n: (dropped.append(n), drop(req, n)))
    params = SamplingParams(temperature=0, max_tokens=40, stop=[stop])
    without, with_spec = generate_both(embedded, params, REPEATING[:2])
    assert [r.token_ids for r in with_spec] == [r.token_ids for r in without]
    assert [r.text for r in with_spec] == [r.text for r in without]
    assert any(r.finish_reason == "stop" for r in with_spec)
    assert dropped and all(n > 0 for n in dropped)


@pytest.mark.slow
def test_logprobs_requests_are_not_given_proposals(embedded):
    scheduler = embedded[1].engine.scheduler
    drafted = scheduler.num_spec_draft_tokens
    without, with_spec = generate_both(embedded, SamplingParams(temperature=0, max_tokens=20, logprobs=2))
    assert [r.token_ids for r in with_spec] == [r.token_ids for r in without]
    assert scheduler.num_spec_draft_tokens == drafted


@pytest.mark.slow
def test_a_grammar_rejects_the_proposals_it_does_not_allow(embedded):
    """The verses repeat, and the proposals with them; lowercase words only: a proposal of a capitalised
    word (" God", " LORD") is rejected, the rest are verified; the output is the grammar's greedy one."""
    import re

    scheduler = embedded[1].engine.scheduler
    drafted, accepted = scheduler.num_spec_draft_tokens, scheduler.num_spec_accepted_tokens
    regex = r"( [a-z]{1,8}[,:;]?){3,30}\."
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputs(regex=regex))
    without, with_spec = generate_both(embedded, params)
    assert [r.token_ids for r in with_spec] == [r.token_ids for r in without]
    assert all(re.fullmatch(regex, r.text) for r in with_spec if r.finish_reason == "stop")
    num_drafted = scheduler.num_spec_draft_tokens - drafted
    num_accepted = scheduler.num_spec_accepted_tokens - accepted
    assert num_drafted > 0 and num_accepted < num_drafted


@pytest.mark.slow
def test_aborting_mid_speculation_gives_every_block_back(embedded):
    engine = embedded[1].engine
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_used_blocks == 0
    for prompt in REPEATING:
        engine.add_request(prompt, SamplingParams(temperature=0.8, seed=1, max_tokens=200, ignore_eos=True))
    drafted = engine.scheduler.num_spec_draft_tokens
    for _ in range(100):
        engine.step()
        if engine.scheduler.num_spec_draft_tokens > drafted and any(
            r.spec_token_ids for r in engine.scheduler.running
        ):
            break
    assert engine.scheduler.num_spec_draft_tokens > drafted, "no step speculated"
    engine.abort(list(engine.requests))
    engine.step()  # the runner forgets them
    engine.scheduler.check_integrity()
    assert not engine.has_unfinished()
    assert kv.num_used_blocks == 0 and kv.num_free_blocks + kv.num_cached_blocks == kv.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_architecture_keeps_its_greedy_output(variant, tmp_path):
    _, path = save_tiny_model(variant, tmp_path)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(3, 40)), [9] * 12]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=4).generate(prompts, params)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=4, speculative_config=SPEC)
    spec = llm.generate(prompts, params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert llm.engine.scheduler.num_spec_accepted_tokens > 0  # greedy random models loop: proposals hit


def test_speculative_config_is_vllms():
    assert SpeculativeConfig(num_speculative_tokens=4).prompt_lookup_min == 5
    config = SpeculativeConfig.from_value(
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
    )
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)
    for bad, message in [
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, '"model"'),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<="),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"num_speculative_tokens": 2, "lookahead": 3}, "unknown field"),
        ("{not json", "not valid JSON"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_value(bad)


def test_the_server_flag_takes_vllms_json():
    import argparse

    from infer.server.args import add_server_args, parse_server_args

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    flag = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
    config = parse_server_args(parser, ["--speculative-config", flag]).engine.speculative_config
    assert (
        config.method,
        config.num_speculative_tokens,
        config.prompt_lookup_min,
        config.prompt_lookup_max,
    ) == (
        "ngram",
        3,
        2,
        4,
    )
    assert parse_server_args(parser, []).engine.speculative_config is None
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        parse_server_args(parser, ["--speculative-config", '{"method": "ngram"}'])


@pytest.mark.slow
def test_sampled_tokens_keep_the_models_distribution():
    """Temperature 1 on the embedded model: after "... Moses, saying" + ",", the text's earlier "saying,
    Speak" makes " Speak" the proposal for the next token, which the model gives ~9%: kept sometimes,
    rejected mostly. That token, over the samples whose first token is "," (~99.5%), is distributed as the
    model's next-token distribution there (transformers', float32), by a chi-square test."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = {**SPEC, "disable_by_batch_size": 512}
    llm = LLM(str(EMBEDDED_MODEL), dtype="float32", num_kv_blocks=512, speculative_config=spec)
    tokenizer = llm.engine.tokenizer
    text = (
        "And the LORD spake unto Moses, saying, Speak unto the children of Israel. "
        "And the LORD spake unto Moses,"
    )
    prompt = tokenizer.encode(text) + tokenizer.encode(" saying", add_special_tokens=False)
    comma = tokenizer.encode(",", add_special_tokens=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(str(EMBEDDED_MODEL), dtype=torch.float32)
    with torch.no_grad():
        probs = torch.softmax(hf(torch.tensor([[*prompt, comma]])).logits[0, -1].double(), dim=-1)
    scheduler = llm.engine.scheduler
    results = llm.generate([prompt] * 1000, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True))
    seconds = [r.token_ids[1] for r in results if r.token_ids[0] == comma]
    assert len(seconds) > 900
    assert scheduler.num_spec_draft_tokens >= len(seconds)  # each was verified against a proposal
    assert 20 < scheduler.num_spec_accepted_tokens < 300  # ~9% kept
    counts = torch.bincount(torch.tensor(seconds), minlength=len(probs)).double()
    expected = probs * len(seconds)
    big = expected >= 5  # the rest pooled into one bin
    observed = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    expected = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    expected *= observed.sum() / expected.sum()  # exactly: scipy checks the totals agree
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3


@pytest.mark.parametrize("stop_token_after", [False, True])
def test_tokens_emitted_past_a_stop_string_are_dropped(tiny, stop_token_after):
    """One step emitted "x", "a", "b" and more; "ab" is a stop string: the output ends at "b" (text "x"),
    and the request counts the tokens up to it, also when a stop token ended the step after it."""
    from infer.core.outputs import RequestOutput

    engine = LLM(tiny[0], dtype="float32", num_kv_blocks=64, speculative_config=SPEC).engine
    stop_id = engine.tokenizer.encode("!", add_special_tokens=False)[0]
    params = SamplingParams(max_tokens=20, stop=["ab"], stop_token_ids=[stop_id])
    req = engine.add_request([5, 6, 7], params)
    kept = engine.tokenizer.encode("xab", add_special_tokens=False)
    emitted = kept + (
        [stop_id] if stop_token_after else engine.tokenizer.encode("cd", add_special_tokens=False)
    )
    for token_id in emitted:  # as Scheduler.update appends them
        req.append_output_token(token_id, 0.0)
    update = RequestOutput(req.req_id, list(emitted))
    if stop_token_after:
        update.finished, update.finish_reason, update.stop_reason = True, "stop", stop_id
    out = engine._detokenize(update)
    assert (out.token_ids, out.text, out.finish_reason, out.finished) == (kept, "x", "stop", True)
    assert req.output_token_ids == kept and out.num_output_tokens == len(kept)


def test_bfloat16_greedy_output_is_invariant_under_speculation(tmp_path, row_invariant_linears):
    """In bfloat16 a verification's rows are computed as lone decodes' are (the decode kernel, not the
    prefill kernel, whose rounding differs), so greedy output keeps plain decoding's tokens and proposals
    are accepted where it repeats. The random model's logits are close enough that a kernel's rounding
    flips its argmax within a few tokens."""
    _, path = save_tiny_model("llama", tmp_path)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(3, 40)), [9] * 12]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    args = dict(dtype="bfloat16", num_kv_blocks=64, block_size=4)
    plain = [r.token_ids for r in LLM(str(path), **args).generate(prompts, params)]
    for one in prompts:  # one stream, and all of them together
        llm = LLM(str(path), **args, speculative_config=SPEC)
        assert [r.token_ids for r in llm.generate([one], params)] == [plain[prompts.index(one)]]
    llm = LLM(str(path), **args, speculative_config=SPEC)
    assert [r.token_ids for r in llm.generate(prompts, params)] == plain
    assert llm.engine.scheduler.num_spec_accepted_tokens > 0


def test_the_gain_gate_measures_both_kinds_of_step_and_keeps_the_output():
    """One stream with n-gram proposals through the speculation gate (the default): it measures
    verification steps and plain ones at one decoding request, whichever it then keeps, and the greedy
    output is plain decoding's."""
    spec = {key: value for key, value in SPEC.items() if key != "disable_by_gain"}
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    outputs = []
    for config in (None, spec):
        llm = LLM(str(EMBEDDED_MODEL), dtype="float32", num_kv_blocks=256, speculative_config=config)
        outputs.append(llm.generate([REPEATING[0]], params)[0].token_ids)
    gate = llm.engine.speculation_gate
    assert gate.by_gain
    assert gate.verify.count(1) >= MIN_VERIFY and gate.plain.count(1) >= MIN_PLAIN
    assert outputs[1] == outputs[0]
