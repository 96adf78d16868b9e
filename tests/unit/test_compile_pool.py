"""CompilePool: compilations deduplicated, bounded in number (the overflow refused at once) and in time,
run a few at a time off the caller's thread, their results cached LRU by bytes. Fake compilations that
wait on events: counts and orders, no timings."""

from __future__ import annotations

import threading

import pytest

from infer.structured_outputs.compile_pool import CompilePool, CompileQueueFull, CompileTimeout


class Gated:
    """A compile function that records each call and returns (arg, its size) once its gate opens."""

    def __init__(self, sizes: dict | None = None):
        self.sizes = sizes or {}
        self.gate = threading.Event()
        self.started: list = []
        self.threads: set[str] = set()
        self.lock = threading.Lock()

    def __call__(self, arg):
        with self.lock:
            self.started.append(arg)
            self.threads.add(threading.current_thread().name)
        assert self.gate.wait(60)
        return f"compiled {arg}", self.sizes.get(arg, 1)


def test_the_overflow_is_refused_and_the_same_key_shares_one_compilation():
    compile = Gated()
    pool = CompilePool(compile, cache_bytes=100, max_compiling=1, max_queued=2)
    futures = [pool.future(k, k) for k in ("a", "b", "c")]  # one compiling, two waiting for its slot
    for k in ("d", "e"):
        with pytest.raises(CompileQueueFull, match="at most 3"):
            pool.future(k, k)
    assert pool.future("b", "b") is futures[1]  # in flight already: shared, not refused
    assert pool.num_in_flight == 3
    compile.gate.set()
    assert [f.result(60) for f in futures] == ["compiled a", "compiled b", "compiled c"]
    assert sorted(compile.started) == ["a", "b", "c"]  # each once
    assert compile.threads == {"grammar-compile"} and threading.current_thread().name not in compile.threads
    assert pool.future("a", "a").result(0) == "compiled a"  # cached: done at once
    assert pool.get("d", "d") == "compiled d"  # room again
    assert pool.num_in_flight == 0


def test_no_more_than_max_compiling_run_at_once():
    compile = Gated()
    pool = CompilePool(compile, cache_bytes=100, max_compiling=2, max_queued=8)
    futures = [pool.future(k, k) for k in range(6)]
    while len(compile.started) < 2:
        threading.Event().wait(0.01)
    assert len(compile.started) == 2  # the others wait for a slot, not for a thread
    compile.gate.set()
    assert [f.result(60) for f in futures] == [f"compiled {k}" for k in range(6)]


def test_the_cache_is_bounded_in_bytes_least_recently_used_out_first():
    compile = Gated({"a": 40, "b": 40, "c": 30, "big": 101})
    compile.gate.set()
    pool = CompilePool(compile, cache_bytes=100)
    for k in ("a", "b"):
        pool.get(k, k)
    pool.get("a", "a")  # a is now the most recent
    pool.get("c", "c")  # 110 bytes: b goes
    assert pool.cached_bytes == 70 and len(pool) == 2
    calls = len(compile.started)
    pool.get("a", "a")
    pool.get("c", "c")
    assert len(compile.started) == calls  # both still cached
    pool.get("b", "b")
    assert len(compile.started) == calls + 1  # b was evicted: compiled again
    assert pool.get("big", "big") == "compiled big"  # larger than the whole cache: used, not kept
    assert pool.cached_bytes <= 100 and "big" not in pool._cache


def test_a_compilation_past_its_time_fails_its_waiters_and_keeps_its_slot():
    compile = Gated()
    pool = CompilePool(compile, cache_bytes=100, max_compiling=1, max_queued=4, timeout_s=0.05)
    slow = pool.future("slow", "slow")
    with pytest.raises(CompileTimeout, match="it did not compile within 0.05 s"):
        slow.result(60)
    behind = pool.future("next", "next")
    assert compile.started == ["slow"]  # the timed-out one still holds the only slot
    compile.gate.set()
    assert behind.result(60) == "compiled next"
    assert "slow" not in pool._cache  # its late result is not kept: it stays refused
    assert isinstance(CompileTimeout("x"), ValueError)  # the client's 400


def test_a_failed_compilation_reaches_every_waiter_and_is_not_cached():
    calls = []

    def fail(arg):
        calls.append(arg)
        raise ValueError(f"{arg} does not compile")

    pool = CompilePool(fail, cache_bytes=100)
    for _ in range(2):
        with pytest.raises(ValueError, match="x does not compile"):
            pool.get("x", "x")
    assert calls == ["x", "x"] and pool.num_in_flight == 0


def test_bad_bounds_are_refused():
    for kwargs in ({"max_compiling": 0}, {"max_queued": -1}, {"cache_bytes": -1}, {"timeout_s": 0}):
        with pytest.raises(ValueError, match="must be positive"):
            CompilePool(lambda arg: (arg, 1), **{"cache_bytes": 1, **kwargs})


def test_compilations_run_below_the_engine_s_priority():
    # the engine's parallel regions wait at their barriers for any thread of equal priority on a core
    import os
    import sys

    from infer.structured_outputs.compile_pool import COMPILE_NICENESS

    if sys.platform != "linux":
        pytest.skip("a thread's own niceness is Linux's")
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    pool = CompilePool(lambda arg: (os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), 1), 1 << 20)
    assert pool.get("k", None) == min(19, mine + COMPILE_NICENESS)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller's is unchanged
