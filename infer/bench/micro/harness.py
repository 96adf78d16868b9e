"""What every micro-benchmark shares: the model, fresh engines, workloads driven step by step, the
metrics of one run, and best-of-N interleaved repeats.

A workload is a list of RequestSpec that `drive` feeds to a fresh LLMEngine in one of two ways:

    arrivals  spec.arrival_step = k: added just before engine step k (the reference's scheduler steps);
              an idle engine jumps to the next arrival instead of running empty steps
    serial    each request is added when the previous one has finished (the reference's one-at-a-time loops)

All timestamps are the engine's own (`Request.arrival_time`, `first_token_time`, `token_times`,
`finished_time`, time.monotonic): TTFT = first token - arrival, latency = finished - arrival, and the
inter-token gaps are the differences of one request's token times. Sampling is greedy with ignore_eos,
so every run of a workload generates exactly sum(max_tokens) tokens and repeats are identical in counts.
"""

from __future__ import annotations

import gc
import hashlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from infer.bench.micro import TOY
from infer.config import EngineConfig
from infer.core.outputs import StepStats
from infer.core.request import Request
from infer.engine.llm_engine import LLMEngine, StepTiming
from infer.sampling_params import SamplingParams

TOY_TRAIN_SECONDS = 5.0
PROMPT_SEED = 1337  # the reference's workload seed


def toy_dir() -> Path:
    """Where the trained toy is kept between runs ($XDG_CACHE_HOME/infer/micro-toy)."""
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "infer" / "micro-toy"


def prepare_model(
    model: str, dtype: str, threads: int | None = None, retrain: bool = False
) -> tuple[str, str, int]:
    """Resolve --model, --dtype and --threads. "toy" trains the reference's NanoGPT once (a few seconds) into
    toy_dir(); its "auto" settings are the fastest measured (docs/engine.md, "Micro-benchmarks"):
    float32, since at 0.057M parameters bf16 only adds conversions, and one thread, since its
    32-wide matrices leave nothing to split and every parallel region must wake the second thread.

    Other models keep the engine's dtype and torch's thread count unless told otherwise.
    """
    if model == TOY:
        from infer.models.toy import build_toy

        path = toy_dir()
        if retrain or not (path / "config.json").is_file():
            build_toy(path, train_seconds=TOY_TRAIN_SECONDS)
        model, dtype, threads = str(path), "float32" if dtype == "auto" else dtype, threads or 1
    torch.set_num_threads(threads or torch.get_num_threads())
    return model, dtype, torch.get_num_threads()


MAX_SETTING_CHARS = 160  # of an engine configuration in a trace's file name (a name holds 255 bytes)


@dataclass(frozen=True)
class RequestSpec:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    arrival_step: int = 0
    priority: int = 0  # lower is more urgent; the reference's "high priority" is priority 0
    group: str = ""


def random_prompts(gen: torch.Generator, num: int, length: int, vocab_size: int) -> list[tuple[int, ...]]:
    return [tuple(torch.randint(0, vocab_size, (length,), generator=gen).tolist()) for _ in range(num)]


@dataclass
class Run:
    """One workload through one engine: the finished requests (in spec order) and a per-step record."""

    specs: list[RequestSpec]
    requests: list[Request]
    wall_s: float
    stats: list[StepStats] = field(default_factory=list)
    timings: list[StepTiming] = field(default_factory=list)
    emitted: list[tuple[int, ...]] = field(default_factory=list)  # per step: spec indices given a token
    added_at: list[int] = field(default_factory=list)  # per spec: index of the first step it could join
    num_preemptions: int = 0
    num_evictions: int = 0
    extra: dict = field(default_factory=dict)  # benchmark-specific counts, reported like the others


