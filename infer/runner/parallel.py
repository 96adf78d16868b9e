"""Tensor parallelism across processes: rank 0 schedules, every rank runs the same forward on its shard.

```
rank 0: the engine (scheduler, sampler, server)         ranks 1..N-1: workers (run_worker)
  ParallelRunner.execute(sched)
    broadcast_object_list([sched])  ───────────────────►  receive the SchedulerOutput
    ModelRunner.logits(sched)   ◄── 2 all-reduces a layer, ─►  ModelRunner.logits(sched)
                                    1 all-gather of logits
    ModelRunner.sample(...)                                  (nothing: rank 0 samples)
```

The scheduler stays single and pure Python; the ranks exchange only the step's SchedulerOutput (pickled,
on a control group with no timeout, since an idle server sends nothing) and the collectives inside the
forward (torch.distributed's default group: gloo on CPU). Each rank holds the weights and the KV heads of
its shard (infer.layers.parallel); the block tables are the same on every rank.

Launch. Under a launcher that sets the standard variables (torchrun, or MASTER_ADDR / MASTER_PORT /
WORLD_SIZE / RANK by hand, on one machine or many), every rank runs the same `infer serve` command: rank 0
serves, the others run `run_worker`. `--tensor-parallel-size N` alone: rank 0 is that launcher for this
machine, starting N-1 `python -m infer.runner.parallel` processes with the variables set (127.0.0.1, a
free port); a subprocess rather than multiprocessing, so that nothing re-imports the caller's main
module. Locally started ranks get cores // N torch threads each.

Failure. gloo raises in every collective of every rank as soon as a peer's socket closes (measured here:
within ~1 s of a rank's exit, while waiting in a broadcast or in an all-reduce), so no rank hangs on a dead
one: a worker exits, rank 0 raises RankFailure, which ends every request and stops the server with a
non-zero exit (infer.engine.async_engine). Rank 0 also watches its local workers' processes, so a worker
that dies while the server is idle is noticed within a second, not at the next request. An error inside
rank 0's forward is a RankFailure too: the other ranks may be waiting in a collective it skipped, so the
ranks can no longer be trusted to be in step. Errors in the sampler (after the forward) stay one
request's (LLMEngine's halving retry): the workers finished that step already.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

from infer.config import check_local_ranks, usable_cores
from infer.core.outputs import ModelRunnerOutput, SchedulerOutput
from infer.layers.parallel import TensorParallel

logger = logging.getLogger("infer.engine")
_NO_TIMEOUT = datetime.timedelta(days=365)  # the control group waits as long as the server is idle
_STEP_TIMEOUT = datetime.timedelta(minutes=10)  # a collective inside one step; a dead peer raises at once
WATCH_INTERVAL_S = 0.2


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or fell out of step: the engine cannot go on."""


