"""Decode steps replayed from captured graphs (infer.runner.decode_graph): the eager forward's tokens and
logprobs in every format they run in, a batch size captured only once it has held, and graphs turned
off where a capture would not be faithful."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers

from infer import kernels
from infer.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.layers import attention_kernels, linear
from infer.runner import decode_graph
from infer.sampling_params import SamplingParams
from tests.models.tiny_models import COMMON, save_byte_tokenizer

STEPS = decode_graph.STEADY_STEPS


@pytest.fixture(autouse=True)
def graphs_pay(monkeypatch):
    """Whether replays pay is timed (`_check_pays`); here they always do, but in the test that says not."""
    monkeypatch.setattr(decode_graph, "MIN_GAIN", float("inf"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random Llama of head_dim 64, so that the C++ kernels (bf16, fp8, int8 / int4 linears) serve it."""
    if kernels.load() is None:
        pytest.skip("decode graphs run the C++ kernels")
    wider = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
    config = transformers.LlamaConfig(**{**COMMON, **wider}, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("graphs") / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    save_byte_tokenizer(path)
    return str(path)


def prompts(n: int = 6) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(2, 256, (length,), generator=gen).tolist() for length in (5, 17, 30, 9, 44, 1)[:n]]


def generate(path: str, enforce_eager: bool, params: SamplingParams, **config):
    """Every request's (token ids, logprobs) in order, and the engine."""
    engine = LLMEngine(
        EngineConfig(model=path, dtype="bfloat16", num_kv_blocks=128, enforce_eager=enforce_eager, **config)
    )
    outputs = {engine.add_request(p, params).req_id: ([], []) for p in prompts()}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.req_id][0].extend(out.token_ids)
            outputs[out.req_id][1].append(out.logprobs)
    return list(outputs.values()), engine


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize(
    "config",
    [{}, {"kv_cache_dtype": "fp8"}, {"quantization": "int8"}, {"quantization": "int4"}, {"max_num_seqs": 2}],
    ids=["bf16", "fp8_cache", "int8", "int4", "two_at_a_time"],
)
def test_replayed_steps_give_the_eager_tokens_and_logprobs(model_dir, config):
    """Prompts of 1-44 tokens, 40 outputs each: block tables grow while steps replay (block size 16)."""
    eager, _ = generate(model_dir, True, GREEDY, **config)
    replayed, engine = generate(model_dir, False, GREEDY, **config)
    assert replayed == eager
    graphs = engine.runner.graphs
    if config.get("kv_cache_dtype") == "fp8" and not attention_kernels.kernels_read_fp8(torch.bfloat16, 64):
        assert not graphs.enabled  # the Python attention path: nothing captured
        return
    assert graphs.enabled and graphs.captures >= 1 and graphs.replays > 20


def test_seeded_sampling_draws_alike(model_dir):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=30, ignore_eos=True)
    eager, _ = generate(model_dir, True, params)
    replayed, engine = generate(model_dir, False, params)
    assert replayed == eager and engine.runner.graphs.replays > 0


def test_a_batch_size_is_captured_once_it_has_held(model_dir):
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", num_kv_blocks=128))
    for p in prompts(3):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    graphs = engine.runner.graphs
    engine.step()  # the three prompts: not a decode step
    counts = []
    for _ in range(STEPS + 2):
        engine.step()
        counts.append((graphs.captures, graphs.replays))
    assert counts[: STEPS - 1] == [(0, 0)] * (STEPS - 1)  # eager while the size has not held
    assert counts[STEPS - 1 :] == [(1, 0), (1, 1), (1, 2)]  # captured after the STEPS-th, then replayed
    engine.abort(list(engine.requests))


def test_a_replay_that_differs_turns_graphs_off(model_dir, monkeypatch, caplog):
    """The check at capture: a graph whose replay is not the eager forward's result is never used."""
    real = decode_graph.make_fx

    def skewed(forward):
        def trace():
            module = real(forward)()
            replay = module.forward
            module.forward = lambda: replay() + 1
            return module

        return trace

    eager, _ = generate(model_dir, True, GREEDY)
    monkeypatch.setattr(decode_graph, "make_fx", skewed)
    with caplog.at_level("WARNING", logger="infer.runner"):
        replayed, engine = generate(model_dir, False, GREEDY)
    assert replayed == eager
    graphs = engine.runner.graphs
    assert not graphs.enabled and graphs.replays == 0 and not graphs.graphs
    assert any("replay differs" in r.getMessage() for r in caplog.records)


