"""An async streaming client for any OpenAI-compatible server, and the loop that drives it with arrivals.

The client runs on aiohttp, whose HTTP parser is C: on a 2-core machine the client shares the cores with
the server it measures, and httpx (pure Python parsing and line splitting) took 92 us of CPU per streamed
chunk against aiohttp's 27: at 32 streams a third of a core taken from the server it measures.

One request = one POST /v1/completions with `stream: true` and `stream_options: {include_usage: true}`. The
client stamps, on one monotonic clock relative to the run's start: the intended send, the actual send,
every chunk that carries text (the first is the first token), and the end. Token counts are read from the
final `usage` chunk; a server that sends none leaves them None (they are never guessed from chunks).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
import httpx
import orjson

from infer.bench.arrivals import Arrivals
from infer.bench.metrics import RequestRecord


class BenchError(RuntimeError):
    """A problem the user must fix before a benchmark can run (server unreachable, unknown model)."""


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: the text to send and how many tokens to ask for."""

    prompt: str
    max_tokens: int
    req_class: str = "default"
    target_prompt_tokens: int | None = None
    extra_body: dict | None = None  # more body fields, e.g. a class's priority


JSON = {"Content-Type": "application/json"}


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def wait_until_ready(
    base_url: str,
    timeout: float = 60.0,
    log: Callable[[str], None] = print,
    give_up: Callable[[], bool] | None = None,
) -> None:
    """Wait, up to `timeout` seconds, while the server refuses connections (starting) or GET /health
    answers 503 (loading its model: ours, vLLM, llama.cpp): requests sent now would all fail. Any other
    answer returns at once; so does the timeout (check_server then says what is wrong), and so does
    `give_up()` turning true (a launcher's process that died)."""
    url = base_url.rstrip("/") + "/health"
    deadline = time.monotonic() + timeout
    told = False
    while time.monotonic() < deadline and not (give_up is not None and give_up()):
        try:
            if httpx.get(url, timeout=10).status_code != 503:
                return
            why = "still loading its model"
        except httpx.TransportError:
            why = "not accepting connections yet"
        if not told:
            log(f"waiting up to {timeout:.0f} s for {url}: the server is {why}")
            told = True
        time.sleep(0.5)


def check_server(base_url: str, model: str, api_key: str | None = None, timeout: float = 10.0) -> dict:
    """GET /v1/models; return the model's card, or raise BenchError saying what is wrong."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        resp = httpx.get(url, headers=_headers(api_key), timeout=timeout)
    except httpx.TransportError as exc:
        raise BenchError(
            f"cannot reach the server at {base_url} ({type(exc).__name__}: {exc}); is it running, "
            f"and is the URL right (e.g. http://127.0.0.1:8000)?"
        ) from exc
    if resp.status_code in (401, 403):
        raise BenchError(f"{url} answered {resp.status_code}: pass the server's key with --api-key")
    if resp.status_code != 200:
        raise BenchError(f"{url} answered {resp.status_code}: {resp.text[:300]}")
    cards = resp.json().get("data", [])
    for card in cards:
        if card.get("id") == model:
            return card
    served = ", ".join(repr(c.get("id")) for c in cards) or "none"
    raise BenchError(f"the server at {base_url} does not serve model {model!r}; it serves: {served}")


STALE_RETRIES = 4  # sends of one request on kept-alive connections the server had closed
# idle connections are dropped before a server's own keep-alive timeout closes them under a request
# (llama-server's is 5 s: between two concurrency levels a pool of 32 idle ones had all gone stale)
KEEPALIVE_S = 2.0


class ClientSession:
    """One aiohttp session for a benchmark's requests, no cap on connections (the arrivals decide
    concurrency; idle ones kept for reuse), and a clock from its creation. Use as `async with`."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._http: aiohttp.ClientSession | None = None
        self.t0 = time.perf_counter()

    async def __aenter__(self):
        timeout = aiohttp.ClientTimeout(total=None, connect=10.0)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        self._http = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._http.close()

    def now(self) -> float:
        return time.perf_counter() - self.t0


