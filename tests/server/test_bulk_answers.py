"""Big answers (a prompt's logprobs) are built on one thread of lower priority than the engine's."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

from infer.server.bulk_answers import build_in_background


def niceness() -> tuple[str, int]:
    return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own niceness is Linux's")
def test_the_builder_runs_on_one_thread_below_the_callers_priority():
    async def main():
        return await asyncio.gather(*(build_in_background(niceness) for _ in range(4)))

    _, mine = niceness()
    seen = asyncio.run(main())
    assert len({name for name, _ in seen}) == 1  # one at a time, on one thread
    assert all(value > mine or value == 19 for _, value in seen)
