"""`infer bench client`: the latency a client sees from any OpenAI-compatible server: cold and warm
prefix TTFT, and sequential against concurrent batches.

    infer bench client --server http://127.0.0.1:8000 [--model M] [--prefix-tokens 600] [--sizes 1,2,4,8,12]

- Prefix cache, cold vs warm: one long shared prefix. The cold request starts with a cache buster (a
  per-run nonce) so nothing cached can serve it; then `num_warm + 1` requests share another prefix that
  differs only in its suffix: the first builds the cache, the rest are measured. Each asks for 1 token, so
  TTFT is prefill (+ queueing). The server's `usage.prompt_tokens_details.cached_tokens`, when it reports
  it, says whether the cache was actually hit.
- Batches, sequential vs concurrent at sizes 1, 2, 4, 8, 12: a short prompt that starts with a unique id
  (no accidental cache hits); sequential = one at a time (raw speed), concurrent = all at once (the
  queueing tax). Average TTFT, tokens/s (sequential: tokens / summed latencies; concurrent: tokens / wall
  time of the batch), success rate.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import secrets
import statistics
import sys
from pathlib import Path

from infer.bench.arrivals import Arrivals
from infer.bench.client import BenchError, RequestSpec, StreamingClient, resolve_model, run_requests
from infer.bench.metrics import RequestRecord, run_duration, ttft
from infer.bench.prompts import PromptFactory
from infer.bench.record import new_record, table, write_record
from infer.bench.report import render_tables, server_info

SHORT_PROMPT = "The quick brown fox jumps over the lazy dog."


def _ms(x: float | None) -> float | None:
    return None if x is None else 1000 * x


async def cache_test(client: StreamingClient, prefix: str, num_warm: int, nonce: str) -> dict:
    async def one(i: int, prompt: str) -> RequestRecord:
        return await client.send(i, RequestSpec(prompt, 1, "cache"), client.now())

    cold = await one(0, f"[cold {nonce}] {prefix} Now, state the single word conclusion for the cold run:")
    warm = [
        await one(
            1 + i, f"[warm {nonce}] {prefix} Now, state the single word conclusion for iteration {i + 1}:"
        )
        for i in range(num_warm + 1)
    ]
    measured = [r for r in warm[1:] if r.ok]
    cold_ttft = _ms(ttft(cold)) if cold.ok else None
    warm_ttft = statistics.mean(_ms(ttft(r)) for r in measured) if measured else None
    return {
        "cold": cold.to_dict(),
        "warm": [r.to_dict() for r in warm],
        "cold_ttft_ms": cold_ttft,
        "avg_warm_ttft_ms": warm_ttft,
        "speedup": 1 - warm_ttft / cold_ttft if cold_ttft and warm_ttft is not None else None,
        "cold_cached_tokens": cold.num_cached_tokens,
        "warm_cached_tokens": [r.num_cached_tokens for r in measured],
        "prompt_tokens": cold.num_prompt_tokens,
    }


async def batch_test(
    client: StreamingClient, size: int, concurrent: bool, max_tokens: int, nonce: str
) -> dict:
    # the unique id goes first: as a suffix it would leave the shared start's full blocks cacheable;
    # and the request's own part comes before the run's nonce, which all the run's requests share: an
    # 8-hex nonce can take most of a 16-token block, and then two requests' first blocks were equal
    specs = [
        RequestSpec(
            f"ID: {'c' if concurrent else 's'}{size}-{i}-{nonce}. {SHORT_PROMPT}", max_tokens, "batch"
        )
        for i in range(size)
    ]
    arrivals = Arrivals("burst") if concurrent else Arrivals("synchronous")
    records = await run_requests(client, specs, arrivals)
    ok = [r for r in records if r.ok]
    tokens = sum(r.num_completion_tokens or 0 for r in ok)
    if concurrent:
        wall = run_duration(records)
        tps = tokens / wall if wall > 0 else None
    else:
        busy = sum(r.end - r.sent for r in ok)
        tps = tokens / busy if busy > 0 else None
    return {
        "mode": "concurrent" if concurrent else "sequential",
        "batch_size": size,
        "avg_ttft_ms": statistics.mean(_ms(ttft(r)) for r in ok) if ok else None,
        "tokens_per_s": tps,
        "success_rate": len(ok) / size,
        "num_output_tokens": tokens,
        "requests": [r.to_dict() for r in records],
    }


async def run_all(args: argparse.Namespace, model: str, max_model_len: int | None) -> dict:
    nonce = secrets.token_hex(4)
    prefix_tokens = args.prefix_tokens
    if max_model_len is not None:
        prefix_tokens = min(prefix_tokens, int(0.7 * max_model_len))
    prefix = PromptFactory(args.seed).text(prefix_tokens)
    sizes = [int(s) for s in args.sizes.split(",")]
    async with StreamingClient(args.server, model, args.api_key, args.timeout) as client:
        cache = await cache_test(client, prefix, args.num_warm, nonce)
        batches = []
        for concurrent in (False, True):
            for size in sizes:
                if not concurrent and size > args.max_sequential:
                    continue
                batches.append(await batch_test(client, size, concurrent, args.max_tokens, nonce))
    return {"cache": cache, "batches": batches}


def result_tables(result: dict) -> list[dict]:
    """The tables (infer.bench.record.table): printed, and kept in the record."""
    c = result["cache"]
    rows = [
        ("prompt tokens (usage)", c["prompt_tokens"]),
        ("cold TTFT (ms)", c["cold_ttft_ms"]),
        ("avg warm TTFT (ms)", c["avg_warm_ttft_ms"]),
        ("speedup (%)", None if c["speedup"] is None else 100 * c["speedup"]),
        ("cold cached tokens", c["cold_cached_tokens"]),
        ("warm cached tokens", ", ".join(str(x) for x in c["warm_cached_tokens"]) or "-"),
    ]
    batch_rows = [
        [b["mode"], b["batch_size"], b["avg_ttft_ms"], b["tokens_per_s"], f"{100 * b['success_rate']:.0f}%"]
        for b in result["batches"]
    ]
    return [
        table(["Prefix cache", "Value"], rows, "== prefix cache: cold vs warm TTFT"),
        table(
            ["Mode", "Batch", "Avg TTFT ms", "Tok/s", "Success"],
            batch_rows,
            "== batches: sequential vs concurrent",
        ),
    ]


def result_plots(result: dict) -> list[dict]:
    if not result["batches"]:
        return []
    batches = result["batches"]
    return [{"title": "batches: sequential vs concurrent", "plot": "client_batches", "args": [batches]}]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default="http://127.0.0.1:8000", help="base URL of the server")
    p.add_argument("--model", default=None, help="model name; default: the server's only model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--prefix-tokens", type=int, default=2048, help="shared prefix length (capped at 70%% of context)"
    )
    p.add_argument("--num-warm", type=int, default=3, help="measured warm requests")
    p.add_argument("--sizes", default="1,2,4,8,12", help="batch sizes")
    p.add_argument("--max-sequential", type=int, default=4, help="largest sequential batch")
    p.add_argument("--max-tokens", type=int, default=50, help="tokens per batch request")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--no-save", action="store_true", help="do not write the JSON report (nor the HTML one)")
    p.add_argument("--no-report", action="store_true", help="no HTML report beside the JSON one")
    p.add_argument("--report-dir", type=Path, default=Path("benchmarks/reports"))


def cmd_client(args: argparse.Namespace, out=None) -> int:
    out = sys.stdout if out is None else out
    try:
        model, card = resolve_model(args.server, args.model, args.api_key)
    except BenchError as exc:
        print(f"bench client: error: {exc}", file=sys.stderr)
        return 1
    started = datetime.datetime.now(datetime.UTC)
    result = asyncio.run(run_all(args, model, card.get("max_model_len")))
    tables = result_tables(result)
    print(render_tables(tables), file=out)
    if not args.no_save:
        report = new_record(
            "client",
            " ".join(["infer", "bench", "client", *getattr(args, "argv", [])[2:]]),
            {k: str(v) for k, v in vars(args).items() if k not in ("func", "argv")},
            started=started.isoformat(),
            server=server_info(args.server, card, None, args.api_key),
            tables=tables,
            plots=result_plots(result),
            **result,
        )
        path = args.report_dir / f"client-{model.replace('/', '_')}-{started.strftime('%Y%m%d-%H%M%S')}.json"
        write_record(path, report, out)
        if not args.no_report:
            from infer.bench.html_report import write_run_html

            write_run_html(path, report, started, args.server, args.api_key, out)
    return 0
