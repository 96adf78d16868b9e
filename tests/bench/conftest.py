"""One of our servers for the serving-benchmark tests (the model flags of tests/server)."""

from __future__ import annotations

import pytest

from tests.server.conftest import ServerProcess, model_args  # noqa: F401 (a fixture)


@pytest.fixture(scope="session")
def bench_server(model_args, tmp_path_factory):  # noqa: F811
    """Our server on loopback: the embedded model (or a tiny stand-in), batch size 4."""
    proc = ServerProcess(
        [*model_args, "--max-batch-size", "4"], tmp_path_factory.mktemp("bench") / "server.log"
    )
    proc.start()
    yield proc
    proc.stop()
