r"""The race: our server against a peer (vLLM) on the same model, the same load, the same machine.

    infer bench race [MODEL] [--infer-flags="--max-batch-size 32"] \
        [--peer-cmd "vllm serve DIR --dtype bfloat16 --port 8010" [--peer-env KEY=VAL ...] [--peer-url URL]] \
        [--prompt-tokens 128] [--output-tokens 64] [--num-requests 32] [--concurrencies 1,8,32] [--rounds 2]
    infer bench race MODEL --workload embeddings|rerank [--input-tokens 128,512] [--batch-sizes 1,32,256] \
        [--num-requests 4] [--concurrencies 1] [--query-tokens 16] [--peer-cmd ...]

Each round starts `infer serve MODEL FLAGS`, then the peer, one at a time (never both up: they share two
cores); odd rounds go peer first, so a machine that drifts over minutes weighs on both sides alike. Per
server: wait for GET /health 200, two warm-up requests (not counted), then at each concurrency N: N
one-token requests at once on the warm-up prompts (not counted: they open the N connections the measured
requests then reuse), then N requests from N workers (closed loop), then SIGTERM (SIGKILL after
--stop-timeout) to everything it started. Without that, opening 32 connections at once cost the client
~175 ms before the server saw the first byte (AMD EPYC, 2 cores: server arrival 190 ms after the
client's send, first tokens at 249 ms; with open connections 16 and 55 ms), time the race then counted
against whichever server it measured.

Every request is a streaming /v1/completions at temperature 0 asking for exactly --output-tokens tokens
(ignore_eos). Prompts hold exactly --prompt-tokens tokens by the model's tokenizer (`exact_prompts`); both
servers get the same texts, and the counts are checked against each server's `usage`. Servers restart
between runs and no two prompts share a first KV block, so the prefix cache never serves a measured prompt.

With `--workload embeddings` (or `rerank`) the load is a pooling model's (infer.bench.pooling_workload): at
each --input-tokens T, --batch-sizes B and --concurrencies C, --num-requests requests of B texts of
exactly T tokens (special tokens included) to POST /v1/embeddings (or /v1/rerank, against one query of
--query-tokens), from C clients; documents per second and latency p50/p99. The peer is any server of
those endpoints: `vllm serve DIR --runner pooling`, `llama-server -m FILE.gguf --embeddings` (or
`--reranking`), with enough slots and a batch that holds B x T tokens.

With no --peer-cmd, the peer is `vllm serve MODEL_DIR` (with `--runner pooling` for a pooling workload)
when a `vllm` executable is on PATH; else the race says so and runs our server alone. Output: one table
(every round's tok/s or docs/s, ratio of medians, latencies' medians over rounds), a JSON record
(benchmarks/reports/race-*.json, or --out) with every request, and its HTML page beside it (unless
--no-report).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from infer.bench import pooling_workload
from infer.bench.arrivals import Arrivals
from infer.bench.client import BenchError, RequestSpec, StreamingClient, resolve_model, run_requests
from infer.bench.launch import LaunchedServer, free_port
from infer.bench.metrics import RequestRecord, summarize
from infer.bench.prompts import exact_prompts
from infer.bench.record import new_record, table, write_record
from infer.bench.report import progress_bar, render_tables, server_info

SIDES = ("infer", "peer")
DEFAULT_REPORT_DIR = Path("benchmarks/reports")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="for `infer serve MODEL`; default: embedded")
    p.add_argument("--infer-flags", default="", help='more flags for infer serve: --infer-flags="--x 1"')
    p.add_argument("--peer-cmd", default=None, help="the peer's whole command line, e.g. 'vllm serve DIR'")
    p.add_argument("--peer-env", action="append", default=[], metavar="KEY=VAL", help="peer env (repeat)")
    p.add_argument("--peer-url", default=None, help="default: 127.0.0.1 and the command's --port (8000)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="exact prompt length, BOS included")
    p.add_argument("--output-tokens", type=int, default=64, help="exact output length (ignore_eos)")
    p.add_argument(
        "--workload",
        default="generate",
        choices=["generate", *pooling_workload.WORKLOADS],
        help="generate: streamed completions; embeddings: POST /v1/embeddings; rerank: POST /v1/rerank",
    )
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per concurrency (per point: embeddings, rerank); 32 (4)")  # fmt: skip
    p.add_argument("--concurrencies", default=None,
                   help="comma-separated concurrent clients; default 1,8,32 (1)")  # fmt: skip
    p.add_argument("--input-tokens", default="128,512",
                   help="embeddings / rerank: each text's exact tokens, special tokens included")  # fmt: skip
    p.add_argument("--batch-sizes", default="1,32,256",
                   help="embeddings / rerank: texts per request, comma-separated")  # fmt: skip
    p.add_argument("--query-tokens", type=int, default=16, help="rerank: the query's exact tokens")
    p.add_argument("--rounds", type=int, default=2, help="times each server is started and measured")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per server start (not counted)")
    p.add_argument("--seed", type=int, default=0, help="which corpus texts the prompts are")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder; default: the one infer serve uses")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds for a server to be ready")
    p.add_argument("--stop-timeout", type=float, default=30.0, help="seconds after SIGTERM before SIGKILL")
    p.add_argument("--timeout", type=float, default=600.0, help="client timeout per request, seconds")
    p.add_argument("--out", type=Path, default=None, help="report path (default benchmarks/reports/...)")
    p.add_argument("--no-report", action="store_true", help="no HTML report beside the JSON one")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass(frozen=True)
class ServerSpec:
    """How to start one side; `env` is added to ours."""

    side: str
    cmd: list[str]
    url: str
    env: dict[str, str] = field(default_factory=dict)

    def describe(self) -> dict:
        return {**asdict(self), "cmd": shlex.join(self.cmd)}


# ---- pure logic ----------------------------------------------------------------------------------------


def run_order(rounds: int, sides: Sequence[str]) -> list[tuple[int, str]]:
    """(round, side) in running order: A B, B A, A B, ... (each round reverses the last)."""
    return [(r, s) for r in range(rounds) for s in (sides if r % 2 == 0 else list(sides)[::-1])]


def parse_concurrencies(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"--concurrencies must be positive integers like 1,8,32, got {text!r}")
    return values


def flag_value(flags: Sequence[str], name: str) -> str | None:
    """The value of `--name V` or `--name=V` in a command line (the last one wins), else None."""
    value = None
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif f.startswith(name + "="):
            value = f.split("=", 1)[1]
    return value


def token_counts(records: Sequence[RequestRecord], prompt_tokens: int, output_tokens: int) -> dict:
    """How many successful requests the server counted (`usage`) differently from what was asked."""
    ok = [r for r in records if r.ok]
    return {
        "prompt_tokens_seen": sorted({r.num_prompt_tokens for r in ok}, key=str),
        "num_prompt_mismatch": sum(r.num_prompt_tokens != prompt_tokens for r in ok),
        "num_output_mismatch": sum(r.num_completion_tokens != output_tokens for r in ok),
    }


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def race_figures(runs: Sequence[dict], concurrencies: Sequence[int]) -> list[dict]:
    """Per concurrency and side: every round's output tok/s (in running order), and the medians over
    rounds of ITL p50/p99 and TTFT p50; the ratio is median infer tok/s / median peer tok/s."""
    figures = []
    for c in concurrencies:
        row: dict = {"concurrency": c}
        for side in SIDES:
            sums = [x["summary"] for r in runs if r["side"] == side for x in r["results"]
                    if x["concurrency"] == c]  # fmt: skip
            row[side] = {
                "tok_s": [s["throughput"]["output_tokens_per_s"] for s in sums],
                "itl_p50_ms": _median([s["itl_ms"]["p50"] for s in sums]),
                "itl_p99_ms": _median([s["itl_ms"]["p99"] for s in sums]),
                "ttft_p50_ms": _median([s["ttft_ms"]["p50"] for s in sums]),
            }
        ours, peer = _median(row["infer"]["tok_s"]), _median(row["peer"]["tok_s"])
        row["ratio"] = ours / peer if ours is not None and peer else None
        figures.append(row)
    return figures


HEADERS = ["Model", "Conc", "infer tok/s", "peer tok/s", "ratio",
           "infer ITL p50", "infer ITL p99", "infer TTFT p50",
           "peer ITL p50", "peer ITL p99", "peer TTFT p50"]  # fmt: skip


def race_rows(figures: Sequence[dict], model: str) -> list[list]:
    def rounds(xs):
        return " / ".join(f"{x:,.1f}" for x in xs) or "-"

    rows = []
    for f in figures:
        i, p = f["infer"], f["peer"]
        ratio = "-" if f["ratio"] is None else f"{f['ratio']:.2f}"
        rows.append([model, f["concurrency"], rounds(i["tok_s"]), rounds(p["tok_s"]), ratio,
                     i["itl_p50_ms"], i["itl_p99_ms"], i["ttft_p50_ms"],
                     p["itl_p50_ms"], p["itl_p99_ms"], p["ttft_p50_ms"]])  # fmt: skip
    return rows


def notes(runs: Sequence[dict]) -> list[str]:
    """One line per failed start, failed requests, or token counts that differ from what was asked."""
    lines = []
    for r in runs:
        tag = f"round {r['round'] + 1} {r['side']}"
        if r["error"]:
            lines.append(f"{tag}: {r['error']}")
        for x in r["results"]:
            s, t = x["summary"], x["token_counts"]
            if s["num_errors"]:
                first = next(q["error"] for q in x["requests"] if q["status"] != "ok")
                lines.append(f"{tag} c={x['concurrency']}: {s['num_errors']} requests failed ({first})")
            if t["num_prompt_mismatch"] or t["num_output_mismatch"]:
                lines.append(
                    f"{tag} c={x['concurrency']}: usage counted other lengths than asked "
                    f"(prompt tokens seen {t['prompt_tokens_seen']}, {t['num_output_mismatch']} outputs off)"
                )
    return lines


def build_report(
    started: str,
    command: str,
    config: dict,
    servers: dict,
    runs: list,
    figures: list,
    tables: list[dict] = (),
    notes: list[str] = (),
) -> dict:
    return new_record("race", command, config, started=started, server=servers, tables=tables, notes=notes,
                      servers=servers, figures=figures, runs=runs)  # fmt: skip


# ---- running -------------------------------------------------------------------------------------------


async def drive(url: str, model: str, prompts: list[str], args: argparse.Namespace, label: str) -> dict:
    """Warm-up, then each concurrency on its own slice of `prompts`; one result per concurrency."""
    spec = lambda p: RequestSpec(p, args.output_tokens, "race", args.prompt_tokens)
    warm, rest = prompts[: args.warmup], prompts[args.warmup :]
    results = []
    async with StreamingClient(url, model, None, args.timeout, ignore_eos=True, temperature=0.0) as client:
        warm_records = await asyncio.gather(*(client.send(-1 - i, spec(p), 0.0) for i, p in enumerate(warm)))
        for k, c in enumerate(args.concurrencies):
            opened = []
            if warm:  # c connections open before the clock starts (the server keeps idle ones ~5 s)
                opener = [RequestSpec(warm[j % len(warm)], 1, "race", args.prompt_tokens) for j in range(c)]
                opened = await asyncio.gather(*(client.send(-100 - j, s, 0.0) for j, s in enumerate(opener)))
            specs = [spec(p) for p in rest[k * args.num_requests : (k + 1) * args.num_requests]]
            bar = progress_bar(len(specs), f"{label} c={c}", not args.no_progress)
            client.t0 = time.perf_counter()
            arrivals = Arrivals("concurrent", concurrency=c)
            records = await run_requests(client, specs, arrivals, on_done=lambda _, bar=bar: bar.update())
            bar.close()
            results.append({
                "concurrency": c,
                "connections_opened": sum(r.ok for r in opened),
                "summary": summarize(records),
                "token_counts": token_counts(records, args.prompt_tokens, args.output_tokens),
                "requests": [r.to_dict() for r in records],
            })  # fmt: skip
    return {
        "warmup": {"num_requests": len(warm), "num_ok": sum(r.ok for r in warm_records)},
        "results": results,
    }


def run_one(spec: ServerSpec, rnd: int, drive_one, rates, args, log_dir: Path, out) -> dict:
    """Start `spec`'s server, `drive_one(url, model, label)` it, stop it; a failure is recorded in the run,
    not raised. `rates(results)` says what each result measured, for the line printed after the run."""
    log_path = log_dir / f"round{rnd + 1}-{spec.side}.log"
    run = {"round": rnd, "side": spec.side, "command": shlex.join(spec.cmd), "url": spec.url,
           "log": str(log_path), "pid": None, "startup_s": None, "model": None, "server": None,
           "error": None, "warmup": None, "results": []}  # fmt: skip
    server = LaunchedServer(spec.cmd, spec.url, log_path, args.start_timeout, spec.env, args.stop_timeout)
    t0 = time.perf_counter()
    try:
        server.start()
        run["pid"], run["startup_s"] = server.proc.pid, time.perf_counter() - t0
        run["model"], card = resolve_model(spec.url, None, None)
        run["server"] = server_info(spec.url, card, None)
        run.update(drive_one(spec.url, run["model"], f"{spec.side} r{rnd + 1}"))
    except RuntimeError as exc:  # BenchError too
        run["error"] = str(exc)
    finally:
        server.stop()
    up = f"up in {run['startup_s']:.0f} s" if run["startup_s"] is not None else "did not start"
    print(f"-- round {rnd + 1} {spec.side}: {up}; {rates(run['results']) or '-'}"
          + (f"; error: {run['error']}" if run["error"] else ""), file=out, flush=True)  # fmt: skip
    return run


def generate_rates(results: list[dict]) -> str:
    return "out tok/s " + ", ".join(
        f"c={x['concurrency']} {x['summary']['throughput']['output_tokens_per_s']:,.1f}" for x in results
    )


def pooling_rates(results: list[dict]) -> str:
    docs = lambda s: "-" if s["docs_per_s"] is None else f"{s['docs_per_s']:,.1f}"
    return "docs/s " + ", ".join(
        f"{x['tokens']}x{x['batch']} c={x['concurrency']} {docs(x['summary'])}" for x in results
    )


def find_vllm() -> str | None:
    return shutil.which("vllm")


def server_specs(args: argparse.Namespace, model_dir: Path, out) -> list[ServerSpec]:
    """Ours, and the peer: --peer-cmd, else `vllm serve MODEL_DIR` when vllm is on PATH, else none."""
    flags = shlex.split(args.infer_flags)
    port = flag_value(flags, "--port") or free_port()
    model = [args.model] if args.model else []
    cmd = [sys.executable, "-m", "infer", "serve", *model, *flags, "--port", str(port)]
    specs = [ServerSpec("infer", cmd, f"http://127.0.0.1:{port}")]
    env = {}
    for item in args.peer_env:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--peer-env takes KEY=VALUE, got {item!r}")
        env[key] = value
    if args.peer_cmd:
        peer = shlex.split(args.peer_cmd)
    elif vllm := find_vllm():
        runner = ["--runner", "pooling"] if args.workload in pooling_workload.WORKLOADS else []
        peer = [vllm, "serve", str(model_dir), *runner, "--port", str(free_port())]
    else:
        print("no peer: no --peer-cmd given and no `vllm` executable on PATH; racing infer alone", file=out)
        return specs
    url = args.peer_url or f"http://127.0.0.1:{flag_value(peer, '--port') or 8000}"
    return [*specs, ServerSpec("peer", peer, url, env)]


def model_and_tokenizer(args: argparse.Namespace) -> tuple[Path, str | None]:
    """The model's path, and the tokenizer folder that overrides its own (the race's --tokenizer, else the
    one in --infer-flags; None: the model's own, as infer serve reads it: engine.tokenizer.load_tokenizer)."""
    from infer.models.loader import resolve_model_path

    flags = shlex.split(args.infer_flags)
    model = args.model or flag_value(flags, "--model")
    path = resolve_model_path(model, flag_value(flags, "--load-format") or "auto")
    return path, args.tokenizer or flag_value(flags, "--tokenizer")


