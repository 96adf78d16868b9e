"""Speculative decoding's verification step eagerly against replayed from a graph, side by side.

    python benchmarks/bench_verify_graphs.py                     # the embedded model, n-gram K = 3
    python benchmarks/bench_verify_graphs.py --speculative-config \\
        '{"method": "draft_model", "model": "/tmp/embedded-draft", "num_speculative_tokens": 3}'

Three modes on each of the speculative-decoding micro-benchmark's workloads (infer.bench.micro), one
engine each, run interleaved (best of --repeats rounds): plain decoding, speculation whose verification
steps run eagerly (verification graphs off: decode graphs only), and speculation whose verification steps
replay graphs. Each mode's graphs are taken as paying (decode_graph.MIN_GAIN off), so that a timing
upset by other work on the cores at the first capture does not turn graphs off in one mode alone.
Reported: decode tokens/s of one stream, each speculating mode's speed-up over plain, the acceptance,
the steps of plain and of speculation, the milliseconds a step (the best run's wall time over its
steps) and the steps that replayed a verification graph, over all rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from infer.bench.micro.harness import Context, compare, prepare_model
from infer.bench.micro.speculative_decoding import NGRAM, WORKLOADS, run_mode, workload_specs
from infer.runner import decode_graph


@dataclasses.dataclass
class _Context(Context):
    verify_graphs: bool = True
    engines: list = dataclasses.field(default_factory=list)

    def engine(self, **knobs):
        engine = super().engine(**knobs)
        if engine.runner.graphs is not None and not self.verify_graphs:
            engine.runner.graphs.verify_enabled = False
        self.engines.append(engine)
        return engine


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--speculative-config", default=json.dumps(NGRAM))
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads is not None:  # one thread: no OpenMP barrier waits on a descheduled thread
        torch.set_num_threads(args.threads)
    decode_graph.MIN_GAIN = float("inf")
    spec = {**json.loads(args.speculative_config), "disable_by_gain": False}  # verifications, every step
    model, dtype, _ = prepare_model(args.model, "auto", None, False)
    on = _Context(model, dtype, args.load_format, args.repeats, min_seconds=2.0)
    off = dataclasses.replace(on, verify_graphs=False, engines=[])
    on.warm_up()
    tokenizer = on.engine(num_kv_blocks=16).tokenizer
    print(
        f"speculative config: {json.dumps(spec)}; {args.streams} stream(s), {args.max_tokens} tokens, "
        f"{torch.get_num_threads()} threads"
    )
    print("workload | plain tok/s | eager verification | replayed verification | replayed / eager | "
          "accepted | steps | ms a step (plain, eager, replayed) | verification replays")  # fmt: skip
    for workload in args.workloads.split(","):
        specs = workload_specs(on, workload, tokenizer, args.streams, args.max_tokens)
        on.engines.clear()
        modes = {
            "plain": run_mode(on, specs, None),
            "eager": run_mode(off, specs, spec),
            "replayed": run_mode(on, specs, spec),
        }
        best, _ = compare(on, modes)
        rates = {mode: m["decode_tok_s"] for mode, m in best.items()}
        replays = on.engines[-1].runner.graphs.verify_replays if on.engines[-1].runner.graphs else 0
        plain, eager, replayed = rates["plain"], rates["eager"], rates["replayed"]
        step_ms = ", ".join(f"{best[mode]['step_ms']:.2f}" for mode in modes)
        steps = f"{best['plain']['steps']} / {best['replayed']['steps']}"
        print(
            f"{workload} | {plain:.0f} | {eager / plain:.2f}x | {replayed / plain:.2f}x | "
            f"{replayed / eager:.2f}x | {best['replayed']['acceptance']:.1%} | {steps} | {step_ms} | "
            f"{replays}",
            flush=True,
        )


if __name__ == "__main__":
    main()
