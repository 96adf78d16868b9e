"""A running stream beside one long prompt: what the stream loses and what the long prompt pays.

    python benchmarks/bench_long_prefill.py --model Qwen3-0.6B --load-format dummy \
        --prompt-lens 2048 8192 --variants "--max-decode-slowdown 0" "--max-decode-slowdown 2"
    python benchmarks/bench_long_prefill.py --model /tmp/models_prof/sizes/smollm2-135m-shape \
        --load-format auto --prompt-repeat 700 --bystander-tokens 200 40 --prompt-logprobs 0 20 --rounds 2

--prompt-repeat N sends "The quick brown fox jumps over the lazy dog. " x N as the long prompt's text
(--prompt-lens then unused); --prompt-logprobs asks the long prompt for that many prompt logprobs (0:
none) as well. --rounds repeats every variant in turn, so that a loaded machine's drift falls on all.

For each server variant (flags added to `infer serve`) and each long-prompt length: a bystander (a
streamed greedy completion of --bystander-tokens tokens, ignore_eos) alone, then again with a long prompt
(max_tokens 1) sent --long-delay seconds after it. Reports the bystander's time and its inter-token p99
(each with its ratio to alone; return_token_ids streams a chunk per token, even of random weights' bytes
that are no text yet), and the long prompt's time to first token (and its ratio to the first variant's).
The variants run one server at a time.

With --newcomer-every S, newcomers instead of the bystander stream: the long prompt alone, then again
with a short request (one token) sent every S seconds until its first token; reports the long prompt's
time to first token both ways, and the newcomers' times to first token (alone, then p50 and max beside).
docs/robustness.md, "Long prompts: the streams' gaps against the prompt's first token", has the figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import shlex
import threading
import time
from pathlib import Path

import httpx

from infer.bench.launch import LaunchedServer

WORDS = "The quick brown fox jumps over the lazy dog. "
MEASUREMENTS = itertools.count()


def stream_times(url: str, body: dict) -> list[float]:
    """The arrival time of every streamed chunk, from the request's start (with return_token_ids a chunk
    comes with each token, even where random weights' bytes are not yet text)."""
    start, times = time.perf_counter(), []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=3600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter() - start)
    return times


def first_token_time(url: str, body: dict) -> float:
    """When the long prompt's one token arrived: its first streamed chunk, or, with prompt_logprobs (not
    streamed, as in vLLM), its whole answer."""
    if not body.get("prompt_logprobs"):
        return stream_times(url, body)[0]
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=3600)
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code}: {r.text[:500]}")
    return time.perf_counter() - start


def long_prompt(url: str, num_tokens: int) -> list[int]:
    text = WORDS * (num_tokens // 10 + 1)
    ids = httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=60).json()["tokens"]
    return ids[:num_tokens]


def itl_p99_ms(times: list[float]) -> float:
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
    return 1000 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0.0


