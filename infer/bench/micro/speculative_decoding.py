"""Speculative decoding: plain decoding vs proposals (`--speculative-config`), side by side.

    plain         no speculation
    ngram         by default {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                  "prompt_lookup_max": 4}, or the micro command's --speculative-config (named by its
                  method: `draft_model` for {"model": PATH, ...}): speculates while at most
                  disable_by_batch_size requests run (default 4), so 8 and 32 streams decode plainly,
                  and below that where the engine measured that it pays (disable_by_gain)
    ngram_gain    the same without the cap (streams > 1 only): speculating at any batch size where
                  the gate measures that it pays
    ngram_always  the same, speculating in every step whatever the batch and the gain: what
                  speculation costs or gains there

Workloads, each at 1, 8 and 32 concurrent streams (greedy, ignore_eos, every stream its own prompt):

    repeat_text   six verses of Genesis as prose, then the first verse again, cut after half its words:
                  the continuation quotes the passage, as an edit or a summary repeats its text
    code          Python with repeated structure (one method per field): a model trained on code
                  repeats it; the embedded model (trained on the King James Bible) does not know code
    free_text     the first half of a verse alone: nothing earlier to look up, the proposals rarely hit

Reported per case: decode tokens per second of one stream (after its first token), the speed-up over
plain, the acceptance rate per proposal position (accepted at position j / verifications), and with a
draft model the milliseconds per engine step and the draft's share of them.
Expectation: on the embedded model, repeat_text accepts and one stream decodes faster; free_text does
not lose more than the proposals' extra tokens cost; 8 and 32 streams are no slower than plain.

With --oracle [KS], instead: what a verification step costs and what speculation buys at a chosen
acceptance, on any model (random weights too, which accept nothing). Per K in 1..4 (or KS) one engine
proposes the target's own greedy continuation (OracleProposer, taken from a plain run on that engine
first), right at each position with probability a until the first wrong proposal, for a in 0, 0.5, 0.8,
1.0, alternated with plain decoding on the same engine, speculating whatever the batch (repeat_text's
prompts, --streams). Reported: decode speed-up over plain per (K, a), and whether every stream's greedy
output was plain's. At a = 0 and 0.8 also `gated`: the engine's SpeculationGate deciding per step, its
measurements kept from one repeat to the next as a server's are, and the share of its decisions that
speculated: where verifying loses it turns itself off, where it pays it stays on.
"""

from __future__ import annotations

import json

from infer.bench.micro.harness import Context, RequestSpec, compare, drive, mean, num_blocks_for, ratio
from infer.bench.micro.oracle_proposer import OracleProposer
from infer.bench.micro.report import BenchResult, CaseResult, Verdict, mode_table, render_table
from infer.bench.prompts import CORPUS
from infer.core.speculation_gate import SpeculationGate

NAME = "speculative-decoding"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
STREAMS = (1, 8, 32)
SMALL_STREAMS = (1, 8)
WORKLOADS = ("repeat_text", "code", "free_text")
ORACLE_ACCEPTANCES = (0.0, 0.5, 0.8, 1.0)
ORACLE_GATED = (0.0, 0.8)  # acceptances also run with the gate deciding: one where it loses, one in between
ORACLE_SAME = ("streams = plain", "same_as_plain", "")
MAX_TOKENS, SMALL_MAX_TOKENS = 128, 24
PASSAGE_LINES = 6
COLUMNS = [
    ("tokens", "gen_tok", ""),
    ("steps", "steps", ""),
    ("decode tok/s/stream", "decode_tok_s", ".2f"),
    ("wall_s", "wall_s", ".3f"),
    ("accepted/drafted", "acceptance", "%"),
    ("ms/step", "step_ms", ".2f"),
    ("draft ms/step", "draft_step_ms", ".2f"),
]
CODE_FIELDS = ("name", "email", "address", "phone", "city", "country", "company", "title", "notes")