def test_onednn_linears_replay_in_torchscript(model_dir, monkeypatch):
    """A weight the small-batch kernel cannot take (a build without it; a size it cannot tile) runs on
    oneDNN in decode steps: its call must be one TorchScript can record (torch's own takes a Scalar?[]
    its tracer rejects)."""
    if not linear.can_prepack(torch.bfloat16):
        pytest.skip("oneDNN has no bf16 here")
    monkeypatch.setattr(kernels, "bf16_ops", lambda: None)  # every linear on oneDNN
    replayed, engine = generate(model_dir, False, GREEDY)
    graphs = engine.runner.graphs
    assert graphs.enabled and graphs.interpret and graphs.replays > 20
    assert all(isinstance(g.module, torch.jit.ScriptModule) for g in graphs.graphs.values())
    assert engine.runner.model.lm_head.packed_weight is not None
    assert replayed == generate(model_dir, True, GREEDY)[0]


def test_graphs_replay_in_python_where_torchscript_fails(model_dir, monkeypatch, caplog):
    """TorchScript is deprecated: a torch that cannot script the graph replays it as the FX module."""

    def fails(*args, **kwargs):
        raise RuntimeError("no TorchScript")

    monkeypatch.setattr(torch.jit, "trace", fails)
    with caplog.at_level("WARNING", logger="infer.runner"):
        replayed, engine = generate(model_dir, False, GREEDY)
    graphs = engine.runner.graphs
    assert graphs.enabled and graphs.replays > 20 and not graphs.interpret
    assert all(isinstance(g.module, torch.fx.GraphModule) for g in graphs.graphs.values())
    assert [r.getMessage() for r in caplog.records if "TorchScript" in r.getMessage()] == [
        "decode graphs replay in Python: TorchScript failed: RuntimeError: no TorchScript"
    ]
    assert replayed == generate(model_dir, True, GREEDY)[0]


@pytest.mark.slow
def test_enforce_eager_and_other_ranks_keep_no_graphs(model_dir):
    assert LLMEngine(EngineConfig(model=model_dir, enforce_eager=True)).runner.graphs is None
    assert LLMEngine(EngineConfig(model=model_dir, use_kv_cache=False)).runner.graphs is None


@pytest.mark.slow
def test_warm_up_captures_every_batch_size_before_any_request(model_dir):
    """What the server does before it reports ready: sizes 1..max_num_seqs captured on made-up steps,
    none left to capture under load, and the load's tokens still the eager ones."""
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", num_kv_blocks=128, max_num_seqs=6))
    engine.warm_up()
    graphs = engine.runner.graphs
    assert sorted(graphs.graphs) == [1, 2, 3, 4, 5, 6] and graphs.enabled
    assert all(isinstance(g.module, torch.jit.ScriptModule) for g in graphs.graphs.values())
    outputs = {engine.add_request(p, GREEDY).req_id: [] for p in prompts()}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.req_id].extend(out.token_ids)
    assert graphs.captures == 6 and graphs.replays > 20
    eager, _ = generate(model_dir, True, GREEDY, max_num_seqs=6)
    assert list(outputs.values()) == [tokens for tokens, _ in eager]
    assert engine.scheduler.kv_cache_manager.num_used_blocks == 0


def test_a_captured_graph_is_already_optimized_before_its_first_step(model_dir):
    """TorchScript's executor profiles a graph's first run and optimizes it on the second (~50 ms on a
    135M model, five times a replay): the capture does both, so the first step of a size under load
    does not pay it. Its optimized plan exists only after the second run (get_debug_state raises
    before)."""
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", num_kv_blocks=128, max_num_seqs=3))
    engine.warm_up()
    graphs = engine.runner.graphs.graphs
    assert sorted(graphs) == [1, 2, 3]
    assert all(g.module.get_debug_state().execution_plans for g in graphs.values())