POOLING_DEFAULTS = {"num_requests": 4, "concurrencies": "1"}
GENERATE_DEFAULTS = {"num_requests": 32, "concurrencies": "1,8,32"}


def resolve_defaults(args: argparse.Namespace) -> None:
    """The workload's defaults for what was not given; counts parsed and checked (ValueError)."""
    pooling = args.workload in pooling_workload.WORKLOADS
    for name, value in (POOLING_DEFAULTS if pooling else GENERATE_DEFAULTS).items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if isinstance(args.concurrencies, str):
        args.concurrencies = parse_concurrencies(args.concurrencies)
    for name in ("prompt_tokens", "output_tokens", "num_requests", "rounds", "query_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if pooling:
        args.input_tokens = pooling_workload.parse_counts(str(args.input_tokens), "--input-tokens")
        args.batch_sizes = pooling_workload.parse_counts(str(args.batch_sizes), "--batch-sizes")


def generate_race(args: argparse.Namespace, tokenizer, specs: dict, log_dir: Path, out) -> tuple:
    """Streamed completions: the runs, their figures and the table."""
    num_prompts = args.warmup + len(args.concurrencies) * args.num_requests
    prompts = exact_prompts(tokenizer, num_prompts, args.prompt_tokens, args.seed)
    drive_one = lambda url, model, label: asyncio.run(drive(url, model, prompts, args, label))
    runs = [
        run_one(specs[side], rnd, drive_one, generate_rates, args, log_dir, out)
        for rnd, side in run_order(args.rounds, list(specs))
    ]
    figures = race_figures(runs, args.concurrencies)
    title = (
        f"== race: {args.prompt_tokens} prompt + {args.output_tokens} output tokens, {args.num_requests} "
        "requests per concurrency; out tok/s per round, ratio of medians, ms (median over rounds)"
    )
    return runs, figures, table(HEADERS, race_rows(figures, args.model_label), title), notes(runs)


def pooling_race(args: argparse.Namespace, tokenizer, specs: dict, log_dir: Path, out) -> tuple:
    """Embeddings or rerank: the runs, their figures and the table. Each length's texts are a pool of
    distinct ones, as many as the largest request holds (and 64 at least), every request taking the next."""
    all_points = pooling_workload.points(args.input_tokens, args.batch_sizes, args.concurrencies)
    pool = max(64, max(args.batch_sizes))
    texts = {t: exact_prompts(tokenizer, pool, t, args.seed + t) for t in args.input_tokens}
    query = exact_prompts(tokenizer, 1, args.query_tokens, args.seed)[0] if args.workload == "rerank" else ""

    def drive_one(url: str, model: str, label: str) -> dict:
        return asyncio.run(
            pooling_workload.drive(
                url, model, args.workload, texts, query, all_points, args.num_requests, args.warmup,
                args.timeout, label, not args.no_progress,
            )
        )  # fmt: skip

    runs = [
        run_one(specs[side], rnd, drive_one, pooling_rates, args, log_dir, out)
        for rnd, side in run_order(args.rounds, list(specs))
    ]
    figures = pooling_workload.race_figures(runs, all_points)
    query_note = f" against a {args.query_tokens}-token query" if args.workload == "rerank" else ""
    title = (
        f"== race, {args.workload}: texts of exactly the tokens shown{query_note}, {args.num_requests} "
        "requests per point; docs/s per round, ratio of medians, latency ms (median over rounds)"
    )
    rows = pooling_workload.race_rows(figures, args.model_label)
    return runs, figures, table(pooling_workload.HEADERS, rows, title), pooling_workload.notes(runs)


def run(args: argparse.Namespace, argv: list[str] | None = None, out=None) -> dict:
    """Run the race described by parsed `args`; print the table to `out` (stdout); return the report."""
    from infer.engine.tokenizer import load_tokenizer

    out = sys.stdout if out is None else out
    resolve_defaults(args)
    started = datetime.datetime.now(datetime.UTC)
    model_dir, tokenizer = model_and_tokenizer(args)
    specs = {s.side: s for s in server_specs(args, model_dir, out)}
    path = args.out or DEFAULT_REPORT_DIR / f"race-{model_dir.name}-{started.strftime('%Y%m%d-%H%M%S')}.json"
    log_dir = path.with_name(path.stem + "-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    model = args.model or flag_value(shlex.split(args.infer_flags), "--model") or "embedded"
    args.model_label = Path(model).name
    race = generate_race if args.workload == "generate" else pooling_race
    runs, figures, result_table, run_notes = race(
        args, load_tokenizer(model_dir, tokenizer), specs, log_dir, out
    )
    tables = [result_table]
    lines = ["note: " + line for line in run_notes]
    print("\n" + render_tables(tables), file=out)
    for line in lines:
        print(line, file=out)
    argv = sys.argv[1:] if argv is None else argv
    config = {
        k: str(v) if isinstance(v, Path) else v
        for k, v in vars(args).items()
        if k not in ("func", "argv", "model_label")
    }
    config["tokenizer"] = tokenizer or str(model_dir)
    servers = {side: specs[side].describe() if side in specs else None for side in SIDES}
    command = shlex.join([Path(sys.argv[0]).name, *argv])
    report = build_report(started.isoformat(), command, config, servers, runs, figures, tables, lines)
    write_record(path, report, out)
    if not args.no_report:
        from infer.bench.html_report import write_html

        write_html(path, report, out=out)
    return report


def cmd_race(args: argparse.Namespace) -> int:
    try:
        run(args, getattr(args, "argv", None))
    except BenchError as exc:
        print(f"bench race: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="race.py",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return cmd_race(args)
    except ValueError as exc:
        print(f"bench race: error: {exc}", file=sys.stderr)
        return 2
