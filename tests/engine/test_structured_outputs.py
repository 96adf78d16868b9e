"""Structured outputs: greedy constrained outputs equal transformers' greedy generate under the same
grammar (llguidance's matcher driven by a LogitsProcessor, a path apart from the engine's), in engine
configurations that split, recompute or batch the requests; the text follows the grammar; a grammar's
tokens are exactly those its language allows; bad grammars are refused before anything runs."""

from __future__ import annotations

import json
import re

import llguidance
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor

from infer.engine.llm import LLM
from infer.models.loader import EMBEDDED_MODEL
from infer.sampling_params import SamplingParams
from infer.structured_outputs.compiler import GrammarCompiler
from infer.structured_outputs.constraint import StructuredOutputs
from infer.structured_outputs.grammar_text import grammar_text
from infer.structured_outputs.matcher import Grammar, banned
from tests.engine.test_engine import CONFIGS
from tests.grids import first_fast
from tests.models.tiny_models import greedy_with

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "ok", "n"],
}
SPECS = {
    "json": StructuredOutputs(json=SCHEMA, disable_any_whitespace=True, disable_additional_properties=True),
    "regex": StructuredOutputs(regex=r"[A-Z][a-z]{2,8}( [a-z]{1,8}){1,3}\."),
    "choice": StructuredOutputs(choice=["alpha", "beta gamma", "delta"]),
    "gbnf": StructuredOutputs(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
    "lark": StructuredOutputs(grammar='start: "say " WORD "!"\nWORD: /[a-z]{1,12}/'),
}
PROMPTS = ["The answer is", "In the beginning God created", "And he said unto them,"]
MAX_TOKENS = 40


def follows(kind: str, text: str) -> bool:
    if kind == "json":
        value = json.loads(text)
        return (
            set(value) == {"name", "ok", "n"}
            and isinstance(value["name"], str)
            and len(value["name"]) <= 10
            and isinstance(value["ok"], bool)
            and 0 <= value["n"] <= 99
        )
    if kind == "regex":
        return re.fullmatch(SPECS["regex"].regex, text) is not None
    if kind == "choice":
        return text in SPECS["choice"].choice
    if kind == "gbnf":
        return re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", text) is not None
    return re.fullmatch(r"say [a-z]{1,12}!", text) is not None


class GrammarProcessor(LogitsProcessor):
    """transformers' side: llguidance's matcher fed the generated tokens; its bitmask bans the rest."""

    def __init__(self, compiler: GrammarCompiler, spec: StructuredOutputs, prompt_len: int):
        self.matcher = llguidance.LLMatcher(compiler.tokenizer, grammar_text(spec))
        self.prompt_len, self.num_fed = prompt_len, 0

    def __call__(self, input_ids, scores):
        output = input_ids[0, self.prompt_len :].tolist()
        assert self.matcher.consume_tokens(output[self.num_fed :])
        self.num_fed = len(output)
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: scores.shape[1]].astype(bool))
        return scores.masked_fill(~allowed, float("-inf"))


@pytest.fixture(scope="module")
def reference():
    """Per spec, per prompt: transformers' greedy tokens under the grammar (EOS ends them, as ours)."""
    llm = LLM(str(EMBEDDED_MODEL), dtype="float32")
    tokenizer, compiler = llm.engine.tokenizer, llm.engine.grammars
    hf = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32)
    expected = {}
    for kind, spec in SPECS.items():
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt)
            processor = GrammarProcessor(compiler, spec, len(ids))
            expected[kind, prompt] = greedy_with(hf, ids, MAX_TOKENS, processor, tokenizer.eos_token_ids)
    return expected


