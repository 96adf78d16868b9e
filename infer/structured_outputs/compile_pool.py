"""CompilePool: compilations that are few at a time, bounded in number and time, and cached by bytes.

A client that floods the server with distinct grammars must not take its CPU, its memory or everyone
else's turn. So:

    future(key, arg)   the cached result (done), the same key's compilation in flight (shared), or a
                       new one admitted: CompileQueueFull (the server's 429) when max_compiling +
                       max_queued distinct keys are already in flight
    a compilation      waits in a queue for one of max_compiling worker threads, which runs it on a
                       thread of its own (a deep stack: llguidance compiles recursively) and waits for
                       it; past timeout_s its waiters get CompileTimeout (a ValueError: the client's
                       400) while its worker keeps waiting, so slow ones never run more than
                       max_compiling at once
    the cache          LRU by the bytes compile() reports for each result, at most cache_bytes
    the CPU            the worker threads (and the compile threads they start) run COMPILE_NICENESS
                       below the process's priority, so the engine's threads keep the cores while
                       they are busy, and a compilation takes what is left

A waiter on an event loop holds no thread, nor does a queued compilation. A Future is done or shared,
never cancelled (it is running from the start), so a client that goes away leaves the compilation to the
others waiting for it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import queue
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

# llguidance compiles a grammar recursively, 3-7 KB of stack per level of rules that refer to rules:
# 3,000 chained Lark rules (30 KB) or $refs of a JSON schema overflow a thread's 8 MiB stack, and the
# process dies (SIGSEGV). Each compilation runs on a thread of its own with this stack, of which the
# deepest grammars of MAX_GRAMMAR_CHARS take ~730 MB (100,000 chained rules): pages are mapped only
# once touched, and unmapped when the thread ends.
COMPILE_STACK_BYTES = 2 << 30
_stack_size_lock = threading.Lock()
# A decode step's torch ops are parallel regions over every core, each ending at a barrier: a thread of
# equal priority burning a core (a compilation) makes each region wait for a time slice, and the step
# takes several times as long; at niceness 10 the kernel gives it the core only when the engine leaves one.
COMPILE_NICENESS = 10


class CompileQueueFull(Exception):
    """Too many distinct compilations in flight: retry later (HTTP 429)."""


class CompileTimeout(ValueError):
    """A compilation ran past its time bound (HTTP 400: the grammar is the client's)."""


class CompilePool:
    def __init__(
        self,
        compile: Callable[[object], tuple[object, int]],
        cache_bytes: int,
        prepare: Callable[[object], object] = lambda arg: arg,
        max_compiling: int = 1,
        max_queued: int = 16,
        timeout_s: float = 10.0,
        label: str = "it",
    ):
        """compile(prepare(arg)) -> (result, its size in bytes), or raises; both run on the pool's
        threads, and only compile is timed (prepare: checks and what every compilation needs once, such
        as a tokenizer's tables). label: what a compilation's errors call their subject."""
        if max_compiling < 1 or max_queued < 0 or cache_bytes < 0 or not timeout_s > 0:
            raise ValueError(
                f"grammar compilation bounds must be positive: max_compiling {max_compiling}, max_queued "
                f"{max_queued}, cache_bytes {cache_bytes}, timeout_s {timeout_s}"
            )
        self._compile = compile
        self._prepare = prepare
        self.cache_bytes = cache_bytes
        self.max_compiling = max_compiling
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self.label = label
        self._cache: OrderedDict[Hashable, tuple[object, int]] = OrderedDict()
        self.cached_bytes = 0
        self._in_flight: dict[Hashable, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(max_compiling):
            threading.Thread(target=self._work, name="grammar-worker", daemon=True).start()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def future(self, key: Hashable, arg) -> concurrent.futures.Future:
        """The result for key, done or to come (see the module docstring). Cheap: safe on an event loop."""
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                done: concurrent.futures.Future = concurrent.futures.Future()
                done.set_result(self._cache[key][0])
                return done
            if key in self._in_flight:
                return self._in_flight[key]
            limit = self.max_compiling + self.max_queued
            if len(self._in_flight) >= limit:
                raise CompileQueueFull(
                    f"{len(self._in_flight)} grammars are compiling or waiting to (at most {limit}: "
                    f"--max-grammar-compilations {self.max_compiling} + --max-queued-grammars "
                    f"{self.max_queued})"
                )
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_running_or_notify_cancel()  # never cancelled: shared by every waiter
            self._in_flight[key] = future
        self._queue.put((key, arg, future))
        return future

    def get(self, key: Hashable, arg):
        """The result for key, compiled here if need be (blocks; raises what the compilation raised)."""
        return self.future(key, arg).result()

    def _work(self) -> None:
        lower_priority()
        while True:
            self._run(*self._queue.get())

    def _run(self, key: Hashable, arg, future: concurrent.futures.Future) -> None:
        timer = threading.Timer(self.timeout_s, _settle, (future, None, self._timeout()))
        timer.daemon = True
        try:
            prepared = self._prepare(arg)
            timer.start()
            result, nbytes = _on_compile_stack(self._compile, prepared)
        except BaseException as exc:
            _settle(future, None, exc)
        else:
            if _settle(future, result, None):  # not after its waiters were told it timed out
                self._insert(key, result, nbytes)
        finally:
            timer.cancel()
            with self._lock:
                del self._in_flight[key]

    def _timeout(self) -> CompileTimeout:
        return CompileTimeout(
            f"{self.label} did not compile within {self.timeout_s:g} s (--grammar-compile-timeout); "
            "simplify it"
        )

    def _insert(self, key: Hashable, result, nbytes: int) -> None:
        with self._lock:
            if nbytes > self.cache_bytes:
                return  # used by its waiters, not kept
            self._cache[key] = (result, nbytes)
            self.cached_bytes += nbytes
            while self.cached_bytes > self.cache_bytes:
                _, (_, evicted) = self._cache.popitem(last=False)
                self.cached_bytes -= evicted

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self.cached_bytes = 0


def lower_priority() -> None:
    """The calling thread COMPILE_NICENESS lower (Linux, where a thread has a niceness of its own, which
    the threads and processes it starts inherit; elsewhere nothing), or as it was if not permitted."""
    if sys.platform != "linux":
        return
    who = threading.get_native_id()
    with contextlib.suppress(OSError, AttributeError):  # not permitted, or no setpriority (Windows)
        os.setpriority(os.PRIO_PROCESS, who, min(19, os.getpriority(os.PRIO_PROCESS, who) + COMPILE_NICENESS))


def _on_compile_stack(fn, *args):
    """fn(*args) on a new thread with a COMPILE_STACK_BYTES stack (threading.stack_size applies to the
    threads started while it is set); returns or raises what fn did, once it has."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as exc:
            done.set_exception(exc)

    with _stack_size_lock:
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            threading.Thread(target=run, name="grammar-compile", daemon=True).start()
        finally:
            threading.stack_size(previous)
    return done.result()


def _settle(future: concurrent.futures.Future, result, exc: BaseException | None) -> bool:
    """Complete the future unless it is done already (a timeout and a result race); True if this did."""
    try:
        if exc is None:
            future.set_result(result)
        else:
            future.set_exception(exc)
    except concurrent.futures.InvalidStateError:
        return False
    return True
