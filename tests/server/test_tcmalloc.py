"""`infer serve` re-executes itself with tcmalloc preloaded where installed (infer/server/tcmalloc.py)."""

import ctypes.util
import os
import subprocess
import sys

import pytest

from infer.server import tcmalloc

# Re-executes as the server's entry points do (the new image runs this script again from the top), then
# prints the PID, what is loaded, the start-up log's allocator line and LD_PRELOAD.
SCRIPT = """
import os
from infer.server import tcmalloc
tcmalloc.reexec_with_tcmalloc()
print(os.getpid(), tcmalloc.loaded(), tcmalloc.allocator().split()[0], os.environ.get("LD_PRELOAD", "-"))
"""
INSTALLED = any(map(ctypes.util.find_library, tcmalloc.NAMES))


def run(**env) -> tuple[int, list[str]]:
    env = {**{k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "INFER_TCMALLOC")}, **env}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    return proc.pid, out.split()


@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD and /proc/self/maps are Linux's")
def test_reexec_preloads_tcmalloc_where_installed_and_keeps_the_pid():
    pid, (pid_after, loaded, allocator, preload) = run()
    assert int(pid_after) == pid  # execve: the same process, as a supervisor sees it
    assert loaded == str(INSTALLED)  # installed where apt-get can: scripts/setup.sh
    assert allocator == ("tcmalloc" if INSTALLED else "glibc")
    assert ("tcmalloc" in preload) == INSTALLED


def test_reexec_can_be_turned_off():
    _, (_, loaded, allocator, preload) = run(INFER_TCMALLOC="0")
    assert (loaded, allocator, preload) == ("False", "glibc", "-")
