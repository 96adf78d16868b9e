"""A grammar's text (the Python of its compilation) is built in a worker process, not on a thread of the
engine's process, where it would hold the GIL the engine thread takes back after each torch op."""

from __future__ import annotations

import os
import signal

import pytest

import infer.structured_outputs.compiler as compiler_module
import infer.structured_outputs.grammar_text as grammar_text_module
from infer.engine.tokenizer import load_tokenizer
from infer.models.loader import EMBEDDED_MODEL
from infer.structured_outputs import text_process
from infer.structured_outputs.compiler import GrammarCompiler
from infer.structured_outputs.constraint import StructuredOutputs

pytestmark = pytest.mark.slow  # builds llguidance's tokenizer and starts a worker process


@pytest.fixture(scope="module")
def compiler():
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    return GrammarCompiler.for_tokenizer(tokenizer, tokenizer.vocab_size)


def _schema(tag: str) -> StructuredOutputs:
    props = {f"{tag}_{k}": {"type": "string", "maxLength": 8} for k in range(40)}
    return StructuredOutputs(json={"type": "object", "properties": props, "required": list(props)[:2]})


def test_grammar_text_is_not_built_in_the_engine_process(compiler, monkeypatch):
    def here(spec):
        raise AssertionError("a grammar's text built in the engine's process")

    monkeypatch.setattr(grammar_text_module, "grammar_text", here)
    monkeypatch.setattr(compiler_module, "grammar_text", here, raising=False)
    specs = [_schema("a"), StructuredOutputs(choice=["x", "y"]), StructuredOutputs(grammar='root ::= "a"')]
    for spec in specs:
        compiler.check(spec)
    assert text_process.worker_pids() and os.getpid() not in text_process.worker_pids()


def test_the_worker_refuses_as_grammar_text_does(compiler):
    with pytest.raises(ValueError, match="structured_outputs regex must be at most"):
        compiler.check(StructuredOutputs(regex="a" * 10_000))


def test_a_worker_that_died_is_replaced(compiler):
    compiler.check(_schema("before"))
    pid = text_process.worker_pids()[0]
    os.kill(pid, signal.SIGKILL)  # whether the pool has seen it yet or not, the grammar goes on a new one
    compiler.check(_schema("after"))
    assert text_process.worker_pids() and pid not in text_process.worker_pids()


def test_workers_run_below_the_engine_s_priority(compiler):
    from infer.structured_outputs.compile_pool import COMPILE_NICENESS

    compiler.check(_schema("nice"))
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert {os.getpriority(os.PRIO_PROCESS, pid) for pid in text_process.worker_pids()} == {
        min(19, mine + COMPILE_NICENESS)
    }
