"""scripts/without_amx.sh: the AMD EPYC's code paths (no AMX) on an Intel CPU, for a command and every
process it starts (a race's two servers)."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "without_amx.sh"

PROBE = """
import os, subprocess, sys, torch
from infer import kernels
child = subprocess.run([sys.executable, "-c", "import torch; print(torch.cpu._is_amx_tile_supported())"],
                       capture_output=True, text=True, check=True).stdout.strip()
print(torch.cpu._is_amx_tile_supported(), kernels.cpu_has_amx(), child, os.environ["ONEDNN_MAX_CPU_ISA"],
      os.environ["INFER_KERNELS_MARCH"], "-march=cooperlake" in kernels._flags())
"""


@pytest.mark.slow  # a process under the script, that imports torch
def test_the_command_and_its_children_see_no_amx():
    out = subprocess.run(
        [str(SCRIPT), sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["False", "False", "False", "AVX512_CORE_BF16", "cooperlake", "True"]


def test_without_a_command_it_says_how_to_use_it():
    out = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "without_amx.sh COMMAND" in out.stderr