@dataclass
class Context:
    """The model and the run settings shared by every case; `engine(**knobs)` builds a fresh engine."""

    model: str
    dtype: str = "auto"
    load_format: str = "auto"
    repeats: int = 5  # rounds at least
    min_seconds: float = 0.0  # and more rounds until each mode has run this long in all
    scale: str = "full"  # "small": the shrunken cases of the test suite
    out: TextIO = field(default_factory=lambda: sys.stdout)
    vocab_size: int = 0  # filled by warm_up
    max_model_len: int = 0
    trace_dir: Path | None = None  # `--trace DIR`: each engine configuration's trace, its last run's
    benchmark: str = ""  # the benchmark running (names its traces)
    speculative_config: dict | None = None  # speculative-decoding's proposals (None: its n-gram default)
    oracle: tuple[int, ...] = ()  # speculative-decoding: these K with proposals of chosen acceptances
    streams: tuple[int, ...] = ()  # speculative-decoding's concurrent streams (empty: its default)

    def engine(self, **knobs) -> LLMEngine:
        trace = None
        if self.trace_dir is not None and self.benchmark:
            setting = "-".join(f"{k}={v}" for k, v in sorted(knobs.items()))
            setting = "".join(ch if ch.isalnum() or ch in "-_.=" else "_" for ch in setting)
            if len(setting) > MAX_SETTING_CHARS:  # the rest as a digest
                digest = hashlib.sha1(setting.encode()).hexdigest()[:12]
                setting = f"{setting[: MAX_SETTING_CHARS - 13]}-{digest}"
            trace = str(self.trace_dir / f"{self.benchmark}-{setting}.trace.json")
        # the mechanisms in step counts: no prefill pacing, which times steps and so varies run to run
        knobs.setdefault("max_decode_slowdown", 0)
        config = EngineConfig(
            model=self.model, dtype=self.dtype, load_format=self.load_format, trace_path=trace, **knobs
        )
        return LLMEngine(config)

    def warm_up(self) -> None:
        """One throwaway run per attention path, so that no timed run pays for first-call setup."""
        for use_kv_cache in (True, False):
            eng = self.engine(use_kv_cache=use_kv_cache, num_kv_blocks=64)
            self.vocab_size, self.max_model_len = eng.model_config.vocab_size, eng.max_model_len
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            for length in (8, 24):
                eng.add_request(list(range(1, length + 1)), params)
            while eng.has_unfinished():
                eng.step()

    def print(self, *args) -> None:
        print(*args, file=self.out, flush=True)


