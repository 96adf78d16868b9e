"""Several models in one server: each loads on its first request, unloads when idle, within the bounds.

Each loaded model is a ServerState of its own (its AsyncEngine, its KV pool, its metrics under its
`model_name` label); the routes ask `acquire(name)` for it. A model is in one of four states:

    unloaded --acquire / POST /models/load--> loading --> loaded --evicted / keep_alive / unload--> unloading
       ^                                         | a failed load: its requests get the error       |
       +-----------------------------------------+-------------------------------------------------+

- Loading runs on the model's own engine thread (ServerState.load): the event loop and the other engines
  go on. Every request for a loading model awaits the one load task, so concurrent first requests load it
  once; the first client leaving does not cancel it.
- A lease is held from `acquire` until the HTTP response has been sent whole (ModelLeases, an ASGI
  middleware): a streaming response too. A model with a lease is never unloaded.
- Before a load, room is made at once (no await between the decision and the reservation): the least
  recently used idle models are picked until the count (--models-max) and the bytes (--models-memory-gb:
  weights + KV pool, estimated before loading, the engine's own figures after) fit; if they cannot, the
  request is a 503 with Retry-After and nothing is unloaded. The new model is built only once every
  unload has finished, so two models' memory never overlaps beyond the bound.
- keep_alive (Ollama's): when a model's last lease ends it stays loaded that long (the last request's
  keep_alive; a request without one sets the model's own, or --keep-alive), 0 unloads it at once, None
  keeps it until evicted.
- Unloading stops the engine thread and drops every reference to the engine (the KV pool's and the
  weights' tensors go with it); the garbage collector runs only if a cycle still holds the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import logging
import time
import weakref
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from pydantic import BaseModel, ConfigDict

from infer.engine.pooling import model_task
from infer.server.args import ServerArgs
from infer.server.metrics import Metrics
from infer.server.model_specs import ModelSpec, estimated_bytes, parse_keep_alive
from infer.server.protocol import APIError, bad_request, overloaded
from infer.server.server_state import LEASES_KEY, ServerState

logger = logging.getLogger("infer.server")
UNLOADED, LOADING, LOADED, UNLOADING = "unloaded", "loading", "loaded", "unloading"


@dataclasses.dataclass(eq=False)
class ModelEntry:
    spec: ModelSpec
    args: ServerArgs  # the server's flags with this model's engine
    metrics: Metrics  # kept across loads: its counters go on
    estimate: int  # bytes, before loading
    status: str = UNLOADED
    state: ServerState | None = None
    task: asyncio.Task | None = None  # the load or unload under way
    num_bytes: int = 0  # what it holds (or has reserved) against the bound
    leases: int = 0
    last_used: int = 0  # a tick of the manager's clock: the LRU order
    keep_alive_s: float | None = None
    expiry: asyncio.TimerHandle | None = None
    error: str | None = None  # why the last load failed

    @property
    def name(self) -> str:
        return self.spec.name


def _task(spec: ModelSpec) -> str | None:
    """What a model not loaded is for, from its config.json; None for a hub id not fetched yet (its load
    would fetch it), or a model that cannot load (its load says why)."""
    model = spec.engine.model
    if model not in (None, "", "embedded") and not Path(model).expanduser().exists():
        return None
    try:
        return model_task(spec.engine) or "generate"
    except ValueError:
        return None


class ModelManager:
    """The models of one server, on the event loop. Stands where ServerState stands for the app and the
    launcher (ready, draining, num_in_flight, abort_all, shutdown, metrics)."""

    def __init__(self, args: ServerArgs):
        assert args.models is not None
        self.args = args
        self.max_loaded = args.models.max_loaded
        self.max_bytes = args.models.max_bytes
        self.entries: dict[str, ModelEntry] = {}
        for spec in args.models.specs:
            own = dataclasses.replace(args, engine=spec.engine, served_model_name=spec.name, models=None)
            self.entries[spec.name] = ModelEntry(
                spec, own, Metrics(spec.name), estimated_bytes(spec.engine), keep_alive_s=spec.keep_alive_s
            )
        self.metrics = ModelMetrics(self)
        self.ready = False
        self._draining = False
        self._clock = itertools.count(1)
        self.num_loads = 0  # engines built, in all (a test counts them)

    # -- what the app and the launcher read ------------------------------------------------------------

    async def load(self, on_fatal=None) -> None:
        """Nothing loads at start: each model on its first request."""
        self.ready = True

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        for entry in self.entries.values():
            if entry.state is not None:
                entry.state.draining = value

    @property
    def num_in_flight(self) -> int:
        return sum(e.state.num_in_flight for e in self.entries.values() if e.state is not None)

    @property
    def num_loaded(self) -> int:
        return sum(e.status == LOADED for e in self.entries.values())

    @property
    def num_bytes(self) -> int:
        """Bytes held or reserved against --models-memory-gb (a model being unloaded is already free)."""
        return sum(e.num_bytes for e in self.entries.values() if e.status in (LOADED, LOADING))

    def abort_all(self) -> None:
        for entry in self.entries.values():
            if entry.state is not None:
                entry.state.abort_all()

    def shutdown(self) -> None:
        for entry in self.entries.values():
            if entry.state is not None:
                entry.state.shutdown()

    def cards(self, created: int) -> list[dict]:
        return [self.card(entry, created) for entry in self.entries.values()]

    def card(self, entry: ModelEntry, created: int) -> dict:
        """OpenAI's model object, with llama.cpp router's `status` and the bytes it holds or would."""
        status: dict = {"value": entry.status}
        if entry.error is not None and entry.status == UNLOADED:
            status["error"] = entry.error
        card = {"id": entry.name, "object": "model", "created": created, "owned_by": "infer",
                "root": Path(entry.spec.engine.model or "embedded").name, "parent": None, "status": status,
                "memory_bytes": entry.num_bytes if entry.status == LOADED else entry.estimate}  # fmt: skip
        if entry.status == LOADED:
            card["max_model_len"] = entry.state.llm.max_model_len
        task = entry.state.task if entry.status == LOADED else _task(entry.spec)
        if task is not None:
            card["task"] = task  # generate, embed (an embedding model) or classify (a cross-encoder)
        return card

    def entry(self, name: str | None) -> ModelEntry:
        if name is None:
            raise bad_request(f"name a `model`; this server serves {self._names()}", param="model")
        entry = self.entries.get(name)
        if entry is None:
            raise APIError(
                404,
                f"The model `{name}` does not exist; this server serves {self._names()} (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        return entry

    def _names(self) -> str:
        return ", ".join(f"`{name}`" for name in self.entries)

    # -- leases ------------------------------------------------------------------------------------------

    async def acquire(self, name: str | None, keep_alive=None, leases: list | None = None) -> ServerState:
        """The model's state, loaded if it was not. With `leases` (the ASGI scope's list), the model is
        held until the response has been sent; keep_alive (Ollama's) then applies."""
        if self._draining:
            raise APIError(
                503, "the server is shutting down and admits no new requests", "service_unavailable"
            )
        entry = self.entry(name)
        try:  # as Ollama: each request sets it, one without it the model's default
            own = entry.spec.keep_alive_s
            entry.keep_alive_s = own if keep_alive is None else parse_keep_alive(keep_alive)
        except ValueError as exc:
            raise bad_request(str(exc), param="keep_alive") from exc
        if leases is not None:
            entry.leases += 1
            leases.append(lambda: self.release(entry))
        self._touch(entry)
        await self.loaded(entry)
        return entry.state

    def release(self, entry: ModelEntry) -> None:
        entry.leases -= 1
        self._touch(entry)
        if entry.leases == 0 and entry.status == LOADED:
            self._schedule_expiry(entry)

    def _touch(self, entry: ModelEntry) -> None:
        entry.last_used = next(self._clock)
        if entry.expiry is not None:
            entry.expiry.cancel()
            entry.expiry = None

    def _schedule_expiry(self, entry: ModelEntry) -> None:
        if entry.keep_alive_s is None:
            return
        if entry.keep_alive_s == 0:
            self.unload(entry)
            return
        entry.expiry = asyncio.get_running_loop().call_later(entry.keep_alive_s, self._expire, entry)

    def _expire(self, entry: ModelEntry) -> None:
        entry.expiry = None
        if entry.leases == 0 and entry.status == LOADED:
            logger.info("model %s: idle for its keep_alive (%gs), unloading", entry.name, entry.keep_alive_s)
            self.unload(entry)

    # -- loading and unloading ------------------------------------------------------------------------------

    async def loaded(self, entry: ModelEntry) -> None:
        """Wait until the entry is loaded: join the load under way, or start one (after an unload under
        way ends). Raises the load's error (APIError) to every waiter."""
        while entry.status != LOADED:
            if entry.task is None:
                self._make_room(entry)  # 503 here, before anything is unloaded or reserved
                entry.task = asyncio.create_task(self._load(entry))
            await asyncio.shield(entry.task)  # a client that leaves does not cancel the load

    def _make_room(self, entry: ModelEntry) -> None:
        """Pick the LRU idle models to unload so that `entry` fits, start their unloads and reserve its
        bytes, without awaiting; or raise 503 and change nothing."""
        need = entry.estimate
        if need > self.max_bytes:
            raise self._no_room(entry, f"it needs {_gib(need)} (weights + KV pool), more than the bound")
        resident = [e for e in self.entries.values() if e.status in (LOADED, LOADING)]
        idle = [e for e in resident if e.status == LOADED and e.leases == 0]
        idle.sort(key=lambda e: e.last_used)
        count, held, victims = len(resident), sum(e.num_bytes for e in resident), []
        while (self.max_loaded is not None and count + 1 > self.max_loaded) or held + need > self.max_bytes:
            if not idle:
                busy = [e.name for e in resident if e not in victims]
                raise self._no_room(
                    entry,
                    f"{_gib(held)} and {count} model(s) stay loaded with requests running or loading "
                    f"({', '.join(busy)})",
                )
            victim = idle.pop(0)
            victims.append(victim)
            count, held = count - 1, held - victim.num_bytes
        for victim in victims:
            logger.info("model %s: unloading (least recently used idle) to load %s", victim.name, entry.name)
            self.unload(victim)
        entry.status, entry.num_bytes, entry.error = LOADING, need, None

    def _no_room(self, entry: ModelEntry, why: str) -> APIError:
        bound = f"--models-memory-gb {self.max_bytes / 2**30:.3g}" + (
            f", --models-max {self.max_loaded}" if self.max_loaded is not None else ""
        )
        return overloaded(f"cannot load `{entry.name}` within {bound}: {why}", 503, "model_capacity_exceeded")

    async def _load(self, entry: ModelEntry) -> None:
        try:
            pending = [e.task for e in self.entries.values() if e.status == UNLOADING and e.task is not None]
            await asyncio.gather(*pending, return_exceptions=True)  # their memory is free before ours
            started = time.monotonic()
            state = ServerState(entry.args)
            state.metrics = entry.metrics
            state.warm_up = False  # a request is waiting: no 30 s of graph capture before its first token
            state.draining = self._draining
            self.num_loads += 1
            try:
                await state.load()
            except Exception as exc:
                state.engine = None
                entry.status, entry.num_bytes = UNLOADED, 0
                entry.error = f"{type(exc).__name__}; see the server log"  # no paths for clients
                logger.error("model %s could not be loaded: %s: %s", entry.name, type(exc).__name__, exc)
                raise APIError(
                    500,
                    f"the model `{entry.name}` could not be loaded: {entry.error}",
                    "server_error",
                    code="model_load_failed",
                ) from exc
            entry.state, entry.status = state, LOADED
            entry.metrics.engine = state.llm
            entry.num_bytes = engine_bytes(state)
            logger.info(
                "model %s loaded in %.1fs: %s (estimated %s)",
                entry.name, time.monotonic() - started, _gib(entry.num_bytes), _gib(entry.estimate),
            )  # fmt: skip
            self._trim(entry)
        finally:
            entry.task = None
        # loaded by POST /models/load, or every waiter left: its keep_alive runs from now
        if entry.leases == 0 and entry.status == LOADED:
            self._schedule_expiry(entry)

    def _trim(self, loaded: ModelEntry) -> None:
        """The engine held more than estimated: unload idle models (LRU) until the bound holds again, as
        far as idle ones allow."""
        idle = sorted(
            (e for e in self.entries.values() if e.status == LOADED and e.leases == 0 and e is not loaded),
            key=lambda e: e.last_used,
        )
        while self.num_bytes > self.max_bytes and idle:
            victim = idle.pop(0)
            logger.info("model %s: unloading (least recently used idle): over the memory bound", victim.name)
            self.unload(victim)

    def unload(self, entry: ModelEntry) -> asyncio.Task | None:
        """Start unloading a loaded model (its requests must have ended); the task, or None if it was not
        loaded."""
        if entry.status != LOADED:
            return entry.task if entry.status == UNLOADING else None
        if entry.expiry is not None:
            entry.expiry.cancel()
            entry.expiry = None
        state, entry.state, entry.status = entry.state, None, UNLOADING
        entry.metrics.engine = None
        entry.task = asyncio.create_task(self._unload(entry, state))
        return entry.task

    async def _unload(self, entry: ModelEntry, state: ServerState) -> None:
        try:
            await asyncio.to_thread(_release, state)
        finally:
            entry.status, entry.num_bytes, entry.task = UNLOADED, 0, None
            logger.info("model %s unloaded", entry.name)


def _release(state: ServerState) -> None:
    """Stop the engine thread and drop the engine: its KV pool and weights are freed with it, by reference
    counting. A full garbage collection (a server's heap: ~0.1-0.8 s, in the way of the next load) runs
    only if something still holds the engine in a cycle."""
    state.shutdown()
    engine = weakref.ref(state.llm)
    state.engine = state.pooling = None
    state.token_texts.clear()
    if engine() is not None:
        gc.collect()


def engine_bytes(state: ServerState) -> int:
    """What a loaded engine holds: its weights and its KV pool, by its own accounting."""
    llm = state.llm
    pool = llm.cache_config.num_blocks * llm.cache_config.block_size * llm.kv_bytes_per_token
    return int(llm.quantization["weight_mib"] * 2**20) + pool


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.3g} GiB" if num_bytes >= 2**28 else f"{num_bytes / 2**20:.3g} MiB"


