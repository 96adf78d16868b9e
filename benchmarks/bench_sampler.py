"""The sampler's draw for rows that sample (temperature > 0): inverse transform sampling (one uniform a
row against the row's cumulative sum, infer/runner/sampler.py) against the exponential race it replaced
(argmax(p / E), one Exp(1) number per token of the vocabulary), on the same probabilities, alternated in
one process, the median of --repeats calls (ms):

    python benchmarks/bench_sampler.py [--rows 1 8 32 128] [--vocab 49152] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from infer.runner.sampler import Sampler
from infer.sampling_params import SamplingParams


def exponential_race(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return (probs / torch.empty(probs.shape).exponential_(generator=generator)).argmax(dim=-1)


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    sampler, generator = Sampler(0), torch.Generator().manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}, vocabulary {args.vocab}")
    print("| rows | exponential race, ms | inverse transform, ms | ratio |")
    print("|---:|---:|---:|---:|")
    for rows in args.rows:
        probs = torch.softmax(torch.randn(rows, args.vocab, generator=generator) * 3, dim=-1)
        params, req_ids = [SamplingParams()] * rows, [f"r{i}" for i in range(rows)]
        race = draw = 0.0
        for _ in range(2):  # alternated
            race = timed(lambda: exponential_race(probs, generator), args.repeats)  # noqa: B023
            draw = timed(lambda: sampler._draw(probs, req_ids, params), args.repeats)  # noqa: B023
        print(f"| {rows} | {race:.2f} | {draw:.2f} | {race / draw:.1f}x |")


if __name__ == "__main__":
    main()
