"""The embeddings and rerank workloads: requests of B inputs of exactly T tokens each against any server's
`POST /v1/embeddings` or `POST /v1/rerank` (ours, vLLM's pooling runner, llama-server's `--embeddings` /
`--reranking`); documents per second and latency percentiles per (T, B, concurrency).

An embeddings request is OpenAI's, `{"model", "input": [B texts], "encoding_format": "float"}`; a rerank
request Jina's and Cohere's, `{"model", "query", "documents": [B texts], "top_n": B}`, with one short
query (--query-tokens) for every request. A request counts as done when its answer holds B vectors (or
B results); the token count is the server's `usage.prompt_tokens`. Documents per second = documents
answered / (last answer - first send) at that point, from one clock; latency is per request, from its send.

Each point (T, B, C) sends --num-requests requests from C workers (closed loop), each request's B texts
the next ones of a pool of distinct texts, so no two inputs of one request are the same text.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import aiohttp
import orjson

from infer.bench.client import JSON, STALE_RETRIES, ClientSession, _error_message, _headers
from infer.bench.metrics import distribution
from infer.bench.report import progress_bar

WORKLOADS = ("embeddings", "rerank")
PATHS = {"embeddings": "/v1/embeddings", "rerank": "/v1/rerank"}
SIDES = ("infer", "peer")


@dataclass(frozen=True)
class Point:
    """One measured setting: texts of `tokens` tokens, `batch` of them per request, `concurrency` workers."""

    tokens: int
    batch: int
    concurrency: int


def points(token_counts: Sequence[int], batches: Sequence[int], concurrencies: Sequence[int]) -> list[Point]:
    return [Point(t, b, c) for t in token_counts for b in batches for c in concurrencies]


def parse_counts(text: str, flag: str) -> list[int]:
    """`1,32,256` -> [1, 32, 256]; ValueError naming the flag for anything else."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes positive integers like 1,32,256, got {text!r}")
    return values


@dataclass
class PoolingRecord:
    """What the client saw of one pooling request; times in seconds on the run's clock."""

    req_id: int
    num_inputs: int
    sent: float | None = None
    end: float | None = None
    status: str = "ok"
    http_status: int | None = None
    error: str | None = None
    num_prompt_tokens: int | None = None  # usage.prompt_tokens
    num_results: int | None = None  # vectors (or rerank results) in the answer

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        return asdict(self)


class PoolingClient(ClientSession):
    """Sends embeddings or rerank requests and records what it saw. Use as `async with`."""

    def __init__(self, base_url: str, model: str, workload: str, api_key: str | None = None,
                 timeout: float = 600.0, query: str = ""):  # fmt: skip
        if workload not in WORKLOADS:
            raise ValueError(f"unknown pooling workload {workload!r}; expected one of {', '.join(WORKLOADS)}")
        super().__init__(timeout)
        self.url = base_url.rstrip("/") + PATHS[workload]
        self.model, self.workload, self.query = model, workload, query
        self.headers = _headers(api_key) | JSON

    def body(self, texts: Sequence[str]) -> dict:
        if self.workload == "embeddings":
            return {"model": self.model, "input": list(texts), "encoding_format": "float"}
        return {"model": self.model, "query": self.query, "documents": list(texts), "top_n": len(texts)}

    async def send(self, req_id: int, texts: Sequence[str]) -> PoolingRecord:
        rec = PoolingRecord(req_id=req_id, num_inputs=len(texts))
        data = orjson.dumps(self.body(texts))
        rec.sent = self.now()
        try:
            async with asyncio.timeout(self.timeout):
                await self._post(data, rec)
        except TimeoutError as exc:
            rec.status, rec.error = "timeout", f"{type(exc).__name__}: no answer within {self.timeout}s"
        except (aiohttp.ClientError, ValueError) as exc:
            rec.status, rec.error = "error", f"{type(exc).__name__}: {exc}"
        rec.end = self.now()
        return rec

    async def _post(self, data: bytes, rec: PoolingRecord) -> None:
        for attempt in range(STALE_RETRIES + 1):
            try:
                async with self._http.post(self.url, data=data, headers=self.headers) as resp:
                    rec.http_status = resp.status
                    text = await resp.read()
                break
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                if rec.http_status is not None or attempt == STALE_RETRIES:
                    raise  # else a kept-alive connection the server had closed: nothing reached it
        if rec.http_status != 200:
            rec.status, rec.error = "error", _error_message(text.decode(errors="replace"))
            return
        read_answer(orjson.loads(text), rec)


