"""What a switch between models costs in a server that keeps one loaded: infer's --models-dir beside
llama.cpp's router (llama-server --models-dir), one server at a time, on the same folder.

Two models of one size, switched back and forth (the folder's first two .gguf files by name):

    B=$(scripts/setup_llama_cpp.sh)
    python benchmarks/bench_model_switch.py DIR --rounds 4 --infer-flags "--num-kv-blocks 256" \
        --peer-cmd "$B/llama-server --models-dir DIR --models-max 1 -t 2 -tb 2 -c 4096 -nr --port 8010"

Per model size: `--models A,B,...` names the measured models (a folder's or a .gguf file's name without
`.gguf`) and `--switch-from S` the one loaded before each of them (a small one); each round asks for S,
then for each measured model in turn, then for that model again:

    python benchmarks/bench_model_switch.py DIR --rounds 3 --switch-from llama-50m-Q8_0 \
        --models llama-50m-Q8_0,smollm2-135m-shape-Q8_0,qwen2.5-0.5b-shape-Q8_0,llama-3.2-1b-shape-Q8_0 \
        --infer-flags "--num-kv-blocks 256" --peer-cmd "$B/llama-server --models-dir DIR ..."

A Hugging Face folder among --models is measured by infer alone (llama-server reads GGUF files only).

Each server is started with at most one model loaded (infer: --models-max 1) and asked for one streamed
token of a short prompt at a time. Reported per server and model: the time to first token of a request
that had to load its model (a cold switch: the other model unloads, this one loads) and of the same
request again with the model loaded (warm), median, min and max over the rounds; cold - warm is what
the load costs. README.md, "Several models", has the figures.
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


def served_ids(url: str, names: list[str]) -> dict[str, str]:
    """name -> the id the server lists it under (llama.cpp's router keeps `.gguf`), for those it serves."""
    served = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
    return {n: s for n in names for s in served if s.removesuffix(".gguf") == n}


def measure_pair(server: LaunchedServer, names: list[str], rounds: int) -> dict[str, list[float]]:
    """Two models switched back and forth, then the last one again and again."""
    with server:
        ids = served_ids(server.url, names)
        models = [ids[n] for n in names]
        cold, warm = [], []
        first_token_seconds(server.url, models[0])  # the first load: not a switch
        for i in range(rounds):
            cold.append(first_token_seconds(server.url, models[(i + 1) % 2]))
        for _ in range(rounds):
            warm.append(first_token_seconds(server.url, models[rounds % 2]))
    return {f"{names[0]} <-> {names[1]}: cold switch": cold, "warm": warm}


def measure_sizes(
    server: LaunchedServer, switch_from: str, names: list[str], rounds: int
) -> dict[str, list[float]]:
    """Each model loaded right after `switch_from` (cold), then asked again (warm)."""
    times: dict[str, list[float]] = {}
    with server:
        ids = served_ids(server.url, [switch_from, *names])
        for _ in range(rounds):
            for name in names:
                if name not in ids or name == switch_from:
                    continue
                first_token_seconds(server.url, ids[switch_from])
                for kind in ("cold switch", "warm"):  # loads it, then finds it loaded
                    times.setdefault(f"{name}: {kind}", []).append(first_token_seconds(server.url, ids[name]))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models_dir", type=Path, help="a folder of .gguf files (and Hugging Face folders)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--models", default=None, help="comma-separated names to measure, one size each")
    p.add_argument("--switch-from", default=None, help="with --models: the model loaded before each")
    p.add_argument("--infer-flags", default="", help="more flags for infer serve")
    p.add_argument("--peer-cmd", default=None, help="llama-server's router command line (with --port)")
    args = p.parse_args()
    if args.models is None:
        names = sorted(f.stem for f in args.models_dir.glob("*.gguf"))[:2]
        if len(names) < 2:
            sys.exit(f"{args.models_dir} holds fewer than two .gguf files")
        run = lambda server: measure_pair(server, names, args.rounds)  # noqa: E731
    else:
        names = args.models.split(",")
        if args.switch_from is None:
            sys.exit("--models needs --switch-from: the model loaded before each measured one")
        run = lambda server: measure_sizes(server, args.switch_from, names, args.rounds)  # noqa: E731
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
    results = {name: run(server) for name, server in servers.items()}
    print("| server | request | median s | min s | max s |\n|---|---|---:|---:|---:|")
    for name, rows in results.items():
        for kind, times in rows.items():
            row = [statistics.median(times), min(times), max(times)]
            print(f"| {name} | {kind} | " + " | ".join(f"{t:.3f}" for t in row) + " |")
    if len(results) == 2:  # side by side: infer's median over llama-server's
        ours_rows, peer_rows = results.values()
        print("\n| request | infer / llama-server (medians) |\n|---|---:|")
        for kind in (k for k in ours_rows if k in peer_rows):
            ratio = statistics.median(ours_rows[kind]) / statistics.median(peer_rows[kind])
            print(f"| {kind} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
