"""One request's failure ends that request alone: the rest of its batch finishes exactly as it would have."""

from __future__ import annotations

import asyncio

import pytest

from infer.config import EngineConfig
from infer.engine.async_engine import AsyncEngine, RequestFailed
from infer.engine.llm_engine import LLMEngine
from infer.sampling_params import SamplingParams
from tests.grids import first_fast
from tests.models.tiny_models import save_byte_tokenizer, save_tiny_model

PROMPTS = {f"ok-{i}": [5 + i, 9, 11 + i, 40, 7 * i + 3] for i in range(5)}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    _, path = save_tiny_model("llama", tmp_path_factory.mktemp("isolation"))
    save_byte_tokenizer(path)
    return str(path)


def run_all(engine: LLMEngine) -> dict:
    """Step to the end; every request's (token ids, finish reason), and integrity after every step."""
    results: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            ids, _ = results.get(out.req_id, ([], None))
            results[out.req_id] = (ids + out.token_ids, out.finish_reason)
        engine.scheduler.check_integrity()
    return results


def add_all(engine: LLMEngine) -> None:
    for req_id, prompt in PROMPTS.items():
        engine.add_request(prompt, GREEDY, req_id)


@pytest.mark.parametrize("position", first_fast([2, 0, 5]))
def test_a_request_whose_sampling_raises_ends_alone(model_path, position):
    engine = LLMEngine(EngineConfig(model=model_path, dtype="float32", seed=0))
    add_all(engine)
    expected = run_all(engine)
    assert all(reason == "length" and len(ids) == 8 for ids, reason in expected.values())

    order = list(PROMPTS)
    order.insert(position, "bad")  # the bad request joins the batch at several places
    for req_id in order:
        if req_id == "bad":
            bad = SamplingParams(temperature=1.0, seed=1, max_tokens=8)
            engine.add_request([3, 4, 5], bad, "bad")
            bad.seed = 2**70  # past validation: torch.Generator.manual_seed raises in the sampler
        else:
            engine.add_request(PROMPTS[req_id], GREEDY, req_id)
    results = run_all(engine)
    assert results.pop("bad") == ([], "error")
    assert results == expected
    assert engine.scheduler.kv_cache_manager.num_used_blocks == 0


def test_a_failure_injected_mid_stream_ends_only_its_request(model_path):
    """A request that fails after it has produced tokens (the runner raises whenever it is in the step)."""
    engine = LLMEngine(EngineConfig(model=model_path, dtype="float32", seed=0))
    add_all(engine)
    expected = run_all(engine)

    add_all(engine)
    execute = engine.runner.execute
    steps = {"n": 0}

    def failing_execute(sched):
        steps["n"] += 1
        if steps["n"] > 3 and any(s.req_id == "ok-2" for s in sched.scheduled):
            raise RuntimeError("injected")
        return execute(sched)

    engine.runner.execute = failing_execute
    results = run_all(engine)
    ids, reason = results.pop("ok-2")
    assert reason == "error" and 0 < len(ids) < 8
    assert ids == expected.pop("ok-2")[0][: len(ids)]
    assert results == expected


def test_async_engine_raises_for_the_failed_request_only(model_path):
    async def main():
        engine = AsyncEngine(EngineConfig(model=model_path, dtype="float32", seed=0))
        engine.start()
        try:
            await engine.ready()
            bad = SamplingParams(top_k=5, max_tokens=8)

            async def collect(prompt, params, req_id):
                return [t async for out in engine.generate(prompt, params, req_id) for t in out.token_ids]

            tasks = [asyncio.create_task(collect(p, GREEDY, r)) for r, p in PROMPTS.items()]
            bad_task = asyncio.create_task(collect([3, 4, 5], bad, "bad"))
            await asyncio.sleep(0)
            bad.top_k = 2**70  # past validation: too large for a tensor, the sampler raises
            outs = await asyncio.gather(*tasks)
            with pytest.raises(RequestFailed, match="bad"):
                await bad_task
            return outs
        finally:
            engine.shutdown()

    outs = asyncio.run(main())
    assert all(len(ids) == 8 for ids in outs)
