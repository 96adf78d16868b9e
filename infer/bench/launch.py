"""Start a server for a benchmark, wait until it serves, and stop it with nothing left behind.

Any command works (ours, vLLM's, llama.cpp's): it runs in a session of its own, so that stopping it
reaches every process it started (vLLM's engine core is a child of its API server). Stopping is SIGTERM
to the whole group, SIGKILL to the group after `stop_timeout`, and a last SIGKILL to the group for any
child that outlived its parent.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from infer.bench.client import wait_until_ready


def free_port() -> int:
    """A TCP port nothing listens on right now (loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """`cmd` run until the server at `url` answers GET /health with 200; stopped on exit.

    `env` is added to this process's environment. Raises RuntimeError, with the log's path, when the
    command exits or the server is not healthy within `timeout` seconds (it is stopped first)."""

    def __init__(
        self,
        cmd: Sequence[str],
        url: str,
        log_path: Path,
        timeout: float = 120.0,
        env: Mapping[str, str] | None = None,
        stop_timeout: float = 15.0,
        log=None,
    ):
        self.cmd = [str(c) for c in cmd]
        self.url = url.rstrip("/")
        self.log_path, self.timeout, self.stop_timeout = Path(log_path), timeout, stop_timeout
        self.env = dict(env or {})
        self.say = log if log is not None else (lambda line: print(line, file=sys.stderr))
        self.proc: subprocess.Popen | None = None

    @classmethod
    def ours(cls, flags: Sequence[str], log_path: Path, timeout: float = 120.0) -> LaunchedServer:
        """`python -m infer.server FLAGS --port P` on a free loopback port."""
        port = free_port()
        cmd = [sys.executable, "-m", "infer.server", *map(str, flags), "--port", str(port)]
        return cls(cmd, f"http://127.0.0.1:{port}", log_path, timeout)

    def __enter__(self) -> LaunchedServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if _answers(self.url):  # else we would wait for, measure and never stop someone else's server
            raise RuntimeError(f"something already answers at {self.url}: stop it or use another port")
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        try:
            self.proc = subprocess.Popen(
                self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        except OSError as exc:  # no such executable, not executable
            self.log.close()
            raise RuntimeError(f"cannot run {self.cmd[0]!r}: {exc}") from exc
        exited = lambda: self.proc.poll() is not None
        wait_until_ready(self.url, self.timeout, self.say, give_up=exited)
        if exited():
            code = self.proc.returncode
            self.stop()
            raise RuntimeError(f"the server exited with {code}; see {self.log_path}")
        status = _answers(self.url)
        if status != 200:
            self.stop()
            why = "not reachable" if status is None else f"answering {status}"
            raise RuntimeError(f"the server was {why} after {self.timeout:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after `stop_timeout`; idempotent."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait(10)
        self._signal_group(signal.SIGKILL)  # children that outlived their parent
        self.log.close()
        self.proc = None

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)  # the session's group id is the leader's pid


def _answers(url: str) -> int | None:
    """The status of GET URL/health, None when nothing accepts the connection."""
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.TransportError:
        return None