@pytest.mark.parametrize("name", first_fast(["default", "odd_chunks", "preemption_uncached", "no_kv_cache"]))
def test_greedy_constrained_outputs_match_transformers(reference, name):
    """Every spec beside every other and beside unconstrained requests, whose outputs stay their own."""
    llm = LLM(str(EMBEDDED_MODEL), dtype="float32", **{"num_kv_blocks": 256, **CONFIGS[name]})
    requests = [(kind, prompt) for kind in SPECS for prompt in PROMPTS]
    plain = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=SPECS[k]) for k, _ in requests
    ]
    alone = [r.token_ids for r in LLM(str(EMBEDDED_MODEL), dtype="float32").generate(PROMPTS, plain)]
    results = llm.generate([p for _, p in requests] + PROMPTS, params + [plain] * len(PROMPTS))
    for (kind, prompt), result in zip(requests, results, strict=False):
        assert result.token_ids == reference[kind, prompt], (kind, prompt)
        if result.finish_reason == "stop":  # the grammar completed: the text is a sentence of it
            assert follows(kind, result.text), (kind, result.text)
    assert [r.token_ids for r in results[len(requests) :]] == alone
    completed = sum(r.finish_reason == "stop" for r in results[: len(requests)])
    assert completed >= len(requests) - len(PROMPTS)  # most end with their grammar, not at max_tokens
    if name == "preemption_uncached":
        assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.scheduler.check_integrity()
    assert llm.engine.scheduler.kv_cache_manager.num_used_blocks == 0
    llm.engine.step()  # the step after a request ends tells the runner
    assert not llm.engine.runner.sampler.grammars  # forgotten with their requests


@pytest.mark.parametrize("kind", first_fast(sorted(SPECS)))
def test_sampled_outputs_follow_the_grammar(kind):
    """Random sampling at a high temperature picks tokens the model would rarely choose: every completed
    output is still a sentence of the grammar, and seeds reproduce it."""
    llm = LLM(str(EMBEDDED_MODEL), dtype="float32")
    params = [
        SamplingParams(temperature=1.5, seed=s, max_tokens=120, structured_outputs=SPECS[kind])
        for s in range(6)
    ]
    results = llm.generate(["Once upon a time"] * 6, params)
    assert all(follows(kind, r.text) for r in results if r.finish_reason == "stop"), [r.text for r in results]
    assert sum(r.finish_reason == "stop" for r in results) >= 3
    again = llm.generate(["Once upon a time"] * 6, params)
    assert [r.token_ids for r in again] == [r.token_ids for r in results]


def test_masks_allow_exactly_the_grammars_tokens():
    """The bitmask's bit order: after "(", a GBNF of digits allows exactly the tokens made of digits (a
    digit run may continue), "+" and ")" joined to digits, and nothing else of the vocabulary."""
    llm = LLM(str(EMBEDDED_MODEL), dtype="float32")
    tokenizer, compiler = llm.engine.tokenizer, llm.engine.grammars
    spec = StructuredOutputs(regex=r"[0-9]+")
    grammar = Grammar(compiler.matcher(spec))
    allowed = ~banned([grammar], compiler.vocab_size, llm.engine.model_config.vocab_size)[0]
    texts = {i: tokenizer.decode([i], skip_special_tokens=False) for i in range(tokenizer.vocab_size)}
    digits = {i for i, t in texts.items() if t and t.isascii() and t.isdigit()}
    assert digits and set(allowed.nonzero().flatten().tolist()) == digits
    first = min(digits)
    grammar.advance([first])  # a digit: now the grammar may also end
    allowed = ~banned([grammar], compiler.vocab_size, llm.engine.model_config.vocab_size)[0]
    assert set(allowed.nonzero().flatten().tolist()) == digits | tokenizer.eos_token_ids


def test_the_grammar_wins_where_other_bans_leave_nothing():
    """min_tokens bans EOS, which is all a completed grammar allows: the output is still the choice (EOS
    tokens, not stops yet, until min_tokens), never a token outside the grammar."""
    llm = LLM(str(EMBEDDED_MODEL), dtype="float32")
    spec = StructuredOutputs(choice=["yes"])
    [result] = llm.generate(
        ["Is it?"], SamplingParams(temperature=0, max_tokens=20, min_tokens=6, structured_outputs=spec)
    )
    assert result.text == "yes" and result.finish_reason == "stop"
    assert len(result.token_ids) == 6 and set(result.token_ids[-2:]) <= llm.engine.tokenizer.eos_token_ids


