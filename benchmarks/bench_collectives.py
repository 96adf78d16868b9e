"""What one torch.distributed collective costs between two CPU processes on this machine: the unit of
tensor parallelism's overhead (infer/runner/parallel.py: 2 all-reduces per layer, one for the
embedding, one all-gather of the logits, and the step's broadcast of its SchedulerOutput).

    python benchmarks/bench_collectives.py [--ranks 2] [--iters 500]

Each rank has one torch thread, as the locally started ranks of `--tensor-parallel-size` do on a
machine with as many cores as ranks. Prints the mean time of each operation, measured on rank 0.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, size: int, port: int, iters: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    control = dist.new_group(backend="gloo")
    hidden = {rows: torch.randn(rows, 512, dtype=torch.bfloat16) for rows in (1, 32, 512)}
    ops = {f"all_reduce {rows} x 512 bf16": (lambda t=t: dist.all_reduce(t)) for rows, t in hidden.items()}
    parts = [torch.empty(32, 16000, dtype=torch.bfloat16) for _ in range(size)]
    ops["all_gather 32 x 16000 bf16 (logits)"] = lambda: dist.all_gather(parts, parts[rank].clone())
    step = list(range(300)) if rank == 0 else None
    ops["broadcast_object_list (a step)"] = lambda: dist.broadcast_object_list([step], src=0, group=control)
    for name, op in ops.items():
        for _ in range(20):
            op()
        start = time.perf_counter()
        for _ in range(iters):
            op()
        if rank == 0:
            print(f"{name:40s} {(time.perf_counter() - start) / iters * 1e6:8.1f} us", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--port", type=int, default=29561)
    args = parser.parse_args()
    mp.spawn(run, args=(args.ranks, args.port, args.iters), nprocs=args.ranks)


if __name__ == "__main__":
    main()
