"""llguidance's grammar text, built in worker processes: the Python of a compilation, out of the engine's.

Building a grammar's text is Python: a schema's walk for its bounds, the text a regex forces, the GBNF
conversion (~0.3 s for 8 KiB). Python on any thread of the engine's process holds the GIL, and the engine
thread gives the GIL up at each torch op and must get it back: beside a thread that runs Python it waits
a switch interval (5 ms) each time, so a step of a few milliseconds takes tens. llguidance's compilation
and its masks run detached from the GIL (its Rust releases it), so they stay on the compiler's threads in
this process, where the matcher is needed (llguidance's objects do not pickle); the text, a string, comes
back from a worker process.

The workers are `python -m infer.structured_outputs.text_process`, one JSON line in and one out per
grammar (not multiprocessing, whose children import the parent's main script again: a script that
makes an LLM at its top level would make one in each). They are shared by every compiler of the process
(the text does not depend on the tokenizer), started when a compilation finds none idle (so at most as
many as compilations run at once) and kept. A worker that dies (killed, out of memory) is replaced: the
grammar goes once more to a new one, and fails with a ValueError if that one dies too. Workers run
COMPILE_NICENESS below the engine's process, as the compiling threads do (compile_pool.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from infer.structured_outputs.compile_pool import COMPILE_NICENESS
from infer.structured_outputs.constraint import StructuredOutputs

_lock = threading.Lock()
_idle: list[subprocess.Popen] = []
_all: list[subprocess.Popen] = []


def build_text(spec: StructuredOutputs) -> str:
    """llguidance's grammar text for the spec (grammar_text's, or its ValueError), from a worker process.
    Blocks the calling thread, which holds no GIL while it waits."""
    value = getattr(spec, spec.kind)
    if isinstance(value, tuple):
        value = list(value)
    options = {
        "disable_any_whitespace": spec.disable_any_whitespace,
        "disable_additional_properties": spec.disable_additional_properties,
    }
    request = json.dumps({"kind": spec.kind, "value": value, "options": options}) + "\n"
    for _ in range(2):  # a worker that died since (killed, say), then a new one
        worker = _take()
        try:
            worker.stdin.write(request.encode())
            worker.stdin.flush()
            line = worker.stdout.readline()
        except (BrokenPipeError, OSError):
            line = b""
        if not line:
            _forget(worker)
            continue
        _release(worker)
        answer = json.loads(line)
        if "text" in answer:
            return answer["text"]
        raise (ValueError if answer["refused"] else RuntimeError)(answer["error"])
    raise ValueError(
        f"structured_outputs {spec.kind}: the process building its grammar died (out of memory?)"
    )


def worker_pids() -> list[int]:
    """The worker processes alive (none before the first grammar)."""
    with _lock:
        return [w.pid for w in _all if w.poll() is None]


def _take() -> subprocess.Popen:
    with _lock:
        while _idle:
            worker = _idle.pop()
            if worker.poll() is None:
                return worker
            _all.remove(worker)
    worker = subprocess.Popen(
        [sys.executable, "-m", "infer.structured_outputs.text_process"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],  # first on its path: this infer package, whatever the cwd
    )
    with _lock:
        _all.append(worker)
    return worker


def _release(worker: subprocess.Popen) -> None:
    with _lock:
        _idle.append(worker)


def _forget(worker: subprocess.Popen) -> None:
    worker.kill()
    worker.wait()
    with _lock:
        _all.remove(worker)


def _serve() -> None:
    """A worker: each line of stdin a grammar ({"kind", "value", "options"}), each line of stdout its
    text, or why not ("refused": a ValueError, the client's; otherwise a defect). Ends at stdin's end."""
    from infer.structured_outputs.grammar_text import grammar_text

    with contextlib.suppress(OSError, AttributeError):  # below the engine's process, as compilations run
        engine = os.getpriority(os.PRIO_PROCESS, os.getppid())
        os.setpriority(os.PRIO_PROCESS, 0, min(19, engine + COMPILE_NICENESS))
    out, sys.stdout = sys.stdout, sys.stderr  # stdout carries the answers alone
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            spec = StructuredOutputs(**{request["kind"]: request["value"]}, **request["options"])
            answer = {"text": grammar_text(spec)}
        except ValueError as exc:
            answer = {"error": str(exc), "refused": True}
        except RecursionError:
            answer = {"error": "structured_outputs json is nested too deeply", "refused": True}
        except Exception as exc:  # reported to the compiling thread, which fails this grammar alone
            answer = {"error": f"{type(exc).__name__}: {exc}", "refused": False}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve()