BAD = [
    (StructuredOutputs(regex="(ab"), "unclosed group"),
    (StructuredOutputs(json={"type": "foo"}), "does not compile"),
    (StructuredOutputs(json="{not json"), "JSON"),
    (StructuredOutputs(grammar="nonsense ::: ="), "grammar"),
]


def test_bad_grammars_are_refused_at_add_request():
    llm = LLM(str(EMBEDDED_MODEL), dtype="float32")
    for spec, fragment in BAD:
        with pytest.raises(ValueError, match=re.escape(fragment)):
            llm.engine.add_request("hi", SamplingParams(structured_outputs=spec))
    assert not llm.engine.has_unfinished()
    for fields, fragment in [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["b"]}, "exactly one"),
        ({"choice": []}, "choice"),
        ({"json_object": False}, "json_object"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            StructuredOutputs(**fields)


FORCING = [  # each compiled, then failed at its second mask with "too many expressions constructed"
    StructuredOutputs(regex="((a{100}){100}){100}"),
    StructuredOutputs(regex="b|a{300000}"),  # once "a" is sampled
    StructuredOutputs(json={"type": "string", "pattern": "^((a{100}){100}){100}$"}),
    StructuredOutputs(json={"type": "object", "patternProperties": {"(x{1000}){100}": {}}}),
    StructuredOutputs(grammar="start: A\nA: /((a{100}){100}){100}/"),
    StructuredOutputs(grammar='start: "x" | A\nA: "a"~300000'),
    StructuredOutputs(grammar='start: "a"~40000'),  # "Too many items" in the Earley parser
    StructuredOutputs(grammar='start: %json {"type": "string", "pattern": "a{300000}"}'),
    StructuredOutputs(grammar='root ::= "a"{300000}'),  # GBNF
]


@pytest.mark.parametrize("spec", FORCING, ids=lambda s: s.text[:30])
def test_grammars_that_force_long_text_are_refused_before_compiling(spec):
    """llguidance's lexer walks the text a grammar forces at every step: such a grammar compiled (~1-4 s,
    +100-200 MB) and then failed mid-output. It is refused from its text alone, naming the bound."""
    compiler = GrammarCompiler("{}", 8, [0])  # never builds its tokenizer: the refusal comes first
    with pytest.raises(ValueError, match="no text shorter than .* characters; at most 16384"):
        compiler.check(spec)
    assert compiler._tokenizer is None


def test_the_forced_text_of_a_regex_or_lark_grammar():
    from infer.structured_outputs.forced_text import lark_forced_chars, regex_forced_chars

    cases = {
        "((a{100}){100}){100}": 10**6, "(a{300000})?": 300000, "[a-z]{20000}": 20000, r"\d{3}-\d{4}": 8,
        "a{0,1000000}": 1, "a*?b{2}?": 2, "(?i)abc": 3, "(?P<x>ab)c": 3, r"[\]a]{5}": 5, "[[:alpha:]]{4}": 4,
        r"\p{L}{3}": 3, r"^\bx\b$": 1, "(x[a-z]{50}){0,9}": 51, "": 0,
    }  # fmt: skip
    assert {rx: regex_forced_chars(rx) for rx in cases} == cases
    grammar = (
        'start: A b "xyz"~3 | "q"\nA: "a"~100 B{2}\nB: /b{10}/i\nb: b "c" | "d"  // "z"~99999\n'
        '%ignore /\\s+/\nc[stop=","]: %json {"pattern": "a{5}"}\nd: (/[0-9]{1,3}|x{200}/)?'
    )
    forced, schemas = lark_forced_chars(grammar)
    assert forced == {"start": 130, "A": 120, "B": 10, "b": 1, "c": 0, "d": 200}
    assert schemas == [{"pattern": "a{5}"}]
    continued = 'start: a\n    | b "x: y"~5000\na: "q"\nb.2: "r"'  # a colon in a string starts nothing
    assert lark_forced_chars(continued)[0] == {"start": 20001, "a": 1, "b": 1}


def test_a_grammar_at_the_forced_text_bound_compiles_and_generates():
    llm = LLM(str(EMBEDDED_MODEL), dtype="float32")
    spec = StructuredOutputs(regex="(a{128}){128}")
    [result] = llm.generate(["Say"], SamplingParams(temperature=0, max_tokens=4, structured_outputs=spec))
    assert result.finish_reason == "length" and set(result.text) == {"a"}


def test_compiled_grammars_are_cached_and_each_request_gets_its_own_matcher():
    llm = LLM(str(EMBEDDED_MODEL), dtype="float32")
    compiler = llm.engine.grammars
    spec = StructuredOutputs(json=SCHEMA)
    same = StructuredOutputs(json=json.dumps(SCHEMA))  # the same schema as text
    first, second = compiler.matcher(spec), compiler.matcher(same)
    assert len(compiler._pool) == 1 and first is not second
    assert first.consume_token(compiler.tokenizer.tokenize_str("{")[0])
    assert second.validate_tokens(compiler.tokenizer.tokenize_str('"')) == 0  # untouched by the first


def test_schemas_differing_only_in_key_order_are_two_grammars_each_in_its_own_order():
    llm = LLM(str(EMBEDDED_MODEL), dtype="float32")
    compiler = llm.engine.grammars
    props = {"alpha": {"type": "integer"}, "beta": {"type": "integer"}}
    forward = {"type": "object", "properties": props, "required": ["alpha", "beta"]}
    backward = {**forward, "properties": dict(reversed(props.items()))}
    first, second = (
        compiler.matcher(StructuredOutputs(json=s, disable_any_whitespace=True)) for s in (forward, backward)
    )
    assert len(compiler._pool) == 2
    for matcher, start in ((first, '{"alpha":'), (second, '{"beta":')):  # llguidance keeps the given order
        tokens = compiler.tokenizer.tokenize_str(start)
        assert matcher.validate_tokens(tokens) == len(tokens)


def test_the_grammar_tokenizer_is_written_at_the_first_grammar_not_at_load(monkeypatch):
    """A model's load does not write its tokenizer as JSON for llguidance (a server of several models
    loads at every switch): the first grammar does, once."""
    from infer.engine.tokenizer import Tokenizer

    written = []
    to_json = Tokenizer.to_json
    monkeypatch.setattr(Tokenizer, "to_json", lambda self: written.append(1) or to_json(self))
    llm = LLM(str(EMBEDDED_MODEL), dtype="float32")
    assert written == []
    for _ in range(2):
        [result] = llm.generate(
            ["Say"], SamplingParams(temperature=0, max_tokens=8, structured_outputs=SPECS["choice"])
        )
        assert result.text in ("alpha", "beta gamma", "delta")
    assert written == [1]


def test_a_warmed_up_engine_builds_the_grammar_tokenizer_before_any_request(monkeypatch):
    """A server's engine (LLMEngine.warm_up) writes and builds llguidance's tokenizer before it reports
    ready: its first grammar request, beside other streams, holds the GIL for neither."""
    from infer.engine.tokenizer import Tokenizer

    written = []
    to_json = Tokenizer.to_json
    monkeypatch.setattr(Tokenizer, "to_json", lambda self: written.append(1) or to_json(self))
    llm = LLM(str(EMBEDDED_MODEL), dtype="float32", enforce_eager=True)
    assert written == [] and llm.engine.grammars._tokenizer is None
    llm.engine.warm_up()
    assert written == [1] and llm.engine.grammars._tokenizer is not None
    [result] = llm.generate(
        ["Say"], SamplingParams(temperature=0, max_tokens=8, structured_outputs=SPECS["choice"])
    )
    assert result.text in ("alpha", "beta gamma", "delta")
    assert written == [1]


def test_a_model_without_eos_refuses_structured_outputs(tmp_path):
    from tests.models.tiny_models import save_byte_tokenizer, save_tiny_model

    _, path = save_tiny_model("llama", tmp_path)
    save_byte_tokenizer(path)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        config.pop("eos_token_id", None)
        (path / name).write_text(json.dumps(config))
    llm = LLM(str(path), dtype="float32")
    with pytest.raises(ValueError, match="EOS"):
        llm.engine.add_request("hi", SamplingParams(structured_outputs=StructuredOutputs(regex="a+")))


def test_a_grammar_whose_parser_fails_ends_its_request_alone():
    """A grammar that compiles but meets llguidance's limits while generating (here a rule of 1,000 "a"s
    under a tight Earley item limit) ends with finish_reason "error" and the reason, not as a complete
    "stop"; the request beside it completes as if alone."""
    llm = LLM(str(EMBEDDED_MODEL), dtype="float32")
    llm.engine.grammars.parser_limits = {"step_max_items": 100, "verbose_errors": False}
    huge = StructuredOutputs(grammar='start: "a"~1000')
    stuck = SamplingParams(temperature=0, max_tokens=8, structured_outputs=huge)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [alone] = llm.generate(PROMPTS[:1], plain)
    failed, beside = llm.generate(PROMPTS[:1] * 2, [stuck, plain])
    assert failed.finish_reason == "error" and "parser failed" in failed.error
    assert len(failed.error) < 2000  # llguidance's verbose errors would hold the whole grammar
    assert beside.token_ids == alone.token_ids


def test_matchers_are_copied_at_add_request_and_forgotten_with_their_requests():
    """The sampler never compiles: each request's matcher is copied when it is added (the cache may
    evict the grammar before its first step); a request aborted before it ran leaves nothing behind."""
    llm = LLM(str(EMBEDDED_MODEL), dtype="float32")
    compiler = llm.engine.grammars
    spec = StructuredOutputs(regex="[a-z]{3,6}")
    kept = llm.engine.add_request("Say", SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec))
    aborted = llm.engine.add_request("Say", SamplingParams(max_tokens=8, structured_outputs=spec))
    assert set(compiler._reserved) == {kept.req_id, aborted.req_id}
    compiler._pool.clear()
    compiler._pool = None  # any compile from here on would raise
    llm.engine.abort(aborted.req_id)
    text = ""
    while llm.engine.has_unfinished():
        text += "".join(out.text for out in llm.engine.step())
    llm.engine.step()
    assert re.fullmatch("[a-z]{3,6}", text)
    assert not compiler._reserved and not llm.engine.runner.sampler.grammars