def launched_rank() -> int | None:
    """This process's RANK when a launcher (torchrun, or the variables by hand) started every rank."""
    return int(os.environ["RANK"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


class Ranks:
    """The process group of one engine, seen from any rank: joined at construction."""

    def __init__(self, rank: int, size: int, local: bool, init_method: str = "env://"):
        self.tp = TensorParallel(rank, size)
        if local:  # we started the ranks on this machine: share its cores between them
            torch.set_num_threads(max(1, usable_cores() // size))
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=size, timeout=_STEP_TIMEOUT
        )
        self.control = dist.new_group(backend="gloo", timeout=_NO_TIMEOUT)

    def broadcast(self, obj):
        """Rank 0 sends `obj`; every other rank returns what rank 0 sent."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def start_ranks(config) -> tuple[Ranks, list[subprocess.Popen]]:
    """Rank 0's side: join the group of a launcher, or start the other ranks here. Returns the group
    and the local worker processes (none under a launcher)."""
    size = config.tensor_parallel_size
    rank = launched_rank()
    if rank is not None:
        if int(os.environ["WORLD_SIZE"]) != size or rank != 0:
            raise ValueError(
                f"launched as rank {rank} of WORLD_SIZE {os.environ['WORLD_SIZE']}, but the engine of rank "
                f"0 needs --tensor-parallel-size {size} = WORLD_SIZE"
            )
        return Ranks(0, size, local=False), []
    check_local_ranks(size)
    port = _free_port()
    args = [sys.executable, "-m", "infer.runner.parallel", json.dumps(dataclasses.asdict(config))]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(size)}
    workers = [
        subprocess.Popen(args, env={**env, "RANK": str(r), "INFER_TP_LOCAL": "1"}) for r in range(1, size)
    ]
    return Ranks(0, size, local=True, init_method=f"tcp://127.0.0.1:{port}"), workers


def stop_ranks(ranks: Ranks, workers: list[subprocess.Popen]) -> None:
    """Rank 0 could not build its engine: end the local workers and leave the group."""
    for worker in workers:
        worker.kill()
        worker.wait()
    ranks.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(config) -> int:
    """A rank > 0 (RANK and WORLD_SIZE set): load its shard, then run every step rank 0 broadcasts
    until it broadcasts None. Returns the exit code (0 after a clean stop)."""
    from infer.models.loader import load_engine_model
    from infer.runner.kv_cache import auto_cache_dtype, kv_cache_dtype
    from infer.runner.model_runner import ModelRunner

    rank, local = launched_rank(), os.environ.get("INFER_TP_LOCAL") == "1"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank-{rank}: %(message)s")
    try:
        ranks = Ranks(rank, config.tensor_parallel_size, local)
        model, _, _ = load_engine_model(config, ranks.tp)
        num_blocks = ranks.broadcast(None)
        cache_dtype = kv_cache_dtype(config.kv_cache_dtype, auto_cache_dtype(model))
        runner = ModelRunner(
            model,
            num_blocks,
            config.block_size,
            config.seed,
            config.use_kv_cache,
            tp=ranks.tp,
            kv_cache_dtype=cache_dtype,
        )
        while (sched := ranks.broadcast(None)) is not None:
            runner.logits(sched)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        return 1
    ranks.close()
    return 0


class ParallelRunner:
    """Rank 0's runner: sends each step to the other ranks, then runs its own part (see the module
    docstring). Offers what LLMEngine uses of a ModelRunner."""

    def __init__(self, runner, ranks: Ranks, workers: list[subprocess.Popen]):
        self.runner, self.ranks, self.workers = runner, ranks, workers
        self.failure: RankFailure | None = None
        self._stopping = False
        if workers:
            threading.Thread(target=self._watch, name="infer-tp-watch", daemon=True).start()

    def __getattr__(self, name):  # dtype, kv_caches, last_prepare_s, sampler, ...
        return getattr(self.runner, name)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if self.failure is not None:
            raise self.failure
        try:
            self.ranks.broadcast(_without_histories(sched))
            logits, reqs = self.runner.logits(sched)
        except Exception as exc:
            self.failure = self.failure or RankFailure(
                f"tensor-parallel step failed: {type(exc).__name__}: {exc}"
            )
            raise self.failure from exc
        return self.runner.sample(logits, reqs)

    def shutdown(self) -> None:
        """Stop the other ranks (they leave their loop and exit) and leave the group."""
        if self._stopping:
            return
        self._stopping = True
        if self.failure is None:
            try:
                self.ranks.broadcast(None)
            except Exception as exc:  # a rank already gone: nothing to stop there
                logger.warning("stopping the tensor-parallel ranks: %s", exc)
        for worker in self.workers:
            try:
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        self.ranks.close()

    def _watch(self) -> None:
        """On a thread: wait for any local worker to exit; before shutdown, that is a failure."""
        while not self._stopping:
            for rank, worker in enumerate(self.workers, start=1):
                if worker.poll() is not None and not self._stopping:
                    self.failure = RankFailure(
                        f"tensor-parallel rank {rank} (pid {worker.pid}) exited with code {worker.returncode}"
                    )
                    logger.critical("%s: the engine stops", self.failure)
                    return
            time.sleep(WATCH_INTERVAL_S)


def _config_from_json(text: str):
    from infer.config import EngineConfig

    return EngineConfig(**json.loads(text))


def _without_histories(sched: SchedulerOutput) -> SchedulerOutput:
    """The step as the other ranks need it: they do not sample, so no request's history, nor its grammar
    (up to a MiB of text, pickled to every rank every step otherwise)."""
    if all(s.history is None and s.sampling_params.structured_outputs is None for s in sched.scheduled):
        return sched
    return dataclasses.replace(sched, scheduled=[_for_other_ranks(s) for s in sched.scheduled])


def _for_other_ranks(s):
    if s.sampling_params.structured_outputs is None:
        return dataclasses.replace(s, history=None)
    params = copy.copy(s.sampling_params)  # not dataclasses.replace: no second validation a step
    params.structured_outputs = None
    return dataclasses.replace(s, history=None, sampling_params=params)


if __name__ == "__main__":  # a locally started rank (start_ranks)
    sys.exit(run_worker(_config_from_json(sys.argv[1])))