def test_warm_up_stops_at_its_time_budget_and_a_load_never_stalls_on_a_capture(model_dir, monkeypatch):
    """A model whose captures take long captures what fits in WARM_UP_SECONDS; the sizes past it run
    eagerly under load (a capture would stall every stream of its step), with the same tokens."""
    monkeypatch.setattr(decode_graph, "WARM_UP_SECONDS", 0)
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", num_kv_blocks=128, max_num_seqs=6))
    engine.warm_up()
    graphs = engine.runner.graphs
    assert sorted(graphs.graphs) == [1] and graphs.enabled
    outputs = {engine.add_request(p, GREEDY).req_id: [] for p in prompts()}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.req_id].extend(out.token_ids)
    assert sorted(graphs.graphs) == [1] and graphs.captures == 1  # size 6 held, and ran eagerly
    assert list(outputs.values()) == [tokens for tokens, _ in generate(model_dir, True, GREEDY)[0]]


def test_one_fake_mode_for_the_capture_records_the_same_graph(model_dir, monkeypatch):
    """_one_fake_mode only speeds make_fx's metadata up: without it (another torch's internals) the
    captured graph is the same."""
    codes = []
    for context in (decode_graph._one_fake_mode, contextlib.nullcontext):
        monkeypatch.setattr(decode_graph, "_one_fake_mode", context)
        engine = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", num_kv_blocks=128, max_num_seqs=2))
        engine.warm_up()
        codes.append([engine.runner.graphs.graphs[n].module.code for n in (1, 2)])
    assert codes[0] == codes[1] and "paged_attention" in codes[0][1]


def test_graphs_that_do_not_pay_go_off_after_the_first_capture(model_dir, monkeypatch, caplog):
    monkeypatch.setattr(decode_graph, "MIN_GAIN", 0.0)  # no replay is faster than nothing
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", num_kv_blocks=128, max_num_seqs=6))
    with caplog.at_level("INFO", logger="infer.runner"):
        engine.warm_up()
    graphs = engine.runner.graphs
    assert not graphs.enabled and not graphs.graphs and graphs.pays is False
    assert any("not worth capturing" in r.getMessage() for r in caplog.records)
    eager, _ = generate(model_dir, True, GREEDY)
    replayed, engine = generate(model_dir, False, GREEDY)
    assert replayed == eager and engine.runner.graphs.replays == 0


def test_graphs_stay_within_their_bounds(model_dir, monkeypatch):
    """At most MAX_GRAPHS, and block tables within TABLES_MAX_BYTES: a size past either stays eager."""
    monkeypatch.setattr(decode_graph, "MAX_GRAPHS", 3)
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", num_kv_blocks=128, max_num_seqs=6))
    engine.warm_up()
    assert sorted(engine.runner.graphs.graphs) == [1, 2, 3]
    monkeypatch.setattr(decode_graph, "MAX_GRAPHS", 64)
    graphs = engine.runner.graphs
    per_row = graphs.max_blocks * 8
    monkeypatch.setattr(decode_graph, "TABLES_MAX_BYTES", (6 + 4) * per_row)  # [1, 2, 3] hold 6 rows
    engine.warm_up()
    assert sorted(graphs.graphs) == [1, 2, 3, 4] and graphs.enabled


class _Clock:
    """time.perf_counter for _check_pays: each eager forward and each replay (the untimed first one
    too) advances it by its next duration."""

    def __init__(self, eager: list[float], replay: list[float]):
        self.now, self.eager, self.replay = 0.0, iter(eager), iter(replay)

    def perf_counter(self) -> float:
        return self.now

    def forward(self):
        self.now += next(self.eager)

    def module(self):
        self.now += next(self.replay)


@pytest.mark.parametrize(
    ("eager", "replay", "pays"),
    [
        # the first replay (TorchScript profiles it: 50) is not timed, and one eager forward in a quiet
        # moment (1 against the usual 10) does not turn graphs off
        ([1.0] + [10.0] * 8, [50.0] + [7.0] * 9, True),
        # nor a replay slowed by a burst of other work, now and then
        ([10.0] * 9, [50.0, 7.0, 30.0, 7.0, 30.0, 7.0, 7.0, 30.0, 7.0, 7.0], True),
        # nor replays mostly slowed, where the fastest of them shows the gain
        ([10.0] * 9, [50.0, 5.0, 12.0, 12.0, 12.0, 12.0, 5.0, 12.0, 12.0, 12.0], True),
        # a replay that saves nothing does
        ([10.0] * 9, [50.0, 9.9, 9.7, 10.2, 9.8, 9.9, 10.1, 9.6, 9.9, 10.0], False),
    ],
)
def test_whether_graphs_pay_is_decided_on_pairs_of_timings(monkeypatch, eager, replay, pays):
    monkeypatch.setattr(decode_graph, "MIN_GAIN", 0.95)
    clock = _Clock(eager, replay)
    monkeypatch.setattr(decode_graph.time, "perf_counter", clock.perf_counter)
    graphs = decode_graph.DecodeGraphs(None, [], 16, 1, torch.bfloat16)
    assert graphs._check_pays(clock.forward, clock.module) is pays
    assert graphs.enabled is pays