def test_the_grammar_keeps_the_models_preference_where_allowed_ids_conflict():
    """allowed_token_ids that hold none of the grammar's tokens: the row samples the grammar's tokens
    by the model's own logits, so greedy gives what it gives without allowed_token_ids."""
    llm = LLM(str(EMBEDDED_MODEL), dtype="float32")
    spec = StructuredOutputs(choice=["alpha", "beta gamma", "delta"])
    free = SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec)
    boxed = SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec, allowed_token_ids=[7])
    results = llm.generate(PROMPTS * 2, [free] * 3 + [boxed] * 3)
    assert [r.text for r in results[3:]] == [r.text for r in results[:3]]


def test_under_ignore_eos_the_output_goes_on_free_after_the_grammar_ends():
    """As vLLM: EOS after the complete grammar does not stop an ignore_eos request, and from there on
    nothing is banned."""
    llm = LLM(str(EMBEDDED_MODEL), dtype="float32")
    spec = StructuredOutputs(choice=["yes"])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, structured_outputs=spec)
    [result] = llm.generate(["Is it?"], params)
    eos = llm.engine.tokenizer.eos_token_ids
    yes = llm.engine.tokenizer.encode("yes", add_special_tokens=False)
    assert result.token_ids[: len(yes)] == yes and result.token_ids[len(yes)] in eos
    assert len(result.token_ids) == 12 and not set(result.token_ids[len(yes) + 1 :]) <= eos


