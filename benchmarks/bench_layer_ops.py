"""The C++ layer ops (infer/kernels/layer_ops.cpp: RMSNorm and its fused residual add, rotary in place,
SiLU-and-multiply, the KV cache write) against the torch code of the layers they replace: each op alone,
and whole engine steps with the ops on and off. `--switch` times engine steps with another of the step's
kernels on and off instead: the greedy argmax over bf16 logits (off: float32 logits, torch's argmax, as
before it), the small-batch linear (infer/kernels/small_linear.cpp; off: an engine whose every linear is
oneDNN's), its AMX tiles (off: an engine with a oneDNN copy of every weight, the kernel up to 6 rows (on
tiles from 2) and oneDNN for the rest; AMX only), the prefill-attention kernel (off: SDPA, one call
per prompt or long chunk, its fallback), or the gate_up projection with SiLU-and-multiply in its epilogue
(off: an engine loaded without it, two ops; AMX only), or the AVX2 few-row linear (infer/kernels/
avx2_linear.cpp; off: an engine loaded without it, torch's bf16 matmul and int8 kernel, and GGUF's Q8_0
and Q6_K dequantized; CPUs without AVX-512 BF16 only).

    python benchmarks/bench_layer_ops.py                               # ops, then llama-50m steps
    python benchmarks/bench_layer_ops.py --model /work/models/llama-1b --load-format dummy --skip-ops
    python benchmarks/bench_layer_ops.py --switch small_linear         # llama-50m steps, oneDNN vs kernel
    python benchmarks/bench_layer_ops.py --switch prefill_kernel       # SDPA vs the prefill kernel
    python benchmarks/bench_layer_ops.py --switch tiles                # linears before / with AMX tiles
    python benchmarks/bench_layer_ops.py --switch fused_silu           # gate_up + SiLU-and-mul in one pass
    python benchmarks/bench_layer_ops.py --switch avx2_linear --model M.gguf --dtype bfloat16  # AVX2 CPUs

Both paths run alternately in one process, best of --rounds (a shared machine drifts by tens of percent
between runs: never compare numbers from two runs). "torch" swaps `infer.kernels.layer_ops` for a
function that serves nothing, so every layer takes its reference path; the attention and linear layers
are the same on both sides. Steps: prefills of fresh prompts to their first token (N x L), and decode
steps of B streams after 128-token prompts (ms per step, the batch's prefill excluded).
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch
import torch.nn.functional as F

from infer import kernels
from infer.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.layers import attention, linear
from infer.layers.rotary import _rotate
from infer.runner import sampler
from infer.sampling_params import SamplingParams

REAL = kernels.layer_ops, sampler.argmax, linear.SMALL_ROWS, attention.prefill_kernel


def switch(name: str, on: bool) -> None:
    """Turn one of the step's kernels on (as shipped) or off (the code it replaced)."""
    kernels.layer_ops, sampler.argmax, linear.SMALL_ROWS, attention.prefill_kernel = REAL
    if on:
        return
    if name == "layer_ops":
        kernels.layer_ops = lambda x: None
    elif name == "argmax":
        sampler.argmax = lambda logits: logits.float().argmax(dim=-1)
    elif name == "prefill_kernel":
        attention.prefill_kernel = lambda q, cache: None
    elif name == "tiles":
        linear.SMALL_ROWS = 6
    else:
        linear.SMALL_ROWS = 0


def best_us(fn, rounds: int, n: int = 200) -> float:
    for _ in range(10):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
    return best * 1e6


HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 512, 1536, 8, 4, 64  # llama-50m's shapes