# n-gram proposals from single tokens on: the random prompts repeat some, so most steps verify
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_gain": False,  # every step speculates
}
SPEC_ALWAYS = {**SPEC, "disable_by_batch_size": 64}  # the six prompts speculate together
PROPOSED = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)  # no logprobs: they get proposals


def test_verification_steps_replay_and_keep_the_eager_tokens(model_dir, row_invariant_linears):
    """Steps that verify proposals replay graphs keyed by (batch size, 1 + K), padded where a request
    has fewer than K proposals, and every token is the one without speculation."""
    config = {"max_num_seqs": 6, "speculative_config": SPEC_ALWAYS}
    eager, _ = generate(model_dir, True, PROPOSED, **config)
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", num_kv_blocks=128, **config))
    engine.warm_up()
    graphs = engine.runner.graphs
    assert sorted(graphs.verify_graphs) == [1, 2, 3, 4, 5, 6]
    outputs = {engine.add_request(p, PROPOSED).req_id: [] for p in prompts()}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.req_id].extend(out.token_ids)
    plain = [ids for ids, _ in generate(model_dir, True, PROPOSED)[0]]
    assert list(outputs.values()) == [ids for ids, _ in eager] == plain
    assert graphs.verify_enabled and graphs.verify_replays > 3 and graphs.captures == 12
    assert engine.scheduler.num_spec_draft_tokens > 0
    assert engine.scheduler.kv_cache_manager.num_used_blocks == 0


def test_a_verification_replay_gives_the_eager_logits(model_dir):
    """Each replayed verification step run again eagerly: bit for bit the same logits, whether every
    request has K proposals or some are padded."""
    config = {"max_num_seqs": 6, "speculative_config": SPEC}
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", num_kv_blocks=128, **config))
    engine.warm_up()
    runner, graphs = engine.runner, engine.runner.graphs
    assert sorted(graphs.verify_graphs) == [1, 2, 3, 4]  # up to disable_by_batch_size
    same = rerun_replays_eagerly(runner, "verify_replays")
    for p in prompts(3):
        engine.add_request(p, PROPOSED)
    while engine.has_unfinished():
        engine.step()
    assert len(same) > 5 and all(same)


def test_a_verification_capture_that_fails_leaves_decode_graphs_on(
    model_dir, monkeypatch, caplog, row_invariant_linears
):
    real = decode_graph.AttentionMetadata.static_verify

    def no_kernel(*args, **kwargs):
        meta = real(*args, **kwargs)
        meta._prefill_args = None  # the kernel's arguments built from the step's values: not replayable
        return meta

    monkeypatch.setattr(decode_graph.AttentionMetadata, "static_verify", no_kernel)
    # SDPA for verifications (queries of 1 + K tokens, no decode in the step)
    monkeypatch.setattr(attention_kernels, "prefill_kernel_for", lambda *args, **kwargs: None)
    monkeypatch.setattr(attention_kernels, "decode_kernel_for", lambda *args, **kwargs: None)
    config = {"max_num_seqs": 6, "speculative_config": SPEC_ALWAYS}
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", num_kv_blocks=128, **config))
    with caplog.at_level("WARNING", logger="infer.runner"):
        engine.warm_up()
    graphs = engine.runner.graphs
    assert not graphs.verify_enabled and not graphs.verify_graphs
    assert graphs.enabled and sorted(graphs.graphs) == [1, 2, 3, 4, 5, 6]
    assert [r.getMessage() for r in caplog.records] == [
        "verification graphs off for this engine: the step does not run the C++ prefill_attention"
    ]
    outputs = {engine.add_request(p, PROPOSED).req_id: [] for p in prompts()}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.req_id].extend(out.token_ids)
    assert graphs.verify_replays == 0 and engine.scheduler.num_spec_draft_tokens > 0
    assert list(outputs.values()) == [ids for ids, _ in generate(model_dir, True, PROPOSED)[0]]