def test_disable_additional_properties_closes_schemas_not_data():
    from infer.structured_outputs.grammar_text import _closed

    schema = {
        "type": "object",
        "properties": {"x": {"const": {"properties": {"a": 1}}}, "y": {"type": "object", "properties": {}}},
        "patternProperties": {"^z": {"type": "object", "properties": {"b": {"type": "integer"}}}},
        "$defs": {"d": {"anyOf": [{"type": "object", "properties": {"c": {}}}]}},
    }
    closed = _closed(schema)
    assert closed["additionalProperties"] is False and "additionalProperties" not in schema  # a copy
    assert closed["properties"]["x"]["const"] == {"properties": {"a": 1}}  # data, untouched
    assert closed["properties"]["y"]["additionalProperties"] is False
    assert closed["patternProperties"]["^z"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["anyOf"][0]["additionalProperties"] is False
    deep = {"type": "string"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ValueError, match="nested too deeply"):
        StructuredOutputs(json=deep)


def test_grammar_sizes_and_kinds_are_bounded():
    llm = LLM(str(EMBEDDED_MODEL), dtype="float32")
    rules = "\n".join(f'r{i} ::= "w{i}" [a-z]* r{i + 1}?' for i in range(400))
    with pytest.raises(ValueError, match="GBNF grammar must be at most"):
        llm.engine.grammars.check(StructuredOutputs(grammar=f'root ::= r0\n{rules}\nr400 ::= "end"'))
    lark = "start: r0\n" + "\n".join(f'r{i}: "w{i}" r{i + 1}?' for i in range(400)) + '\nr400: "end"'
    llm.engine.grammars.check(StructuredOutputs(grammar=lark))  # Lark compiles in Rust: no such bound
    for bad in ("yes", {"a": 1}, ["x"] * 1025):
        with pytest.raises(ValueError, match="choice"):
            StructuredOutputs(choice=bad)


@pytest.mark.parametrize(
    "schema",
    [
        {"const": "ab" * 513},
        {"enum": ["short", "ab" * 513]},
        {"type": "object", "properties": {"a": {"type": "string", "enum": ["x", "ab" * 513]}}},
    ],
)
def test_a_schemas_literal_strings_are_bounded_as_a_choice(schema):
    """A const or enum string is a literal the mask follows as it does a choice, in time linear in its
    length at every step: a 300 KB const took a plain request beside it from 2.2 ms to 80 ms a token.
    It is bounded as a choice is (1,024 characters)."""
    with pytest.raises(ValueError, match="const or enum string holds 1026 characters; at most 1024"):
        grammar_text(StructuredOutputs(json=schema))
    fitting = json.loads(json.dumps(schema).replace("ab" * 513, "ab" * 512))
    assert grammar_text(StructuredOutputs(json=fitting))


def test_other_tensor_parallel_ranks_get_neither_histories_nor_grammars():
    """They do not sample: what rank 0 broadcasts each step leaves out a grammar (up to a MiB of text)
    and a history, without touching rank 0's own step."""
    from infer.core.outputs import ScheduledRequest, SchedulerOutput
    from infer.runner.parallel import _without_histories

    spec = StructuredOutputs(json=SCHEMA)
    params = SamplingParams(temperature=0, structured_outputs=spec, presence_penalty=0.5)
    history = [1, 2, 3]
    constrained = ScheduledRequest("a", [3], 2, [0], True, params, 2, history)
    plain = ScheduledRequest("b", [4], 0, [1], True, SamplingParams(), 1)
    sched = SchedulerOutput(scheduled=[constrained, plain])
    sent = _without_histories(sched)
    assert [s.history for s in sent.scheduled] == [None, None]
    assert sent.scheduled[0].sampling_params.structured_outputs is None
    assert sent.scheduled[0].sampling_params.presence_penalty == 0.5  # the rest as it was
    assert (
        sched.scheduled[0].sampling_params.structured_outputs is spec
        and sched.scheduled[0].history is history
    )
    assert _without_histories(SchedulerOutput(scheduled=[plain])).scheduled[0] is plain


def test_compiling_builds_what_the_lexer_left_for_the_first_mask():
    """A JSON schema's pattern is built at the first mask, in time quadratic in its length (4 KB: ~35 ms):
    the compiler computes that mask, off the engine thread, and the copies it hands out share what it
    built. A copy's first mask is far faster than that of the same grammar compiled cold."""
    import time

    llm = LLM(str(EMBEDDED_MODEL), dtype="float32")
    compiler = llm.engine.grammars
    spec = StructuredOutputs(json={"type": "string", "pattern": "^" + "a?" * 2000 + "$"})

    def first_mask(matcher) -> float:
        start = time.perf_counter()
        banned([Grammar(matcher)], compiler.vocab_size, compiler.vocab_size)
        return time.perf_counter() - start

    cold = llguidance.LLMatcher(compiler.tokenizer, grammar_text(spec), log_level=0)
    assert first_mask(cold) > 10 * first_mask(compiler.matcher(spec))


def _schemas(count: int, num_props: int) -> list[StructuredOutputs]:
    """Distinct JSON schemas of num_props properties (~50 characters of grammar each)."""
    kinds = [{"type": "string", "maxLength": 20}, {"type": "integer"}, {"type": "array", "items": {}}]
    return [
        StructuredOutputs(
            json={"type": "object", "properties": {f"p{k}_{i}": kinds[i % 3] for i in range(num_props)}}
        )
        for k in range(count)
    ]


def test_the_grammar_cache_is_bounded_by_an_estimate_of_bytes_checked_against_rss():
    """llguidance reports no size: the cache counts GRAMMAR_BASE_BYTES + GRAMMAR_BYTES_PER_CHAR per
    character of each grammar. Against the process's RSS growth over 20 distinct ~7 KB schemas kept
    alive, that estimate is not below it and at most 4x above it; and a 4 MiB cache keeps the most
    recent ones that fit, not all 20 (300 such schemas once held 256 MB)."""
    import ctypes
    import gc

    from infer.engine.tokenizer import Tokenizer
    from infer.structured_outputs.compiler import GRAMMAR_BASE_BYTES

    tokenizer = Tokenizer.from_pretrained(EMBEDDED_MODEL)
    compiler = GrammarCompiler.for_tokenizer(tokenizer, tokenizer.vocab_size, cache_mb=4)
    specs = _schemas(21, 140)
    compiler.check(specs[0])  # the tokenizer's tables, and llguidance's own first-use allocations

    def rss() -> int:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return int(open("/proc/self/statm").read().split()[1]) * 4096

    before = rss()
    compiled = [compiler._compile(compiler._prepare(spec)) for spec in specs[1:]]
    grown = rss() - before
    estimated = sum(nbytes for _, nbytes in compiled)
    assert grown <= estimated <= 4 * grown, (grown, estimated)
    del compiled
    for spec in specs[1:]:
        compiler.check(spec)
    assert compiler._pool.cached_bytes <= 4 << 20 and 1 < len(compiler._pool) < 20
    assert estimated // 20 > GRAMMAR_BASE_BYTES  # sized by its text, not counted
    cached = [key[1] for key in compiler._pool._cache]  # (kind, text, options), oldest first
    assert cached[-1] == specs[-1].text and specs[1].text not in cached  # the least recent went


@pytest.mark.slow
def test_a_grammar_after_ids_constrains_only_what_follows_them():
    """grammar_after_ids (the end of a model's thinking): the output is the free one up to and through
    those ids, then the grammar's; ids that never come leave the whole output free."""
    llm = LLM(str(EMBEDDED_MODEL), dtype="float32")
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [plain] = llm.generate(["In the beginning"], free)
    after = tuple(plain.token_ids[2:4])
    spec = StructuredOutputs(choice=["yes"])
    deferred = SamplingParams(temperature=0, max_tokens=12, structured_outputs=spec, grammar_after_ids=after)
    never = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, structured_outputs=spec, grammar_after_ids=(10**6,)
    )
    result, unconstrained = llm.generate(["In the beginning"] * 2, [deferred, never])
    assert result.token_ids[:4] == plain.token_ids[:4] and result.finish_reason == "stop"
    assert llm.engine.tokenizer.decode(result.token_ids[4:], skip_special_tokens=True) == "yes"
    assert unconstrained.token_ids == plain.token_ids
    llm.engine.step()
    assert not llm.engine.runner.sampler.grammar_starts and not llm.engine.runner.sampler.grammar_scanned