def read_answer(answer: dict, rec: PoolingRecord) -> None:
    """Fill `rec` from a 200 answer: its count of vectors or results, and usage; an answer that does not
    hold one per input is an error."""
    items = answer.get("data") if "data" in answer else answer.get("results")
    rec.num_results = len(items) if isinstance(items, list) else None
    rec.num_prompt_tokens = (answer.get("usage") or {}).get("prompt_tokens")
    if rec.num_results != rec.num_inputs:
        rec.status = "error"
        rec.error = f"{rec.num_results} results for {rec.num_inputs} inputs"


async def run_point(
    client: PoolingClient, batches: Sequence[Sequence[str]], concurrency: int,
    on_done: Callable[[PoolingRecord], None] | None = None,
) -> list[PoolingRecord]:  # fmt: skip
    """Send every batch from `concurrency` workers, each taking the next batch when free (closed loop);
    one record per batch, in order."""
    records: list[PoolingRecord | None] = [None] * len(batches)
    queue = list(range(len(batches)))[::-1]

    async def worker() -> None:
        while queue:
            i = queue.pop()
            records[i] = await client.send(i, batches[i])
            if on_done is not None:
                on_done(records[i])

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


def batches_of(texts: Sequence[str], batch: int, num_requests: int, start: int = 0) -> list[list[str]]:
    """`num_requests` lists of `batch` consecutive texts from `texts`, from `start` on, wrapping around."""
    if not texts:
        raise ValueError("no texts to send")
    n = len(texts)
    return [[texts[(start + r * batch + i) % n] for i in range(batch)] for r in range(num_requests)]


# ---- figures -------------------------------------------------------------------------------------------


def summarize(records: Sequence[PoolingRecord]) -> dict:
    """Documents per second over the point's span (first send to last answer), and latency in ms."""
    ok = [r for r in records if r.ok]
    docs = sum(r.num_inputs for r in ok)
    tokens = sum(r.num_prompt_tokens or 0 for r in ok)
    sent = [r.sent for r in records if r.sent is not None]
    ends = [r.end for r in records if r.end is not None]
    span = max(ends) - min(sent) if sent and ends else None
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(records) - len(ok),
        "num_docs": docs,
        "duration_s": span,
        "docs_per_s": docs / span if span else None,
        "prompt_tokens_per_s": tokens / span if span else None,
        "latency_ms": distribution([1000 * (r.end - r.sent) for r in ok]),
    }


def token_counts(records: Sequence[PoolingRecord], point: Point, workload: str) -> dict:
    """Answers whose `usage.prompt_tokens` differs from batch x tokens (embeddings only: a rerank's
    count also holds the query, once or per pair as the server does it)."""
    ok = [r for r in records if r.ok]
    expected = point.batch * point.tokens
    return {
        "prompt_tokens_seen": sorted({r.num_prompt_tokens for r in ok}, key=str),
        "expected": expected if workload == "embeddings" else None,
        "num_prompt_mismatch": sum(r.num_prompt_tokens != expected for r in ok)
        if workload == "embeddings"
        else 0,
    }


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def race_figures(runs: Sequence[dict], all_points: Sequence[Point]) -> list[dict]:
    """Per point and side: every round's docs/s (running order), the medians over rounds of latency
    p50/p99; the ratio is median infer docs/s / median peer docs/s."""
    figures = []
    for p in all_points:
        row: dict = asdict(p)
        for side in SIDES:
            sums = [x["summary"] for r in runs if r["side"] == side for x in r["results"]
                    if Point(x["tokens"], x["batch"], x["concurrency"]) == p]  # fmt: skip
            row[side] = {
                "docs_s": [s["docs_per_s"] for s in sums if s["docs_per_s"] is not None],
                "latency_p50_ms": _median([s["latency_ms"]["p50"] for s in sums]),
                "latency_p99_ms": _median([s["latency_ms"]["p99"] for s in sums]),
            }
        ours, peer = _median(row["infer"]["docs_s"]), _median(row["peer"]["docs_s"])
        row["ratio"] = ours / peer if ours is not None and peer else None
        figures.append(row)
    return figures