class StreamingClient(ClientSession):
    """Sends streaming completions and records what it saw. Use as `async with StreamingClient(...)`."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout: float = 600.0,
        ignore_eos: bool = True,
        temperature: float = 0.0,
    ):
        super().__init__(timeout)
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model = model
        self.headers = _headers(api_key)
        self.ignore_eos = ignore_eos  # fixed output lengths; vLLM and ours honour it, others ignore it
        self.temperature = temperature

    def body(self, spec: RequestSpec) -> dict:
        body = {
            "model": self.model,
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if spec.extra_body:
            body.update(spec.extra_body)
        return body

    async def send(self, req_id: int, spec: RequestSpec, intended_send: float) -> RequestRecord:
        """Send one request now; `intended_send` is when the arrival process wanted it sent."""
        rec = RequestRecord(
            req_id=req_id,
            intended_send=intended_send,
            req_class=spec.req_class,
            target_prompt_tokens=spec.target_prompt_tokens,
            max_tokens=spec.max_tokens,
        )
        rec.sent = self.now()
        try:
            async with asyncio.timeout(self.timeout):  # the whole request, not one read
                await self._post(spec, rec)
        except TimeoutError as exc:  # aiohttp's own timeouts are TimeoutErrors too
            rec.status = "timeout"
            rec.error = f"{type(exc).__name__}: no complete answer within {self.timeout}s"
        except (aiohttp.ClientError, ValueError) as exc:  # ValueError: an unparsable or over-long SSE line
            rec.status, rec.error = "error", f"{type(exc).__name__}: {exc}"
        except asyncio.CancelledError:
            rec.status, rec.error = "aborted", "cancelled by the client"
        rec.end = self.now()
        return rec

    async def _post(self, spec: RequestSpec, rec: RequestRecord) -> None:
        for attempt in range(STALE_RETRIES + 1):
            try:
                return await self._post_once(spec, rec)
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                if rec.http_status is not None or attempt == STALE_RETRIES:
                    raise
                # a kept-alive connection the server had closed (llama-server closes them after a few
                # requests): nothing reached it, so the request goes again, its time still counted; the
                # pool may hold several such connections

    async def _post_once(self, spec: RequestSpec, rec: RequestRecord) -> None:
        body, headers = self.body(spec), self.headers
        async with self._http.post(self.url, data=orjson.dumps(body), headers=headers | JSON) as resp:
            rec.http_status = resp.status
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")
                rec.status, rec.error = "error", _error_message(text)
            else:
                await self._read_stream(resp, rec)

    async def _read_stream(self, resp: aiohttp.ClientResponse, rec: RequestRecord) -> None:
        done = False
        async for line in resp.content:  # one SSE line a time, b"\n" included
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            t = self.now()
            event = orjson.loads(data)
            if "error" in event:  # an error after the stream started
                rec.status, rec.error = "error", _error_message(data.decode(errors="replace"))
                return
            if any(c.get("text") for c in event.get("choices") or []):
                rec.chunk_times.append(t)
                if rec.first_token is None:
                    rec.first_token = t
            if usage := event.get("usage"):
                rec.num_prompt_tokens = usage.get("prompt_tokens")
                rec.num_completion_tokens = usage.get("completion_tokens")
                details = usage.get("prompt_tokens_details") or {}
                rec.num_cached_tokens = details.get("cached_tokens")
        if not done:
            rec.status, rec.error = "error", "the stream ended without [DONE]"


def _error_message(text: str) -> str:
    try:
        err = json.loads(text).get("error", {})
        return err.get("message", text) if isinstance(err, dict) else str(err)
    except (json.JSONDecodeError, AttributeError):
        return text[:500]


async def run_requests(
    client: StreamingClient,
    specs: Sequence[RequestSpec],
    arrivals: Arrivals,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """Send every spec following `arrivals`; return one record per spec, in spec order.

    Open loop: request i is intended at run start + schedule[i]; with `max_concurrency` it may leave later
    (its dispatch delay). Closed loop: workers take the next spec as soon as they are free."""
    records: list[RequestRecord | None] = [None] * len(specs)
    start = client.now()

    def finish(i: int, rec: RequestRecord) -> None:
        records[i] = rec
        if on_done is not None:
            on_done(rec)

    if arrivals.closed_loop:
        queue = list(range(len(specs)))[::-1]

        async def worker() -> None:
            while queue:
                i = queue.pop()
                finish(i, await client.send(i, specs[i], client.now()))

        await asyncio.gather(*(worker() for _ in range(arrivals.num_workers)))
    else:
        cap = asyncio.Semaphore(arrivals.max_concurrency or len(specs) or 1)

        async def one(i: int, offset: float) -> None:
            intended = start + offset
            await asyncio.sleep(max(0.0, intended - client.now()))
            async with cap:
                finish(i, await client.send(i, specs[i], intended))

        await asyncio.gather(*(one(i, t) for i, t in enumerate(arrivals.schedule(len(specs)))))
    return records


def resolve_model(
    base_url: str, model: str | None, api_key: str | None, wait_s: float = 60.0
) -> tuple[str, dict]:
    """The model to benchmark and its card; with no --model the server must serve exactly one. A server
    still starting or loading its model is waited for, up to wait_s seconds."""
    wait_until_ready(base_url, wait_s, log=lambda line: print(line, file=sys.stderr))
    if model is not None:
        return model, check_server(base_url, model, api_key)
    try:
        resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=_headers(api_key), timeout=10)
        cards = resp.json().get("data", [])
    except (httpx.HTTPError, ValueError):
        cards = []
    if len(cards) != 1:
        check_server(base_url, "", api_key)  # raises the clear error (unreachable, or lists the models)
    return cards[0]["id"], check_server(base_url, cards[0]["id"], api_key)