def test_steps_with_short_chunks_beside_decodes_replay_and_give_the_eager_logits(model_dir):
    """Short prompts arriving while others decode: their step replays the graph of its
    token count (a row per token, the decode kernel's batched call), and the same step run again eagerly
    gives the same logits bit for bit."""
    config = EngineConfig(model=model_dir, dtype="bfloat16", num_kv_blocks=128, max_num_seqs=34)
    engine = LLMEngine(config)
    engine.warm_up()  # graphs of up to 34 rows: a decode beside a 31-token prompt and a short one
    same = rerun_replays_eagerly(engine.runner, which=lambda sched: any(s.num_tokens > 1 for s in sched))
    gen = torch.Generator().manual_seed(2)
    engine.add_request(prompts(1)[0], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    for step in range(60):
        if step % 3 == 1:
            length = (1, 3, 7, 12, 31)[step // 3 % 5]  # 12 and 31: tiny attention, riding too
            prompt = torch.randint(2, 256, (length,), generator=gen).tolist()
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        engine.step()
    assert len(same) > 10 and all(same)


def test_a_step_of_a_size_not_captured_replays_a_larger_graph_padded(model_dir, monkeypatch):
    """Sizes the warm-up did not capture replay the next larger graph, the extra rows padding: every
    such step gives the logits of the same step run eagerly, bit for bit, and the streams' tokens are
    the eager forward's."""
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", num_kv_blocks=128, max_num_seqs=6))
    graphs, padded = engine.runner.graphs, []
    graphs.warm_up([1, 2, 4, 8])  # 3, 5, 6, 7 rows: padded to 4 and 8

    def not_captured(sched) -> bool:
        rows = sum(s.num_tokens for s in sched)
        padded.extend([rows] if rows not in graphs.graphs else [])
        return rows not in graphs.graphs

    same = rerun_replays_eagerly(engine.runner, which=not_captured)
    replayed = run_staggered(engine)
    assert {3, 5, 6} <= set(padded) and all(same) and sorted(graphs.graphs) == [1, 2, 4, 8]
    eager = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", num_kv_blocks=128, enforce_eager=True))
    assert replayed == run_staggered(eager)


def rerun_replays_eagerly(runner, counter: str = "replays", which=lambda scheduled: True) -> list[bool]:
    """From now on, each step that replays a graph (`counter` grows) and that `which` selects (given its
    scheduled requests) runs again eagerly, the same keys into the same slots; the list it returns
    gets, per such step, whether the logits and their requests were the same."""
    forward, graphs, same = runner.logits, runner.graphs, []

    def replayed_then_eager(sched):
        before = getattr(graphs, counter)
        logits, reqs = forward(sched)
        if getattr(graphs, counter) > before and which(sched.scheduled):
            graphs.enabled = False
            eager, eager_reqs = forward(sched)
            graphs.enabled = True
            same.append(torch.equal(logits, eager) and reqs == eager_reqs)
        return logits, reqs

    runner.logits = replayed_then_eager
    return same


def run_staggered(engine) -> list[list[int]]:
    """The six prompts, greedy, 10 to 60 tokens each: batches of 6 down to 1 sequence."""
    params = [SamplingParams(temperature=0, max_tokens=10 * (i + 1), ignore_eos=True) for i in range(6)]
    outputs = {engine.add_request(p, sp).req_id: [] for p, sp in zip(prompts(), params, strict=True)}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.req_id].extend(out.token_ids)
    return list(outputs.values())


def test_the_warm_up_captures_a_ladder_of_sizes_first(model_dir, monkeypatch):
    """Every size up to EXACT_SIZES, then every PAD_STEP-th and the largest, then the rest: a warm-up out
    of time leaves the sizes between the ladder's to padding."""
    monkeypatch.setattr(decode_graph, "EXACT_SIZES", 2)
    monkeypatch.setattr(decode_graph, "PAD_STEP", 4)
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", num_kv_blocks=128, max_num_seqs=10))
    graphs, captured = engine.runner.graphs, []
    capture = graphs._capture
    monkeypatch.setattr(graphs, "_capture", lambda reqs, width, logits=None: (
        captured.append(len(reqs)), capture(reqs, width, logits)))  # fmt: skip
    graphs.warm_up(range(1, 11))
    assert captured == [1, 2, 4, 8, 10, 3, 5, 6, 7, 9]