HEADERS = ["Model", "Tokens", "Batch", "Conc", "infer docs/s", "peer docs/s", "ratio",
           "infer p50 ms", "infer p99 ms", "peer p50 ms", "peer p99 ms"]  # fmt: skip


def race_rows(figures: Sequence[dict], model: str) -> list[list]:
    def rounds(xs):
        return " / ".join(f"{x:,.1f}" for x in xs) or "-"

    rows = []
    for f in figures:
        i, p = f["infer"], f["peer"]
        ratio = "-" if f["ratio"] is None else f"{f['ratio']:.2f}"
        rows.append([model, f["tokens"], f["batch"], f["concurrency"], rounds(i["docs_s"]),
                     rounds(p["docs_s"]), ratio, i["latency_p50_ms"], i["latency_p99_ms"],
                     p["latency_p50_ms"], p["latency_p99_ms"]])  # fmt: skip
    return rows


def notes(runs: Sequence[dict]) -> list[str]:
    """One line per failed start, failed requests, or token counts other than asked."""
    lines = []
    for r in runs:
        tag = f"round {r['round'] + 1} {r['side']}"
        if r["error"]:
            lines.append(f"{tag}: {r['error']}")
        for x in r["results"]:
            at = f"{tag} {x['tokens']} tokens x {x['batch']} c={x['concurrency']}"
            s, t = x["summary"], x["token_counts"]
            if s["num_errors"]:
                first = next(q["error"] for q in x["requests"] if q["status"] != "ok")
                lines.append(f"{at}: {s['num_errors']} requests failed ({first})")
            if t["num_prompt_mismatch"]:
                lines.append(
                    f"{at}: usage counted {t['prompt_tokens_seen']} prompt tokens, not {t['expected']}"
                )
    return lines


# ---- one server ----------------------------------------------------------------------------------------


async def drive(
    url: str, model: str, workload: str, texts: dict[int, list[str]], query: str, all_points: Sequence[Point],
    num_requests: int, warmup: int, timeout: float, label: str = "", progress: bool = False,
) -> dict:  # fmt: skip
    """Warm-up (`warmup` requests of 8 of the shortest texts, not counted), then each point in turn."""
    results = []
    async with PoolingClient(url, model, workload, timeout=timeout, query=query) as client:
        shortest = texts[min(texts)]
        warm = [await client.send(-1 - i, b) for i, b in enumerate(batches_of(shortest, 8, warmup))]
        for k, p in enumerate(all_points):
            batches = batches_of(texts[p.tokens], p.batch, num_requests, start=k * p.batch)
            bar = progress_bar(len(batches), f"{label} {p.tokens}x{p.batch} c={p.concurrency}", progress)
            client.t0 = time.perf_counter()
            records = await run_point(client, batches, p.concurrency, lambda _, bar=bar: bar.update())
            bar.close()
            results.append({
                **asdict(p),
                "summary": summarize(records),
                "token_counts": token_counts(records, p, workload),
                "requests": [r.to_dict() for r in records],
            })  # fmt: skip
    return {"warmup": {"num_requests": len(warm), "num_ok": sum(r.ok for r in warm)}, "results": results}
