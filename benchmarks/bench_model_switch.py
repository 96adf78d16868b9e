"""What a switch between models costs in a server that keeps one loaded: infer's --models-dir beside
llama.cpp's router (llama-server --models-dir), one server at a time, on the same folder of GGUF files.

    B=$(scripts/setup_llama_cpp.sh)
    python benchmarks/bench_model_switch.py DIR --rounds 4 \
        --peer-cmd "$B/llama-server --models-dir DIR --models-max 1 -t 2 -tb 2 -c 4096 -nr --port 8010"

Each server is started with at most one model loaded (infer: --models-max 1), then asked for one
streamed token of each of the folder's first two models in turn, --rounds times: every request after the
first is a cold switch (the other model unloads, this one loads). Then the same model twice in a row (a
warm request). Reported per server: the time to first token of the cold switches and of the warm requests
(median, min, max). README.md, "Several models", has the figures.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from infer.bench.launch import LaunchedServer, free_port

PROMPT = "The quick brown fox"


def first_token_seconds(url: str, model: str) -> float:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError(f"{model}: no token streamed")


def measure(server: LaunchedServer, names: list[str], rounds: int) -> dict[str, list[float]]:
    with server:
        served = [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]]
        models = [next(s for s in served if s.removesuffix(".gguf") == n) for n in names]
        cold, warm = [], []
        first_token_seconds(server.url, models[0])  # the first load: not a switch
        for i in range(rounds):
            cold.append(first_token_seconds(server.url, models[(i + 1) % 2]))
        for _ in range(rounds):
            warm.append(first_token_seconds(server.url, models[rounds % 2]))
    return {"cold switch": cold, "warm": warm}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models_dir", type=Path, help="a folder of .gguf files (the first two, by name, are used)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--infer-flags", default="", help="more flags for infer serve")
    p.add_argument("--peer-cmd", default=None, help="llama-server's router command line (with --port)")
    args = p.parse_args()
    names = sorted(f.stem for f in args.models_dir.glob("*.gguf"))[:2]
    if len(names) < 2:
        sys.exit(f"{args.models_dir} holds fewer than two .gguf files")
    logs = Path(tempfile.mkdtemp(prefix="model-switch-"))
    port = free_port()
    ours = [sys.executable, "-m", "infer.server", "--models-dir", str(args.models_dir), "--models-max", "1"]
    ours += [*shlex.split(args.infer_flags), "--port", str(port)]
    servers = {"infer": LaunchedServer(ours, f"http://127.0.0.1:{port}", logs / "infer.log", timeout=300)}
    if args.peer_cmd:
        peer = shlex.split(args.peer_cmd)
        peer_port = peer[peer.index("--port") + 1]
        servers["llama-server"] = LaunchedServer(
            peer, f"http://127.0.0.1:{peer_port}", logs / "peer.log", timeout=300
        )
    print(f"{platform.processor() or platform.machine()}, models {names}, {args.rounds} rounds, logs {logs}")
    print("| server | request | median s | min s | max s |\n|---|---|---:|---:|---:|")
    for name, server in servers.items():
        for kind, times in measure(server, names, args.rounds).items():
            row = [statistics.median(times), min(times), max(times)]
            print(f"| {name} | {kind} | " + " | ".join(f"{t:.3f}" for t in row) + " |")


if __name__ == "__main__":
    main()
