"""A pooling model's server sets OMP_WAIT_POLICY=PASSIVE before torch loads libgomp
(infer/server/omp_wait.py); a generation model's, or one whose user set the variable, keeps what it has."""

import json
import os
import subprocess
import sys

import pytest

from infer.server.omp_wait import prefer_passive_wait, serves_pooling

# The server's own parse (infer.server.args), then torch: libgomp prints, as it loads, how long a waiting
# thread spins before it sleeps (OMP_DISPLAY_ENV=verbose: 0 under PASSIVE, 300000 by default), and the
# script what the environment says.
SCRIPT = """
import argparse, os, sys
from infer.server.args import add_server_args, parse_server_args
parser = argparse.ArgumentParser()
add_server_args(parser, positional_model=True)
parse_server_args(parser, sys.argv[1:])
import torch
torch.ones(64).sum()
print("policy", os.environ.get("OMP_WAIT_POLICY", "-"))
"""


def model_folder(tmp_path, architecture: str):
    path = tmp_path / architecture
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    return str(path)


def test_pooling_models_by_config_runner_and_overrides(tmp_path):
    bert, llama = model_folder(tmp_path, "BertModel"), model_folder(tmp_path, "LlamaForCausalLM")
    assert serves_pooling(bert, "auto")
    assert not serves_pooling(bert, "generate")  # the engine's own check says why it cannot
    assert not serves_pooling(llama, "auto")
    assert serves_pooling(llama, "pooling")  # a decoder embedder (Qwen3-Embedding)
    reranker = json.dumps({"architectures": ["Qwen3ForSequenceClassification"]})
    assert serves_pooling(llama, "auto", reranker)  # vLLM's --hf-overrides for Qwen3-Reranker
    assert serves_pooling(llama, "auto", json.loads(reranker))
    assert not serves_pooling(str(tmp_path / "missing"), "auto")  # a hub id, a typo: not known here
    assert not serves_pooling(None, "auto")


def test_nothing_changes_once_torch_is_loaded(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert "torch" in sys.modules  # the test process: libgomp has read its environment already
    assert not prefer_passive_wait(model_folder(tmp_path, "BertModel"), "auto")
    assert "OMP_WAIT_POLICY" not in os.environ


def run_server_parse(*argv: str, **env) -> list[str]:
    env = {
        **{k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"},
        "OMP_DISPLAY_ENV": "verbose",
        **env,
    }
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *argv], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    spins = [line.split("=")[1].strip(" '") for line in proc.stderr.splitlines() if "GOMP_SPINCOUNT" in line]
    return [*spins, proc.stdout.split()[-1]]  # what libgomp read, what the environment holds


@pytest.mark.slow
def test_a_pooling_server_process_runs_libgomp_passive(tmp_path):
    bert, llama = model_folder(tmp_path, "BertModel"), model_folder(tmp_path, "LlamaForCausalLM")
    assert run_server_parse(bert) == ["0", "PASSIVE"]
    assert run_server_parse(llama) == ["300000", "-"]  # libgomp's default: spin, then sleep
    assert run_server_parse(bert, OMP_WAIT_POLICY="ACTIVE")[1] == "ACTIVE"  # the user's
