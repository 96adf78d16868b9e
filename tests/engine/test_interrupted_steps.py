"""A long step of prefill chunks stops between layers for a newcomer and runs again later: the outputs, the
prompt logprobs and the prefix cache are as if it never stopped, and the newcomer's first token comes
before the long prompt's."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from infer.config import EngineConfig
from infer.core import scheduler
from infer.engine import llm_engine
from infer.engine.async_engine import AsyncEngine
from infer.engine.llm_engine import LLMEngine
from infer.sampling_params import SamplingParams

BUDGET = 128  # the tiny model's 256 positions hold two such chunks and a decode's tokens
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tiny):
    return tiny[0]  # conftest's tiny llama with a byte tokenizer


def long_prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(5)
    return {f"long-{i}": torch.randint(2, 256, (200 - 30 * i,), generator=gen).tolist() for i in range(3)}


def engine_of(model_path: str, budget: int = BUDGET) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_path, dtype="float32", seed=0, max_num_batched_tokens=budget))


def run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams) -> dict:
    """Every request's (token ids, prompt logprobs: (token id, logprob to 1e-4, rank)), checking the
    scheduler's integrity after each step. A rerun step may chunk the rest of a prompt apart from the
    step it replaces (a running request's chunk, not an admission's), which moves float32 sums in their
    last digits."""
    for req_id, prompt in prompts.items():
        engine.add_request(prompt, params, req_id)
    results: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            ids, logprobs = results.get(out.req_id, ([], None))
            if out.prompt_logprobs is not None:
                logprobs = [
                    None if e is None else (e[0], pytest.approx(e[1], abs=1e-4), e[2])
                    for e in out.prompt_logprobs
                ]
            results[out.req_id] = (ids + out.token_ids, logprobs)
        engine.scheduler.check_integrity()
    return results


class EveryOtherStep:
    """An owner whose newcomer arrives in every other step that may stop, at its second question: the
    step stops after a layer has written its keys and values (the tiny model has two), or at the
    prompt-logprob parts. With every request's steps allowed to stop (`always_stoppable`; the allowance
    has its own test), the steps between run whole."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.step = None  # the StepStats of the step asking (each schedule() makes a new one)
        self.steps = self.questions = 0

    def __call__(self) -> bool:
        if self.engine.last_stats is not self.step:
            self.step, self.steps, self.questions = self.engine.last_stats, self.steps + 1, 0
        self.questions += 1
        return self.steps % 2 == 1 and self.questions == 2


def always_stoppable(monkeypatch) -> None:
    monkeypatch.setattr(LLMEngine, "_may_interrupt", lambda self, req: True)


@pytest.mark.parametrize("prompt_logprobs", [None, 2])
def test_interrupted_steps_leave_outputs_logprobs_and_cache_as_they_were(
    model_path, prompt_logprobs, monkeypatch
):
    # prompt-logprob tokens cost more of the budget: their chunks are shorter; every rerun step may be
    # interrupted again, so that many are
    monkeypatch.setattr(llm_engine, "INTERRUPTIBLE_TOKENS", 32)
    always_stoppable(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    expected = run(engine_of(model_path), long_prompts(), params)

    engine = engine_of(model_path)
    engine.newcomer_waiting = EveryOtherStep(engine)
    assert run(engine, long_prompts(), params) == expected
    assert engine.num_interrupted_steps >= 2
    assert engine.scheduler.kv_cache_manager.num_used_blocks == 0  # every block back in the pool

    # the prompts' blocks are in the prefix cache: hits now read what the interrupted steps wrote again
    engine.newcomer_waiting = None
    again = run(engine, {f"again-{k}": p for k, p in long_prompts().items()}, params)
    assert {k.removeprefix("again-"): v for k, v in again.items()} == expected


def test_a_request_stops_again_only_once_its_lost_work_is_a_quarter_of_its_time(model_path, monkeypatch):
    """A newcomer always waits: the first chunk's step stops at its first layer; the next stops only once
    the work thrown away is at most a quarter of the request's time since it arrived (its arrival set
    back here, in place of waiting), whether or not its own steps ran meanwhile; the output is whole."""
    monkeypatch.setattr(llm_engine, "INTERRUPTIBLE_TOKENS", 16)
    engine = engine_of(model_path, budget=32)
    asked = []
    engine.newcomer_waiting = lambda: asked.append(engine.last_stats) or True
    prompt = long_prompts()["long-0"][:250]  # 8 chunks of at most 32 tokens
    req = engine.add_request(prompt, GREEDY, "long")
    outputs = engine.step()
    assert not outputs and engine.num_interrupted_steps == 1 and req.num_computed_tokens == 0
    assert req.num_interruptions == 1 and req.seconds_lost > 0
    req.arrival_time = time.monotonic()  # what it lost is more than a quarter of its time: runs whole
    engine.step()
    assert engine.num_interrupted_steps == 1 and req.num_computed_tokens == 32
    req.arrival_time = time.monotonic() - 4 * req.seconds_lost - 1  # held a while: may stop again
    engine.step()
    assert engine.num_interrupted_steps == 2 and req.num_computed_tokens == 32
    # asked only in steps of prefill chunks alone
    assert asked and all(not s.num_decode_tokens and s.num_prefill_tokens >= 16 for s in asked)
    engine.newcomer_waiting = None
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.token_ids]
    assert tokens == run(engine_of(model_path, budget=32), {"long": prompt}, GREEDY)["long"][0]


