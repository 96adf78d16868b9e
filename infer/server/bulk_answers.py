"""Big answers built on one thread of lower priority, off the event loop and behind the engine.

A prompt's logprobs over 4,096 positions with a top 20 are ~86,000 entries and ~10 MB of JSON: ~100 ms
of Python a response. On a CPU server that work takes a core from the engine's threads (every stream's
step waits for the slowest of them), so it runs on one thread at COMPILE_NICENESS, as grammar
compilation does: the kernel gives it a core when the engine leaves one, and such answers are built one
at a time.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

from infer.structured_outputs.compile_pool import lower_priority

_EXECUTOR = ThreadPoolExecutor(
    max_workers=1, thread_name_prefix="infer-bulk-answer", initializer=lower_priority
)


async def build_in_background(fn, *args):
    """fn(*args) on the bulk-answer thread; its result once done."""
    return await asyncio.get_running_loop().run_in_executor(_EXECUTOR, functools.partial(fn, *args))