def passages(num: int, lines: int) -> list[str]:
    """num passages of Genesis, `lines` verses each, from different places of the book."""
    verses = [v for v in CORPUS.read_text().splitlines() if v.strip()]
    stride = max(1, (len(verses) - lines) // max(num, 1))
    return ["\n".join(verses[i * stride : i * stride + lines]) for i in range(num)]


def code_prompt(i: int) -> str:
    fields = CODE_FIELDS[i % 3 :] + CODE_FIELDS[: i % 3]
    methods = "".join(
        f"    def get_{f}(self):\n        return self._{f}\n\n    def set_{f}(self, value):\n"
        f"        self._{f} = value\n\n"
        for f in fields[:4]
    )
    head = f"class Record{i}:\n    def __init__(self):\n        pass\n\n"
    return f"{head}{methods}    def get_{fields[4]}(self):\n"


def prompts(workload: str, num: int) -> list[str]:
    if workload == "code":
        return [code_prompt(i) for i in range(num)]
    texts = passages(num, PASSAGE_LINES)
    if workload == "repeat_text":  # the passage, then its first verse again, cut after half its words
        return [f"{' '.join(t.splitlines())} {half(t.splitlines()[0])}" for t in texts]
    return [half(t.splitlines()[0]) for t in texts]


def half(verse: str) -> str:
    words = verse.split()
    return " ".join(words[: max(1, len(words) // 2)])


def workload_specs(
    ctx: Context, workload: str, tokenizer, streams: int, max_tokens: int
) -> list[RequestSpec]:
    """The prompts' tokens, their last ones where the context is short (the repeat is at the end); ids
    beyond a model's vocabulary wrap (the toy reads the embedded model's tokenizer: a smoke test only)."""
    budget = ctx.max_model_len - max_tokens - 1
    specs = []
    for p in prompts(workload, streams):
        ids = [t % ctx.vocab_size for t in tokenizer.encode(p)][-budget:]
        specs.append(RequestSpec(tuple(ids), max_tokens))
    return specs


def run_mode(ctx: Context, specs: list[RequestSpec], spec_config: dict | None):
    """Runs of the workload on one engine per mode, kept between repeats: its decode graphs (the
    target's and the draft's) are captured in the first run, as a server's warm-up would, and the best
    of the repeats is a steady engine's. No prefix caching, so that every run computes the same."""
    engine = None

    def once():
        nonlocal engine
        if engine is None:
            engine = ctx.engine(
                num_kv_blocks=num_blocks_for(specs, 16) + len(specs),
                max_num_seqs=max(len(specs), 1),
                speculative_config=spec_config,
                enable_prefix_caching=False,
            )
        scheduler, proposer = engine.scheduler, engine.proposer
        before = spec_counts(scheduler) + (getattr(proposer, "propose_s", 0.0),)
        run = drive(engine, specs)
        after = spec_counts(scheduler) + (getattr(proposer, "propose_s", 0.0),)
        run.extra = {
            **spec_figures(run, before, after, len(after[3])),
            "draft_step_ms": 1e3 * (after[4] - before[4]) / max(len(run.stats), 1),
        }
        return run

    return once


def spec_counts(scheduler) -> tuple:
    """The scheduler's speculation counters so far: drafts, draft tokens, accepted, accepted per position."""
    return (
        scheduler.num_spec_drafts,
        scheduler.num_spec_draft_tokens,
        scheduler.num_spec_accepted_tokens,
        tuple(scheduler.num_spec_accepted_per_pos),
    )


def decode_rate(requests) -> float:
    """Tokens per second of one stream after its first token, averaged over the streams."""
    rates = [
        (r.num_output_tokens - 1) / (r.finished_time - r.first_token_time)
        for r in requests
        if r.num_output_tokens > 1 and r.finished_time > r.first_token_time
    ]
    return mean(rates)


def method_of(spec_config: dict) -> str:
    """The config's method as SpeculativeConfig reads it: draft_model when a model is given, else ngram."""
    return spec_config.get("method") or ("draft_model" if spec_config.get("model") else "ngram")


def run_case(
    ctx: Context, tokenizer, workload: str, streams: int, max_tokens: int, spec_config: dict
) -> CaseResult:
    specs = workload_specs(ctx, workload, tokenizer, streams, max_tokens)
    method = method_of(spec_config)
    modes = {"plain": run_mode(ctx, specs, None), method: run_mode(ctx, specs, spec_config)}
    uncapped = {**spec_config, "disable_by_batch_size": 1024}
    if streams > 1:
        modes[f"{method}_gain"] = run_mode(ctx, specs, uncapped)
    modes[f"{method}_always"] = run_mode(ctx, specs, {**uncapped, "disable_by_gain": False})
    # the gate's choices follow the step times
    best, _ = compare(ctx, modes, varying=(method, f"{method}_gain"))
    plain = best["plain"]["decode_tok_s"]
    ratios = {
        f"{mode}_speedup": ratio(m["decode_tok_s"], plain) for mode, m in best.items() if mode != "plain"
    }
    name = f"{workload}@{streams}"
    ctx.print(f"\n=== {name} ===")
    ctx.print(mode_table(best, COLUMNS))
    per_pos = best[f"{method}_always"]["per_pos"]
    ctx.print(f"acceptance per position ({method}_always): {per_pos}")
    knobs = {"workload": workload, "streams": streams, "max_tokens": max_tokens, "method": method}
    return CaseResult(name, knobs, best, ratios)


def summary_rows(cases: list[CaseResult]) -> list[list[str]]:
    rows = []
    for c in cases:
        method = c.knobs["method"]
        spec = c.modes[f"{method}_always"]
        gain, always = c.ratios.get(f"{method}_gain_speedup"), c.ratios.get(f"{method}_always_speedup")
        rows.append(
            [
                c.knobs["workload"],
                str(c.knobs["streams"]),
                f"{c.modes['plain']['decode_tok_s']:.2f}",
                f"{c.ratios[f'{method}_speedup']:.2f}x",
                "-" if gain is None else f"{gain:.2f}x",
                "-" if always is None else f"{always:.2f}x",
                f"{100 * spec['acceptance']:.1f}%",
                spec["per_pos"],
            ]
        )
    return rows


def headers(method: str) -> list[str]:
    gain, always = f"{method}_gain", f"{method}_always"
    return ["workload", "streams", "plain tok/s/stream", method, gain, always, "accepted", "per position"]


def verdicts(cases: list[CaseResult]) -> list[Verdict]:
    """One per case: one stream of repeat_text decodes faster; the other single streams lose at most
    what the proposals' extra tokens cost (0.8x); 8 and 32 streams, where the proposals are off by
    default, are as fast as plain (0.95x: noise)."""
    out = []
    for c in cases:
        method, streams, workload = c.knobs["method"], c.knobs["streams"], c.knobs["workload"]
        s = c.ratios[f"{method}_speedup"]
        target = 1.0 if streams == 1 and workload == "repeat_text" else 0.8 if streams == 1 else 0.95
        passed = s > target if target == 1.0 else s >= target
        sign = ">" if target == 1.0 else ">="
        out.append(
            Verdict(c.name, passed, f"{method} {s:.2f}x plain's decode speed (target {sign} {target:.2f}x)")
        )
    return out


def oracle_engine(ctx: Context, specs: list[RequestSpec], k: int):
    """An engine that verifies K proposals whatever the batch, its proposer an OracleProposer that has
    learned the target's greedy continuation of every prompt from a plain run on this engine (which
    also captures its decode graph; the verification graph is captured here too)."""
    config = {
        "method": "ngram",
        "num_speculative_tokens": k,
        "disable_by_batch_size": 1024,
        "disable_by_gain": False,
    }
    engine = ctx.engine(
        num_kv_blocks=num_blocks_for(specs, 16) + len(specs),
        max_num_seqs=len(specs),
        speculative_config=config,
        enable_prefix_caching=False,
    )
    oracle = OracleProposer(k, engine.model_config.vocab_size, acceptance=None)
    engine.proposer = oracle  # the bench's own proposer, in place of the n-gram lookup
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is not None:
        graphs.warm_up([len(specs)], [len(specs)])
    for spec, req in zip(specs, drive(engine, specs).requests, strict=True):
        oracle.learn(spec.prompt_ids, req.output_token_ids)
    return engine, oracle


def oracle_mode(
    engine, oracle: OracleProposer, specs: list[RequestSpec], acceptance: float | None, gated: bool = False
):
    """A run of the workload with the oracle at this acceptance (None: plain decoding), its counts;
    gated: the mode's own SpeculationGate decides each step, kept from run to run as a server keeps its
    measurements (else every step speculates)."""

    learned = [oracle.continuation(s.prompt_ids)[1] for s in specs]
    gate = SpeculationGate(len(specs), by_gain=gated)
    decide = gate.speculate
    decisions = [0, 0]  # a run's [plain, speculated]

    def counted(running: int, decoding: int) -> bool:
        verdict = decide(running, decoding)
        decisions[verdict] += 1
        return verdict

    gate.speculate = counted

    def once():
        oracle.acceptance = acceptance
        engine.speculation_gate = gate
        decisions[:] = [0, 0]
        before = spec_counts(engine.scheduler)
        run = drive(engine, specs)
        after = spec_counts(engine.scheduler)
        proposing = acceptance is not None and any(decisions)  # plain: nothing proposed, whatever the gate
        run.extra = {
            # every position of the K, counted or not yet (the engine's list grows with the first accept)
            **spec_figures(run, before, after, oracle.k),
            "same_as_plain": sum(r.output_token_ids == t for r, t in zip(run.requests, learned, strict=True)),
            "speculated": ratio(decisions[1], sum(decisions)) if proposing else 0.0,
        }
        return run

    return once


def spec_figures(run, before: tuple, after: tuple, positions: int) -> dict:
    """A run's speculation figures from the scheduler's counters before and after it (spec_counts), the
    acceptance at each of the first `positions` positions among them."""
    drafts, drafted, accepted = (a - b for a, b in zip(after[:3], before[:3], strict=True))
    per_pos = [at(after[3], j) - at(before[3], j) for j in range(positions)]
    return {
        "drafts": drafts,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": ratio(accepted, drafted) if drafted else 0.0,
        "per_pos": ", ".join(f"{a / max(drafts, 1):.2f}" for a in per_pos) or "-",
        "decode_tok_s": decode_rate(run.requests),
        "step_ms": 1e3 * run.wall_s / max(len(run.stats), 1),
    }


def at(counts: tuple, j: int) -> int:
    return counts[j] if j < len(counts) else 0


def graphs_state(engine) -> str:
    """Whether the engine replays decode and verification steps from graphs: each pays or not by a
    timing taken at its capture, so a loaded machine may turn either off."""
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is None:
        return "eager"
    on = {True: "replayed", False: "eager"}
    return f"decode {on[graphs.enabled]}, verification {on[graphs.enabled and graphs.verify_enabled]}"


def acceptance_name(a: float | None) -> str:
    return "plain" if a is None else f"a={a:g}"


def gated_name(a: float) -> str:
    return f"{acceptance_name(a)} gated"


def run_oracle_case(ctx: Context, specs: list[RequestSpec], k: int, acceptances) -> CaseResult:
    engine, oracle = oracle_engine(ctx, specs, k)
    modes = {acceptance_name(a): oracle_mode(engine, oracle, specs, a) for a in (None, *acceptances)}
    for a in ORACLE_GATED:
        modes[gated_name(a)] = oracle_mode(engine, oracle, specs, a, gated=True)
    # the gate's choices follow the step times
    best, _ = compare(ctx, modes, varying=[gated_name(a) for a in ORACLE_GATED])
    plain = best["plain"]["decode_tok_s"]
    ratios = {f"{m}_speedup": ratio(v["decode_tok_s"], plain) for m, v in best.items() if m != "plain"}
    name = f"oracle_k{k}@{len(specs)}"
    graphs = graphs_state(engine)
    ctx.print(f"\n=== {name} ({graphs}) ===")
    columns = [*COLUMNS[:5], ("per position", "per_pos", "s"), ("speculated", "speculated", "%"), ORACLE_SAME]
    ctx.print(mode_table(best, columns))
    knobs = {"workload": "repeat_text", "streams": len(specs), "max_tokens": specs[0].max_tokens, "k": k}
    knobs["graphs"] = graphs
    return CaseResult(name, knobs, best, ratios)


def oracle_verdicts(cases: list[CaseResult]) -> list[Verdict]:
    """One per case: every stream's greedy output is the plain run's at every acceptance (the oracle
    only chooses what is proposed, never what is emitted)."""
    out = []
    for c in cases:
        streams = c.knobs["streams"]
        same = min(m["same_as_plain"] for m in c.modes.values())
        detail = f"{same}/{streams} streams' greedy output equal to plain decoding's at every acceptance"
        out.append(Verdict(c.name, same == streams, detail))
    return out


def run_oracle(ctx: Context, tokenizer, streams_list, max_tokens: int) -> BenchResult:
    ctx.print("\n##### Speculative decoding: plain vs proposals of a chosen acceptance (oracle) #####")
    cases = []
    for streams in streams_list:
        specs = workload_specs(ctx, "repeat_text", tokenizer, streams, max_tokens)
        for k in ctx.oracle:
            cases.append(run_oracle_case(ctx, specs, k, ORACLE_ACCEPTANCES))
    ctx.print("\n=== Speculative decoding with the oracle: decode speed-up over plain, per acceptance ===")
    names = [acceptance_name(a) for a in ORACLE_ACCEPTANCES] + [gated_name(a) for a in ORACLE_GATED]
    rows = [
        [str(c.knobs["streams"]), str(c.knobs["k"]), f"{c.modes['plain']['decode_tok_s']:.2f}"]
        + [f"{c.ratios[f'{name}_speedup']:.2f}x" for name in names]
        for c in cases
    ]
    ctx.print(render_table(["streams", "K", "plain tok/s/stream", *names], rows))
    return BenchResult(NAME, cases, oracle_verdicts(cases), {})


def run(ctx: Context) -> BenchResult:
    small = ctx.scale == "small"
    tokenizer = ctx.engine(num_kv_blocks=16).tokenizer
    max_tokens = SMALL_MAX_TOKENS if small else MAX_TOKENS
    streams_list = ctx.streams or (SMALL_STREAMS if small else STREAMS)
    if ctx.oracle:
        return run_oracle(ctx, tokenizer, streams_list, max_tokens)
    spec_config = ctx.speculative_config or NGRAM
    method = method_of(spec_config)
    ctx.print(f"\n##### Speculative decoding: plain vs {method} ({json.dumps(spec_config)}) #####")
    cases = [
        run_case(ctx, tokenizer, workload, streams, max_tokens, spec_config)
        for streams in streams_list
        for workload in WORKLOADS
    ]
    ctx.print("\n=== Speculative decoding summary (decode speed-up over plain; acceptance) ===")
    ctx.print(render_table(headers(method), summary_rows(cases)))
    return BenchResult(NAME, cases, verdicts(cases), {})