@pytest.mark.parametrize("prompt_len, stops", [(8, True), (7, False)])
def test_a_step_of_a_few_prompt_tokens_stops_for_a_newcomer(model_path, prompt_len, stops):
    """A few prompt tokens add much to a CPU step (half a decode step's time for 8 on a 135M model): a
    newcomer does not wait for them. Fewer run whole."""
    engine = engine_of(model_path)
    engine.newcomer_waiting = lambda: True
    req = engine.add_request(list(range(3, 3 + prompt_len)), GREEDY, "short")
    outputs = engine.step()
    assert engine.num_interrupted_steps == int(stops)
    assert req.num_computed_tokens == (0 if stops else prompt_len) and bool(outputs) != stops


def test_a_floods_decodes_are_interrupted_and_a_lone_streams_never(model_path, monkeypatch):
    """A group's decode steps (one client's flood, a request's n choices) may stop; a step that carries
    a decode of a request of its own never does; the outputs are as if nothing stopped."""
    monkeypatch.setattr(llm_engine, "INTERRUPTIBLE_TOKENS", 2)
    always_stoppable(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = {f"flood-{i}": [5 + i, 9, 11, 40, 7 * i + 3] for i in range(4)}

    def outputs(engine: LLMEngine) -> dict:
        for req_id, prompt in prompts.items():
            engine.add_request(prompt, params, req_id, group_id="flood")
        engine.add_request([3, 4, 5], params, "stream")
        results: dict = {}
        while engine.has_unfinished():
            for out in engine.step():
                results[out.req_id] = results.get(out.req_id, []) + out.token_ids
            engine.scheduler.check_integrity()
        return results

    undone: list = []
    engine = engine_of(model_path)
    engine.newcomer_waiting = EveryOtherStep(engine)
    undo = engine.scheduler.undo

    def recording_undo(sched_out, seconds):
        undone.append([(s.req_id, s.start_pos) for s in sched_out.scheduled])
        undo(sched_out, seconds)

    engine.scheduler.undo = recording_undo
    assert outputs(engine) == outputs(engine_of(model_path))
    decoding = [step for step in undone if any(pos >= 5 for _, pos in step)]  # past the 5-token prompts
    assert decoding  # a flood's decode steps were interrupted
    # the stream (3 tokens of prompt) was in no interrupted step once it decoded
    assert not any(req_id == "stream" and pos >= 3 for step in undone for req_id, pos in step)


def test_an_interrupted_prompt_gets_short_chunks(model_path, monkeypatch):
    monkeypatch.setattr(scheduler, "INTERRUPTED_CHUNK", 48)
    engine = engine_of(model_path)  # chunks of 128 tokens
    steps = []
    engine.newcomer_waiting = lambda: engine.num_interrupted_steps == 0  # one newcomer, in the first step
    engine.add_request(long_prompts()["long-0"], GREEDY, "long")
    while engine.has_unfinished():
        engine.step()
        steps.append(engine.last_stats.num_prefill_tokens)
    # the first step (128 tokens) interrupted, then the 200-token prompt in chunks of at most 48
    assert engine.num_interrupted_steps == 1
    assert steps[:6] == [128, 48, 48, 48, 48, 8]


def test_a_short_newcomer_stops_a_long_prefill_step_and_gets_its_token_first(model_path):
    """Through AsyncEngine: the long prompt's first interruptible step waits before its second layer
    until the newcomer has been sent (so that the newcomer is sure to arrive during it)."""
    built: list[LLMEngine] = []
    holding = threading.Event()  # the long prompt's step is at its second layer

    def factory() -> LLMEngine:
        engine = engine_of(model_path)

        def hold(module, args):
            if engine.runner.interrupted is None or engine.num_interrupted_steps:
                return
            holding.set()
            deadline = time.monotonic() + 30
            while not engine.newcomer_waiting():
                assert time.monotonic() < deadline, "the short request was never sent"
                time.sleep(0.001)

        engine.runner.model.model.layers[1].register_forward_pre_hook(hold)
        built.append(engine)
        return engine

    async def main():
        aengine = AsyncEngine(factory=factory)
        aengine.start()
        await aengine.ready()
        engine = built[0]
        order = []

        async def consume(outputs, name):
            async for out in outputs:
                order.append(name)
                if out.finished:
                    return

        long_out = await aengine.add(long_prompts()["long-0"], GREEDY, "long")
        assert await asyncio.to_thread(holding.wait, 30)
        short_out = await asyncio.wait_for(aengine.add([7, 8, 9], GREEDY, "short"), 30)
        await asyncio.gather(consume(long_out, "long"), consume(short_out, "short"))
        aengine.shutdown()
        return engine, order

    engine, order = asyncio.run(main())
    assert engine.num_interrupted_steps == 1
    assert order[0] == "short"  # the short request's first token before the long prompt's
    assert order.count("short") == order.count("long") == GREEDY.max_tokens
