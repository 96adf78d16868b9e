"""Agent frameworks against a real server: the OpenAI Agents SDK (chat completions and Responses API
models) and LangChain's ChatOpenAI each run one tool round trip (call -> the tool's result -> an answer).

The model is the test suite's own with Qwen3's real chat template (tests/server/qwen3_chat_template.jinja,
as Qwen/Qwen3-0.6B ships it), served with `--enable-auto-tool-choice --tool-call-parser hermes`. It knows
nothing of tools: `tool_choice: "required"` makes it call, and the answer is whatever it writes next, so
the tests assert the protocol (one call, arguments the tool parses, the result sent back, a final text),
not the model's judgement. Every request the framework sends is recorded to check what went over the wire.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Literal

import httpx
import pytest

from infer.models.loader import EMBEDDED_MODEL
from tests.server.conftest import API_KEY, ServerProcess

pytestmark = pytest.mark.slow

QWEN3_TEMPLATE = Path(__file__).with_name("qwen3_chat_template.jinja")
MODEL = "qwen3-template"
CITIES = ("Paris", "London")
QUESTION = "What is the weather in Paris?"


def weather(city: Literal["Paris", "London"]) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def _eos_ids(folder: Path) -> list[int]:
    for name in ("generation_config.json", "config.json"):
        if (folder / name).is_file() and (eos := json.loads((folder / name).read_text()).get("eos_token_id")):
            return eos if isinstance(eos, list) else [eos]
    raise AssertionError(f"no eos_token_id in {folder}")


@pytest.fixture(scope="module")
def qwen3_model(model_args, tmp_path_factory) -> tuple[Path, list[str]]:
    """The suite's model in a folder of links whose chat template is Qwen3's, and the other model flags."""
    source = Path(model_args[model_args.index("--model") + 1]) if "--model" in model_args else EMBEDDED_MODEL
    folder = tmp_path_factory.mktemp("qwen3_template") / "model"
    folder.mkdir()
    for path in source.iterdir():
        if path.suffix in (".json", ".safetensors", ".model"):
            (folder / path.name).symlink_to(path.resolve())
    (folder / "chat_template.jinja").write_text(QWEN3_TEMPLATE.read_text())
    flags, skip = [], False
    for arg in model_args:
        if skip or arg in ("--model", "--served-model-name"):
            skip = not skip
            continue
        flags.append(arg)
    return folder, ["--model", str(folder), "--served-model-name", MODEL, *flags]


@pytest.fixture(scope="module")
def agent_server(qwen3_model, tmp_path_factory):
    tool_flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    args = [*qwen3_model[1], "--api-key", API_KEY, *tool_flags]
    proc = ServerProcess(args, tmp_path_factory.mktemp("agent_frameworks") / "server.log").start(timeout=300)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def extra_body(qwen3_model) -> dict:
    """What keeps a tiny model to the protocol. The JSON grammar of a forced call allows any whitespace
    and extra keys, in which such a model wanders until max_tokens: the structured_outputs options make
    the call compact. Its answer would run to max_tokens too (a Responses API answer cut short is
    "incomplete", which the Agents SDK takes for a failure): min_tokens and a bias towards EOS make it a
    few tokens that end on their own. Both hold for the forced call as well, whose grammar allows EOS
    only once the call is whole."""
    compact = {"disable_any_whitespace": True, "disable_additional_properties": True}
    eos_bias = {str(i): 100 for i in _eos_ids(qwen3_model[0])}
    return {"structured_outputs": compact, "min_tokens": 4, "logit_bias": eos_bias}


def _needs(module: str, package: str):
    return pytest.importorskip(module, reason=f"{package} is not installed (pip install -e '.[test]')")


class Recorder:
    """The JSON bodies of the requests an httpx client sends."""

    def __init__(self):
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> None:
        self.bodies.append(json.loads(request.content))

    async def async_hook(self, request: httpx.Request) -> None:
        self(request)


def _run_agent(agent_server, extra_body, model_class: str, streamed: bool):
    """One Agents SDK run with a single weather tool under tool_choice "required"; returns the run's
    result, the cities the tool was called with, and the request bodies sent."""
    agents = _needs("agents", "openai-agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    cities = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "London"]) -> str:
        """The weather in a city."""
        cities.append(city)
        return weather(city)

    recorder = Recorder()

    async def run():
        http = httpx.AsyncClient(event_hooks={"request": [recorder.async_hook]}, timeout=120)
        url = agent_server.url + "/v1"
        client = AsyncOpenAI(base_url=url, api_key=API_KEY, http_client=http, max_retries=0)
        settings = agents.ModelSettings(
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=100,
            extra_body=extra_body,
        )
        agent = agents.Agent(
            name="weather",
            instructions="Answer with the weather tool.",
            model=getattr(agents, model_class)(model=MODEL, openai_client=client),
            tools=[get_weather],
            model_settings=settings,
        )
        if not streamed:
            return await agents.Runner.run(agent, QUESTION)
        result = agents.Runner.run_streamed(agent, QUESTION)
        async for _ in result.stream_events():
            pass
        return result

    return asyncio.run(run()), cities, recorder.bodies


def _rendered(agent_server, body: dict) -> str:
    """The prompt the server renders from a chat request's messages and tools."""
    http = httpx.Client(base_url=agent_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    request = {"model": MODEL, "messages": body["messages"], "tools": body["tools"]}
    tokens = http.post("/tokenize", json=request).json()["tokens"]
    return http.post("/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"]


def _assert_one_round_trip(result, cities: list[str]) -> str:
    """One call with arguments the tool parsed, its result, then a final text; returns the call's id."""
    assert len(cities) == 1 and cities[0] in CITIES
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    call, output, _ = result.new_items
    assert call.raw_item.name == "get_weather" and json.loads(call.raw_item.arguments) == {"city": cities[0]}
    assert output.output == weather(cities[0])
    assert isinstance(result.final_output, str) and result.final_output.strip()
    return call.raw_item.call_id


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_agents_sdk_chat_completions_round_trip(agent_server, extra_body, streamed):
    result, cities, bodies = _run_agent(agent_server, extra_body, "OpenAIChatCompletionsModel", streamed)
    call_id = _assert_one_round_trip(result, cities)
    first, second = bodies
    assert first["tool_choice"] == "required" and first.get("stream", False) is streamed
    assert "tool_choice" not in second  # the SDK's reset_tool_choice: the answer is the model's to write
    assistant, tool = second["messages"][-2:]
    assert assistant["tool_calls"][0]["id"] == call_id
    assert tool == {"role": "tool", "tool_call_id": call_id, "content": weather(cities[0])}
    prompt = _rendered(agent_server, second)  # the history through Qwen3's template, as Qwen3 was trained
    assert (
        f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{cities[0]}"}}}}\n</tool_call>'
        in prompt
    )
    assert f"<tool_response>\n{weather(cities[0])}\n</tool_response>" in prompt


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_agents_sdk_responses_round_trip(agent_server, extra_body, streamed):
    result, cities, bodies = _run_agent(agent_server, extra_body, "OpenAIResponsesModel", streamed)
    call_id = _assert_one_round_trip(result, cities)
    first, second = bodies
    assert first["tool_choice"] == "required" and "tool_choice" not in second
    call, output = second["input"][-2:]
    assert (call["type"], call["call_id"]) == ("function_call", call_id)
    assert output == {"type": "function_call_output", "call_id": call_id, "output": weather(cities[0])}


def test_langchain_bind_tools_round_trip(agent_server, extra_body):
    _needs("langchain_openai", "langchain-openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    get_weather = tool("get_weather")(weather)
    recorder = Recorder()
    llm = ChatOpenAI(
        base_url=agent_server.url + "/v1",
        api_key=API_KEY,
        model=MODEL,
        temperature=0,
        max_tokens=100,
        max_retries=0,
        extra_body=extra_body,
        http_client=httpx.Client(event_hooks={"request": [recorder]}, timeout=120),
    )
    caller = llm.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False)
    messages = [HumanMessage(QUESTION)]
    ai = caller.invoke(messages)
    [call] = ai.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in CITIES and not ai.invalid_tool_calls
    assert ai.response_metadata["finish_reason"] == "tool_calls"
    streamed = None
    for chunk in caller.stream(messages):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]

    messages += [ai, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    final = llm.bind_tools([get_weather]).invoke(messages)
    assert isinstance(final.content, str) and final.content.strip() and not final.tool_calls
    assert final.response_metadata["finish_reason"] == "stop"
    result = {"role": "tool", "tool_call_id": call["id"], "content": weather(call["args"]["city"])}
    assert recorder.bodies[-1]["messages"][-1] == result