def op_pairs(ops, rows: int, dtype: torch.dtype) -> list:
    """(torch, kernel) callables for each op over `rows` rows."""
    x, residual = torch.randn(rows, HIDDEN).to(dtype), torch.randn(rows, HIDDEN).to(dtype)
    weight = torch.randn(HIDDEN).to(dtype)
    gate_up = torch.randn(rows, 2 * INTER).to(dtype)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    q = qkv[:, : HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(rows, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(rows, KV_HEADS, HEAD_DIM)
    caches = [torch.zeros(4096, 16, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in range(2)]  # 65,536 slots
    slots = torch.randperm(4096 * 16)[:rows]
    positions = torch.randint(0, 2048, (rows,))
    cos, sin = torch.randn(2048, HEAD_DIM // 2), torch.randn(2048, HEAD_DIM // 2)

    def norm(v):
        vf = v.float()
        return weight * (vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)

    def rotate():
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        return _rotate(q, c, s), _rotate(k, c, s)

    def index_put():  # the cache write attention() did before write_cache
        caches[0].view(-1, KV_HEADS, HEAD_DIM)[slots] = k
        caches[1].view(-1, KV_HEADS, HEAD_DIM)[slots] = v

    return [
        (lambda: norm(x), lambda: ops.rms_norm(x, weight, 1e-5)),
        (lambda: norm(x + residual), lambda: ops.add_rms_norm(x, residual, weight, 1e-5)),
        (lambda: F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:], lambda: ops.silu_and_mul(gate_up)),
        (rotate, lambda: ops.rotary(positions, q, k, cos, sin)),
        (index_put, lambda: ops.write_cache(k, v, *caches, slots)),
    ]


def bench_ops(rounds: int, dtype: torch.dtype) -> None:
    ops = kernels.load()
    print(
        f"one op, us, torch -> kernel ({dtype}; llama-50m shapes: hidden {HIDDEN}, intermediate {INTER}, "
        f"{HEADS} + {KV_HEADS} heads of {HEAD_DIM})"
    )
    names = ("rms_norm", "add + rms_norm", "silu * up", "rotary q, k", "kv cache write")
    print(f"{'rows':>6} " + " ".join(f"{n:>16}" for n in names))
    for rows in (1, 8, 32, 512, 2048):
        cells = [
            f"{best_us(a, rounds):7.1f} -> {best_us(b, rounds):5.1f}" for a, b in op_pairs(ops, rows, dtype)
        ]
        print(f"{rows:>6} " + " ".join(f"{c:>16}" for c in cells))


def bench_steps(args) -> None:
    config = EngineConfig(model=args.model, load_format=args.load_format, dtype=args.dtype)
    engines = {"on": LLMEngine(config)}
    if args.switch in ("small_linear", "tiles"):  # which weights get which copy is decided at load
        if args.switch == "tiles" and not kernels.cpu_has_amx():
            raise SystemExit("--switch tiles needs a CPU with AMX")
        # every weight with a oneDNN copy, none fused; routed by the off side's SMALL_ROWS from the start,
        # as decode graphs record a linear's route when they are captured
        switch(args.switch, False)
        with (
            mock.patch.object(linear, "SMALL_WEIGHT_BYTES", float("inf")),
            mock.patch.object(linear.kernels, "cpu_has_amx", lambda: False),
        ):
            engines["off"] = LLMEngine(config)
        switch(args.switch, True)
    if args.switch == "fused_silu":  # the "off" side: gate_up and SiLU-and-multiply as two ops
        if not kernels.cpu_has_amx():
            raise SystemExit("--switch fused_silu needs a CPU with AMX")
        init = linear.PrepackedLinear.__init__
        unfused = lambda self, lin, tied=False, gated=False: init(self, lin, tied)  # noqa: E731
        with mock.patch.object(linear.PrepackedLinear, "__init__", unfused):
            engines["off"] = LLMEngine(config)
    if args.switch == "avx2_linear":  # the "off" side: loaded as where the kernel is not built
        if kernels.avx2_ops() is None:
            raise SystemExit("--switch avx2_linear needs a CPU with AVX2 and without AVX-512 BF16")
        with mock.patch.object(kernels, "avx2_ops", lambda: None):
            engines["off"] = LLMEngine(config)
    gen = torch.Generator().manual_seed(0)
    vocab = engines["on"].model_config.vocab_size

    def prompt(n):
        return torch.randint(10, vocab - 10, (n,), generator=gen).tolist()

    def prefill(engine, num, length):
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        for _ in range(num):
            engine.add_request(prompt(length), params)
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return (time.perf_counter() - start) * 1000

    def decode(engine, batch, steps=30):
        params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
        for _ in range(batch):
            engine.add_request(prompt(128), params)
        while engine.scheduler.num_waiting:
            engine.step()
        for _ in range(3):
            engine.step()
        start = time.perf_counter()
        for _ in range(steps - 3):
            engine.step()
        ms = (time.perf_counter() - start) * 1000 / (steps - 3)
        while engine.has_unfinished():
            engine.step()
        return ms

    cases = [
        (f"prefill {n} x {n_tok}", lambda e, n=n, t=n_tok: prefill(e, n, t))
        for n, n_tok in ((4, 128), (1, 512), (1, 2000))
    ]
    cases += [(f"decode step, {b} streams", lambda e, b=b: decode(e, b)) for b in (1, 4, 8, 16, 32)]
    results: dict = {}
    for _ in range(args.rounds):
        for name, fn in cases:
            for mode in ("off", "on"):
                switch(args.switch, mode == "on")
                results.setdefault((name, mode), []).append(fn(engines.get(mode, engines["on"])))
    switch(args.switch, True)
    dtype = next(engines["on"].runner.model.parameters()).dtype
    what = f"{args.model}, {dtype}, {args.switch} off / on"
    print(f"\nengine steps, ms, best of {args.rounds} alternated rounds ({what})")
    for name, _ in cases:
        a, b = min(results[(name, "off")]), min(results[(name, "on")])
        print(f"{name:24s} off {a:9.2f}  on {b:9.2f}  {a / b:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="/work/models/llama-50m")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-ops", action="store_true", help="only the engine steps")
    parser.add_argument(
        "--switch",
        choices=(
            "layer_ops",
            "argmax",
            "small_linear",
            "tiles",
            "prefill_kernel",
            "fused_silu",
            "avx2_linear",
        ),
        default="layer_ops",
        help="the kernel the engine steps turn off and on (other than layer_ops: steps only)",
    )
    args = parser.parse_args()
    if kernels.load() is None:
        raise SystemExit("the C++ kernels are not available here (see the warning above)")
    if not args.skip_ops and args.switch == "layer_ops":
        bench_ops(max(args.rounds, 5), torch.bfloat16)
    bench_steps(args)


if __name__ == "__main__":
    main()
