"""The kernels' build survives a build that was killed: torch's lock file left behind must not hang it."""

from __future__ import annotations

import threading

from infer import kernels


def test_a_stale_torch_lock_does_not_hang_the_build(tmp_path, monkeypatch):
    (tmp_path / "lock").write_text("")  # what a killed build leaves: torch's FileBaton waits on it forever
    built = []

    def fake_build(directory):
        assert not (directory / "lock").exists(), "the stale lock was still there when the build ran"
        built.append(directory)
        (directory / "READY").write_text("")

    monkeypatch.setattr(kernels, "_build", fake_build)
    worker = threading.Thread(target=kernels._build_once, args=(tmp_path,), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive() and built == [tmp_path]


def test_a_finished_build_is_not_repeated_by_a_waiter(tmp_path, monkeypatch):
    (tmp_path / "READY").write_text("")  # built by the process this one waited for
    monkeypatch.setattr(kernels, "_build", lambda directory: (_ for _ in ()).throw(AssertionError("rebuilt")))
    kernels._build_once(tmp_path)
