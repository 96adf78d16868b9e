"""Run the server under uvicorn, with a graceful drain on SIGTERM / SIGINT.

SIGTERM -> draining: /health and new requests answer 503, the listener stays open so clients get a
           clear answer instead of a refused connection; running requests go on
        -> every request finished, or --drain-timeout passed (the rest end with finish_reason
           "abort", then a short grace to flush their last chunks)
        -> uvicorn shuts down, the engine thread stops, exit 0
a second signal forces uvicorn's immediate exit.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from infer.server import tcmalloc
from infer.server.app import create_app
from infer.server.args import ServerArgs
from infer.server.header_timeout import with_header_timeout
from infer.server.server_state import ServerState

logger = logging.getLogger("infer.server")
ABORT_GRACE_S = 2.0  # after aborting on drain timeout: time for the streams to send their last chunk


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float):
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self.drain_deadline: float | None = None
        self.abort_deadline: float | None = None
        self.exit_code = 0

    def handle_exit(self, sig: int, frame) -> None:
        """Runs in the signal handler: only flags here; on_tick does the work on the event loop."""
        if self.drain_deadline is not None or not self.state.ready:
            super().handle_exit(sig, frame)  # second signal, or nothing to drain: exit now
            self._captured_signals.clear()  # exit 0, not by re-raising the signal
            return
        self.state.draining = True
        self.drain_deadline = time.monotonic() + self.drain_timeout
        logger.info(
            "%s: draining %d request(s), up to %gs; new requests get 503",
            signal.Signals(sig).name,
            self.state.num_in_flight,
            self.drain_timeout,
        )

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            now = time.monotonic()
            if self.state.num_in_flight == 0:
                logger.info("drained: no request in flight, shutting down")
                self.should_exit = True
            elif self.abort_deadline is None and now >= self.drain_deadline:
                logger.warning("drain timeout: aborting %d request(s)", self.state.num_in_flight)
                self.state.abort_all()
                self.abort_deadline = now + ABORT_GRACE_S
            elif self.abort_deadline is not None and now >= self.abort_deadline:
                self.should_exit = True
        return await super().on_tick(counter)

    def fatal(self, exc: BaseException) -> None:
        self.exit_code = 1
        self.should_exit = True


def log_config(args: ServerArgs, state: ServerState) -> None:
    if args.models is not None:  # several models: each logs itself as it loads
        models = args.models
        logger.info(
            "%d models, none loaded yet: %s; at most %s loaded, %.3g GiB; keep_alive %s",
            len(models.specs),
            ", ".join(spec.name for spec in models.specs),
            models.max_loaded or "any number",
            models.max_bytes / 2**30,
            "until evicted" if models.keep_alive_s is None else f"{models.keep_alive_s:g}s",
        )
        logger.info("ready on http://%s:%d (OpenAI API under /v1)", args.host, args.port)
        return
    llm = state.llm
    if state.pooling is not None:
        logger.info(
            "model %s (%s, %s): a pooling model (%s), max_model_len %d, %s; batches of at most %d tokens",
            args.model_name,
            llm.model_config.architecture,
            str(llm.dtype).removeprefix("torch."),
            state.task,
            llm.max_model_len,
            llm.pooler,
            llm.max_num_batched_tokens,
        )
        logger.info("ready on http://%s:%d (OpenAI API under /v1)", args.host, args.port)
        return
    shown = {k: v for k, v in dataclasses.asdict(args).items() if k != "engine"}
    shown["api_key_owners"] = len(args.api_key_owners)  # how many keys, not even their digests
    logger.info("engine config: %s", dataclasses.asdict(llm.config))
    logger.info("server config: %s", shown)
    cache = llm.cache_config
    logger.info(
        "model %s (%s, %s): max_model_len %d, KV cache %s (%s): %d blocks x %d tokens = %d tokens "
        "(%.1f MiB), prefix caching %s; scheduler: %s",
        args.model_name,
        llm.model_config.architecture,
        llm.runner.dtype,
        llm.max_model_len,
        cache.kv_cache_backend,
        str(llm.kv_cache_dtype).removeprefix("torch."),
        cache.num_blocks,
        cache.block_size,
        llm.kv_capacity_tokens,
        llm.kv_capacity_tokens * llm.kv_bytes_per_token / 2**20,
        "on" if cache.prefix_caching else "off",
        llm.scheduler_config,
    )
    quant = llm.quantization
    logger.info(
        "weights: %.1f MiB; quantization %s%s",
        quant["weight_mib"],
        quant["method"],
        f" ({quant['layers']} linear layers, kernels {quant['backends']}, LM head {quant['lm_head']})"
        if quant["layers"]
        else "",
    )
    if gguf := quant.get("gguf"):
        types = ", ".join(f"{kind} x{n}" for kind, n in gguf["tensor_types"].items())
        logger.info(
            "GGUF %s: architecture %s, tensors %s (%.1f MiB)",
            gguf["file"],
            gguf["architecture"],
            types,
            gguf["tensor_mib"],
        )
        for kind, path in gguf["paths"].items():
            logger.info("GGUF %s tensors: %s", kind, path)
    logger.info("allocator: %s", tcmalloc.allocator())
    if args.cuda_graphs:
        logger.warning("--cuda-graphs: the engine has no GPU path yet; the flag has no effect")
    logger.info("ready on http://%s:%d (OpenAI API under /v1)", args.host, args.port)


def run(args: ServerArgs, state: ServerState | None = None) -> int:
    """Serve until SIGTERM. state: an engine elsewhere (infer.deploy's replicas); default, this process's."""
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.engine.tensor_parallel_size > 1 and int(os.environ.get("RANK", "0")) > 0:
        from infer.engine.llm_engine import run_tensor_parallel_worker

        return run_tensor_parallel_worker(args.engine)  # a launcher's rank > 0: no HTTP, only the model
    server: DrainingServer | None = None

    def on_fatal(exc: BaseException) -> None:
        server.fatal(exc)

    app = create_app(args, on_ready=lambda state: log_config(args, state), on_fatal=on_fatal, state=state)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        http=with_header_timeout(AutoHTTPProtocol, args.header_timeout),
        timeout_keep_alive=args.timeout_keep_alive,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        access_log=args.log_level == "debug",
    )
    server = DrainingServer(config, app.state.server, args.drain_timeout)
    server.run()
    return server.exit_code