class ModelMetrics:
    """/metrics over every model: each model's own registry, merged into one family per metric name. Each
    sample names its model twice: `model_name` (vLLM's label: its dashboards work unchanged) and `model`
    (the request field's name, as a router's dashboards group by it)."""

    def __init__(self, manager: ModelManager):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_MergedCollector(manager))

    def render(self, accept: str | None) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


class _MergedCollector:
    def __init__(self, manager: ModelManager):
        self.manager = manager

    def collect(self):
        merged: dict[str, Metric] = {}
        for entry in self.manager.entries.values():
            for family in entry.metrics.registry.collect():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type)
                into.samples.extend(
                    sample._replace(labels={**sample.labels, "model": sample.labels["model_name"]})
                    for sample in family.samples
                )
        yield from merged.values()


class ModelLeases:
    """ASGI middleware: what `acquire` leased for a request is released as its response's last bytes are
    handed over (before them: a client that has read a stream's end may ask for another model at once and
    must find this one idle), or when the app returns however it ended (a disconnect, an error)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        releases = scope.setdefault(LEASES_KEY, [])

        def release_all() -> None:
            for release in releases:
                release()
            releases.clear()

        async def send_releasing(message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                release_all()
            await send(message)

        try:
            await self.app(scope, receive, send_releasing)
        finally:
            release_all()


class ModelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str


router = APIRouter()


@router.get("/models")
async def list_models(request: Request) -> JSONResponse:
    """llama.cpp router's listing: every model with its status."""
    manager: ModelManager = request.app.state.models
    return JSONResponse({"object": "list", "data": manager.cards(request.app.state.created)})


@router.post("/models/load")
async def load_model(body: ModelRequest, request: Request) -> JSONResponse:
    """Load a model now (it then idles for its keep_alive); answers once it is loaded."""
    manager: ModelManager = request.app.state.models
    entry = manager.entry(body.model)
    await manager.acquire(body.model)
    return JSONResponse({"success": True, "model": manager.card(entry, request.app.state.created)})


@router.post("/models/unload")
async def unload_model(body: ModelRequest, request: Request) -> JSONResponse:
    """Unload a model now; 409 while it has requests running (they are never cut off)."""
    manager: ModelManager = request.app.state.models
    entry = manager.entry(body.model)
    if entry.leases > 0:
        raise APIError(
            409,
            f"the model `{entry.name}` has {entry.leases} request(s) running; unload it once they end",
            "invalid_request_error",
            code="model_busy",
        )
    while entry.status == LOADING and entry.task is not None:  # a load under way: unload what it loads
        await asyncio.shield(entry.task)
    task = manager.unload(entry)
    if task is not None:
        await asyncio.shield(task)
    return JSONResponse({"success": True, "model": manager.card(entry, request.app.state.created)})
