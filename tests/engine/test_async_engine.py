"""AsyncEngine: concurrent streams, refusals, and early exits that abort their requests."""

from __future__ import annotations

import asyncio
import threading

import pytest

from infer.config import EngineConfig
from infer.engine.async_engine import AsyncEngine
from infer.engine.llm_engine import LLMEngine
from infer.sampling_params import SamplingParams
from tests.models.tiny_models import save_byte_tokenizer, save_tiny_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    _, path = save_tiny_model("llama", tmp_path_factory.mktemp("async"))
    save_byte_tokenizer(path)
    return str(path)


def run(engine: AsyncEngine, coro):
    async def main():
        engine.start()
        try:
            return await coro()
        finally:
            engine.shutdown()

    return asyncio.run(main())


def test_the_engine_thread_waits_for_the_gil_a_short_switch_interval_at_most(model_path):
    # after each torch op the engine thread takes the GIL back from whichever thread runs Python, which
    # drops it only every switch interval
    import sys

    from infer.engine.async_engine import GIL_SWITCH_INTERVAL_S

    previous = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)  # Python's default
        engine = AsyncEngine(EngineConfig(model=model_path, dtype="float32", num_kv_blocks=64))

        async def interval():
            return sys.getswitchinterval()

        assert run(engine, interval) <= GIL_SWITCH_INTERVAL_S < 0.005
    finally:
        sys.setswitchinterval(previous)


def test_concurrent_streams_match_offline_results(model_path):
    from infer.engine.llm import LLM

    prompts = [[5 + i, 9, 11 + i, 40] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [
        r.token_ids for r in LLM(model_path, dtype="float32", num_kv_blocks=64).generate(prompts, params)
    ]
    engine = AsyncEngine(EngineConfig(model=model_path, dtype="float32", num_kv_blocks=64))

    async def collect(prompt):
        outs = [o async for o in engine.generate(prompt, params)]
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])
        return [t for o in outs for t in o.token_ids]

    async def main():
        return await asyncio.gather(*(collect(p) for p in prompts))

    assert run(engine, main) == expected
    assert engine.engine.scheduler.kv_cache_manager.num_used_blocks == 0


def test_refused_request_raises_and_closing_early_aborts(model_path):
    engine = AsyncEngine(EngineConfig(model=model_path, dtype="float32", num_kv_blocks=64))

    async def main():
        with pytest.raises(ValueError, match="token ids"):
            async for _ in engine.generate([1, 9999]):
                pass
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        stream = engine.generate([3, 4, 5], params, req_id="leaver")
        async for out in stream:
            if out.num_output_tokens >= 3:
                break
        await stream.aclose()  # what a disconnecting HTTP client causes
        for _ in range(200):
            if not engine.engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        return engine.engine.has_unfinished()

    assert run(engine, main) is False
    assert engine.num_unfinished == 0
    assert engine.engine.scheduler.kv_cache_manager.num_used_blocks == 0


def test_abort_from_outside_ends_the_stream(model_path):
    engine = AsyncEngine(EngineConfig(model=model_path, dtype="float32", num_kv_blocks=64))

    async def main():
        outs = []

        async def consume():
            params = SamplingParams(max_tokens=200, ignore_eos=True)
            async for out in engine.generate([1, 2, 3], params, req_id="r"):
                outs.append(out)

        task = asyncio.create_task(consume())
        while not outs:
            await asyncio.sleep(0.01)
        engine.abort("r")
        await asyncio.wait_for(task, 10)
        return outs[-1]

    last = run(engine, main)
    assert last.finished and last.finish_reason == "abort"
    assert engine.engine.scheduler.kv_cache_manager.num_used_blocks == 0


def test_the_engine_is_built_on_the_thread_that_steps_it(model_path):
    """Torch on one thread only (see infer.engine.async_engine: libgomp and a second thread)."""
    built_on = []

    def factory():
        built_on.append(threading.current_thread())
        return LLMEngine(EngineConfig(model=model_path, dtype="float32", num_kv_blocks=64))

    engine = AsyncEngine(factory=factory)

    async def go():
        await engine.ready()
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        return [out async for out in engine.generate([5, 9, 11], params)]

    outputs = run(engine, go)
    assert built_on == [engine._thread] and built_on[0] is not threading.main_thread()
    assert outputs[-1].finished and sum(len(o.token_ids) for o in outputs) == 3


def test_a_model_that_fails_to_load_is_reported_by_ready_and_by_requests(tmp_path):
    engine = AsyncEngine(EngineConfig(model=str(tmp_path / "missing")))

    async def go():
        with pytest.raises(Exception, match="missing"):
            await engine.ready()
        with pytest.raises(Exception, match="missing"):  # not a request waiting forever
            async for _ in engine.generate([5, 9], SamplingParams(max_tokens=2)):
                pass
        return True

    assert run(engine, go)


def test_a_burst_of_requests_to_an_idle_engine_starts_as_one_step(model_path, monkeypatch):
    """Requests that reach an idle engine within BURST_QUIET_S of each other are prefilled in its first
    step together (the quiet window widened here so that a slow machine cannot split the burst)."""
    from infer.engine import async_engine

    monkeypatch.setattr(async_engine, "BURST_QUIET_S", 0.05)
    monkeypatch.setattr(async_engine, "BURST_MAX_S", 1.0)
    steps = []

    def factory():
        engine = LLMEngine(EngineConfig(model=model_path, dtype="float32", num_kv_blocks=64))
        step = engine.step

        def counting_step():
            outputs = step()
            steps.append((len(outputs), engine.last_stats.num_prefill_tokens))
            return outputs

        engine.step = counting_step
        return engine

    engine = AsyncEngine(factory=factory)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    async def one(i):
        await asyncio.sleep(0.005 * i)  # spread over 15 ms: within the widened quiet window
        return [o async for o in engine.generate([5 + i, 9, 11], params)]

    async def main():
        await engine.ready()
        return await asyncio.gather(*(one(i) for i in range(4)))

    outs = run(engine, main)
    assert all(o[-1].finished for o in outs)
    assert steps[0] == (4, 12)  # all four prompts (3 tokens each) in the first step, each with its token


def test_a_groups_sequences_run_in_waves_and_all_complete(model_path):
    """The n choices of one request (one group_id) never hold every seat: a seat stays free for the next
    arrival, and every choice completes."""
    engine = AsyncEngine(EngineConfig(model=model_path, dtype="float32", num_kv_blocks=64, max_num_seqs=4))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    most = 0

    async def collect(prompt, req_id, group_id):
        outs = [o async for o in await engine.add(prompt, params, req_id, group_id=group_id)]
        return outs[-1].finish_reason

    async def main():
        nonlocal most
        await engine.ready()
        scheduler = engine.engine.scheduler
        schedule = scheduler.schedule

        def watched():  # on the engine thread: the group's seats once each step is planned
            nonlocal most
            out = schedule()
            most = max(most, sum(r.group_id == "g" for r in scheduler.running))
            return out

        scheduler.schedule = watched
        choices = [collect([5, 9, 11], f"g-{i}", "g") for i in range(8)]
        return await asyncio.gather(*choices, collect([7, 8], "other", None))

    assert run(engine, main) == ["length"] * 9
    assert 1 <= most <= 3