def measure(
    url: str, prompt: str | list[int], bystander_tokens: int, delay: float, prompt_logprobs: int
) -> dict:
    bystander = {
        "prompt": "Once upon a time",
        "max_tokens": bystander_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    stream_times(url, {**bystander, "max_tokens": 4})  # warm
    alone = stream_times(url, bystander)
    found: dict = {}
    prompt = fresh_prompt(prompt)  # its first token differs from a cached one's
    long_body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    if prompt_logprobs:
        long_body["prompt_logprobs"] = prompt_logprobs

    def send_long():
        time.sleep(delay)
        found["ttft"] = first_token_time(url, long_body)

    worker = threading.Thread(target=send_long)
    worker.start()
    beside = stream_times(url, bystander)
    worker.join()
    return {
        "bystander_tokens": bystander_tokens,
        "prompt_logprobs": prompt_logprobs,
        "bystander_alone_s": round(alone[-1], 3),
        "bystander_beside_s": round(beside[-1], 3),
        "bystander_ratio": round(beside[-1] / alone[-1], 2),
        "itl_p99_alone_ms": round(itl_p99_ms(alone), 1),
        "itl_p99_beside_ms": round(itl_p99_ms(beside), 1),
        "itl_p99_ratio": round(itl_p99_ms(beside) / max(itl_p99_ms(alone), 1e-9), 2),
        "long_ttft_s": round(found["ttft"], 3),
    }


def fresh_prompt(prompt: str | list[int]) -> str | list[int]:
    """The prompt, changed so that no earlier measurement on this server has cached it."""
    n = next(MEASUREMENTS)
    if isinstance(prompt, str):
        return f"[{n}] {prompt}"
    return prompt[n % len(prompt) :] + prompt[: n % len(prompt)]


def measure_newcomers(url: str, prompt: str | list[int], every: float) -> dict:
    newcomer = {"prompt": "Once upon a time", "max_tokens": 1, "temperature": 0}
    alone = sorted(first_token_time(url, newcomer) for _ in range(5))[2]
    long_ttft: dict[bool, float] = {}
    newcomers: list[float] = []

    def send_long(beside: bool) -> None:
        body = {"prompt": fresh_prompt(prompt), "max_tokens": 1, "temperature": 0}
        long_ttft[beside] = first_token_time(url, body)

    for beside in (False, True):
        worker = threading.Thread(target=send_long, args=(beside,))
        worker.start()
        while beside and worker.is_alive():
            time.sleep(every)
            if worker.is_alive():
                newcomers.append(first_token_time(url, newcomer))
        worker.join()
    newcomers.sort()
    return {
        "newcomer_every_s": every,
        "newcomers": len(newcomers),
        "newcomer_ttft_alone_ms": round(1000 * alone, 1),
        "newcomer_ttft_p50_ms": round(1000 * newcomers[len(newcomers) // 2], 1) if newcomers else None,
        "newcomer_ttft_max_ms": round(1000 * newcomers[-1], 1) if newcomers else None,
        "long_ttft_alone_s": round(long_ttft[False], 3),
        "long_ttft_s": round(long_ttft[True], 3),
        "long_ttft_beside_ratio": round(long_ttft[True] / long_ttft[False], 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen3-0.6B")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--prompt-repeat", type=int, default=0, help="the long prompt: the words x N, as text")
    p.add_argument("--bystander-tokens", type=int, nargs="+", default=[200])
    p.add_argument("--prompt-logprobs", type=int, nargs="+", default=[0], help="the long prompt's (0: none)")
    p.add_argument("--long-delay", type=float, default=0.5, help="seconds between the bystander and the long")
    p.add_argument("--variants", nargs="+", default=["--max-decode-slowdown 0", "--max-decode-slowdown 2"])
    p.add_argument("--rounds", type=int, default=1, help="every variant in turn, this many times")
    p.add_argument("--max-model-len", type=int, default=0, help="0: the longest prompt + the bystander")
    p.add_argument("--newcomer-every", type=float, default=0, help="newcomers, not a bystander (docstring)")
    p.add_argument("--out", type=Path, default=None, help="JSON file for the results")
    args = p.parse_args()
    lens = [0] if args.prompt_repeat else args.prompt_lens
    max_len = args.max_model_len or max(lens) + max(args.bystander_tokens) + 64
    rows = []
    for prompt_len in lens:
        for round_ in range(args.rounds):
            for variant in args.variants:
                flags = [
                    "--model",
                    args.model,
                    "--load-format",
                    args.load_format,
                    "--max-model-len",
                    str(max_len),
                ]
                flags += shlex.split(variant)
                with LaunchedServer.ours(flags, Path("/tmp/bench_long_prefill.log"), timeout=600) as s:
                    prompt = (
                        WORDS * args.prompt_repeat if args.prompt_repeat else long_prompt(s.url, prompt_len)
                    )
                    if args.prompt_repeat:
                        num = len(
                            httpx.post(f"{s.url}/tokenize", json={"prompt": prompt}, timeout=60).json()[
                                "tokens"
                            ]
                        )
                    if args.newcomer_every:
                        row = {
                            "variant": variant,
                            "round": round_,
                            "prompt_len": num if args.prompt_repeat else prompt_len,
                        }
                        row.update(measure_newcomers(s.url, prompt, args.newcomer_every))
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        continue
                    for tokens in args.bystander_tokens:
                        for logprobs in args.prompt_logprobs:
                            row = {
                                "variant": variant,
                                "round": round_,
                                "prompt_len": num if args.prompt_repeat else prompt_len,
                                **measure(s.url, prompt, tokens, args.long_delay, logprobs),
                            }
                            same = (row["prompt_len"], round_, tokens, logprobs)
                            base = next(
                                (
                                    r
                                    for r in rows
                                    if (
                                        r["prompt_len"],
                                        r["round"],
                                        r["bystander_tokens"],
                                        r["prompt_logprobs"],
                                    )
                                    == same
                                ),
                                row,
                            )
                            row["long_ttft_ratio"] = round(row["long_ttft_s"] / base["long_ttft_s"], 2)
                            rows.append(row)
                            print(json.dumps(row), flush=True)
    print(f"# {platform.processor() or platform.machine()}, {args.model} ({args.load_format})")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