def num_blocks_for(specs: list[RequestSpec], block_size: int) -> int:
    """A pool that holds every request of the workload at once: no memory pressure."""
    return sum(-(-(len(s.prompt_ids) + s.max_tokens) // block_size) for s in specs) + 1


def drive(engine: LLMEngine, specs: list[RequestSpec], serial: bool = False) -> Run:
    """Run the workload to completion (GC paused, so a collection cannot pose as a decode gap)."""
    order = sorted(range(len(specs)), key=lambda i: (specs[i].arrival_step, i))
    requests: list[Request | None] = [None] * len(specs)
    index_of: dict[str, int] = {}
    run = Run(specs, [], 0.0, added_at=[0] * len(specs))
    gc.collect()
    gc.disable()
    try:
        start = time.monotonic()
        step = 0
        while order or engine.has_unfinished():
            idle = not engine.has_unfinished()
            if serial and idle:
                admit = order[:1]
            elif serial:
                admit = []
            else:
                if idle:
                    step = max(step, specs[order[0]].arrival_step)
                admit = [i for i in order if specs[i].arrival_step <= step]
            for i in admit:
                order.remove(i)
                s = specs[i]
                params = SamplingParams(temperature=0.0, max_tokens=s.max_tokens, ignore_eos=True)
                requests[i] = engine.add_request(
                    list(s.prompt_ids), params, req_id=f"r{i}", priority=s.priority
                )
                index_of[requests[i].req_id] = i
                run.added_at[i] = len(run.stats)
            outputs = engine.step()
            run.stats.append(engine.last_stats)
            run.timings.append(engine.last_timing)
            run.emitted.append(tuple(index_of[o.req_id] for o in outputs if o.token_ids))
            step += 1
        run.wall_s = time.monotonic() - start
    finally:
        gc.enable()
    engine.close()  # writes its trace, when tracing (a later run of the same setting overwrites it)
    run.requests = requests
    run.num_preemptions = engine.scheduler.num_preemptions
    run.num_evictions = engine.scheduler.kv_cache_manager.num_evictions
    engine.scheduler.check_integrity()
    return run


def token_steps(run: Run) -> tuple[list[int], list[int]]:
    """Per request: engine steps from the one it could first join to the one that gave its first token,
    and to the one that gave its last."""
    first, last = [-1] * len(run.specs), [0] * len(run.specs)
    for step, indices in enumerate(run.emitted):
        for i in indices:
            if first[i] < 0:
                first[i] = step
            last[i] = step

    def since_joined(steps: list[int]) -> list[int]:
        return [step - joined + 1 for step, joined in zip(steps, run.added_at, strict=True)]

    return since_joined(first), since_joined(last)


def percentile(values: list[float], pct: float) -> float:
    """The reference's percentile: the value at index round((n - 1) * pct) of the sorted values."""
    if not values:
        return 0.0
    return sorted(values)[round((len(values) - 1) * pct)]


def mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else 0.0


def metrics(run: Run) -> dict:
    """Every column any reference table prints, from one run. Times in ms except wall_s and forward_s."""
    reqs, specs = run.requests, run.specs
    ttft = [r.first_token_time - r.arrival_time for r in reqs]
    latency = [r.finished_time - r.arrival_time for r in reqs]
    gaps = [b - a for r in reqs for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    hi = [lat for lat, s in zip(latency, specs, strict=True) if s.priority == 0]
    low = [lat for lat, s in zip(latency, specs, strict=True) if s.priority > 0]
    batches = [s.num_running for s in run.stats if s.num_running]
    gen_tok = sum(r.num_output_tokens for r in reqs)
    prompt_tok = sum(r.num_prompt_tokens for r in reqs)
    prefill = sum(r.num_prefill_tokens_computed for r in reqs)
    wall = run.wall_s
    return {
        "reqs": len(specs),
        "done": sum(r.finish_reason in ("length", "stop") for r in reqs),
        "prompt_tok": prompt_tok,
        "gen_tok": gen_tok,
        "prefill_computed": prefill,
        "cached_tok": sum(r.num_cached_tokens for r in reqs),
        "preempt": run.num_preemptions,
        "evictions": run.num_evictions,
        "steps": len(run.stats),
        "max_step_tokens": max((s.num_prefill_tokens + s.num_decode_tokens for s in run.stats), default=0),
        "max_batch": max(batches, default=0),
        "avg_batch": round(mean(batches), 4),
        "wall_s": wall,
        "tok_s": gen_tok / wall,
        "prompt_tok_s": prompt_tok / wall,
        "prefill_tok_s": prefill / wall,
        "forward_s": sum(t.forward_s for t in run.timings),
        "avg_ttft_ms": 1e3 * mean(ttft),
        "p95_ttft_ms": 1e3 * percentile(ttft, 0.95),
        "avg_lat_ms": 1e3 * mean(latency),
        "p95_lat_ms": 1e3 * percentile(latency, 0.95),
        "hi_lat_ms": 1e3 * mean(hi),
        "low_lat_ms": 1e3 * mean(low),
        "avg_gap_ms": 1e3 * mean(gaps),
        "max_gap_ms": 1e3 * max(gaps, default=0.0),
        **run.extra,
    }


MAX_REPEATS = 30
HIGHER_IS_BETTER = ("tok_s", "prompt_tok_s", "prefill_tok_s", "decode_tok_s")  # rates, not times


def best_of(samples: list[dict], exact: bool = True) -> dict:
    """Best value of each timing over the repeats (max rates, min times); counts must agree, unless not
    `exact` (a mode whose work depends on timings: the counts are then the fastest repeat's)."""
    if not exact:
        rate = next(key for key in (*HIGHER_IS_BETTER, "wall_s") if key in samples[0])
        fastest = (min if rate == "wall_s" else max)(samples, key=lambda s: s[rate])
    best = {}
    for key, first in samples[0].items():
        values = [s[key] for s in samples]
        if key in HIGHER_IS_BETTER:
            best[key] = max(values)
        elif key.endswith(("_ms", "_s")):
            best[key] = min(values)
        elif not exact:
            best[key] = fastest[key]
        elif any(v != first for v in values):
            raise RuntimeError(f"{key} differs between repeats of the same workload: {values}")
        else:
            best[key] = first
    return best


def compare(
    ctx: Context, modes: dict[str, Callable[[], Run]], varying: tuple[str, ...] = ()
) -> tuple[dict[str, dict], dict[str, Run]]:
    """Run the modes interleaved (A B, B A, A B, ...) so that a drift of the machine hits both alike: at
    least ctx.repeats rounds, and more (up to MAX_REPEATS) until every mode has run ctx.min_seconds in
    all, since a run of a few tens of milliseconds is at the mercy of a single hiccup. Returns the
    best-of metrics per mode (with "runs", the rounds taken) and each mode's last run. The modes named
    in `varying` choose their work by timings: their counts may differ between repeats (best_of)."""
    samples: dict[str, list[dict]] = {name: [] for name in modes}
    last: dict[str, Run] = {}
    names = list(modes)
    rep = 0
    while rep < ctx.repeats or (
        rep < MAX_REPEATS and min(sum(m["wall_s"] for m in samples[n]) for n in names) < ctx.min_seconds
    ):
        for name in names if rep % 2 == 0 else reversed(names):
            last[name] = modes[name]()
            samples[name].append(metrics(last[name]))
        rep += 1
    best = {name: best_of(samples[name], exact=name not in varying) | {"runs": rep} for name in names}
    return best, last


def ratio(a: float, b: float) -> float:
    """a / b, with 0 / 0 = 1 (nothing to compare) and x / 0 = inf."""
    if b == 0:
        return 1.0 if a == 0 else float("inf")
    return a / b
