"""Agent frameworks run a tool loop of two model turns through POST /v1/responses on a live server.

openai-agents with its default model (the Responses one), pydantic-ai's `OpenAIResponsesModel` and langchain's
`ChatOpenAI(use_responses_api=True)`, each pointed at the server with the framework's own settings:

- turn 1 is forced to call a Python function tool whose one argument is an enum, through the framework's own
  tool_choice setting (the server enforces it with a grammar, so the tiny random model finishes a valid call);
- the framework runs the tool and sends its result back, either with the whole history or as
  `previous_response_id` + the tool output alone, streamed or not;
- turn 2 is not forced and ends the run.

Every request the frameworks send goes through a recording HTTP client, so the tests check what went over the
wire; the server's /metrics counts the model requests; and any connection to anything but loopback fails the
test (tracing and telemetry stay off).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import time
from typing import Any, Literal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import LiveServer

CMDS = ("ls", "pwd", "make")
TOOL_OUTPUT = "a.py b.py"
# A forced call takes ~33 tokens of the tiny model; the free turn 2 writes text until this limit.
MAX_TOKENS = 64

MODES = [pytest.param(False, False, id="history"), pytest.param(False, True, id="history-stream"),
         pytest.param(True, False, id="previous_response_id"),
         pytest.param(True, True, id="previous_response_id-stream")]


class Recorder:
    """httpx event hooks that keep each request's JSON body, and each non-streamed response's JSON body."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.responses: list[tuple[int, Any]] = []

    def _on_request(self, request: httpx.Request) -> None:
        self.requests.append({"method": request.method, "path": request.url.path,
                              "body": json.loads(request.content) if request.content else None})

    def _keep(self, response: httpx.Response) -> None:
        streamed = "text/event-stream" in response.headers.get("content-type", "")
        self.responses.append((response.status_code, None if streamed else response.json()))

    async def _on_request_async(self, request: httpx.Request) -> None:
        self._on_request(request)

    async def _on_response_async(self, response: httpx.Response) -> None:
        if "text/event-stream" not in response.headers.get("content-type", ""):
            await response.aread()
        self._keep(response)

    def _on_response(self, response: httpx.Response) -> None:
        if "text/event-stream" not in response.headers.get("content-type", ""):
            response.read()
        self._keep(response)

    def client(self) -> httpx.Client:
        return httpx.Client(timeout=120, event_hooks={"request": [self._on_request], "response": [self._on_response]})

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=120, event_hooks={"request": [self._on_request_async],
                                                           "response": [self._on_response_async]})

    def turns(self) -> list[dict[str, Any]]:
        """The bodies of the POST /v1/responses requests, in order."""
        return [r["body"] for r in self.requests if r["method"] == "POST" and r["path"] == "/v1/responses"]


def _loopback(host: object) -> bool:
    if not isinstance(host, str):
        return True  # an AF_UNIX path or similar: not the internet
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Any:
    """No telemetry or tracing; any lookup of or connection to a non-loopback host fails and fails the test."""
    for name, value in {"OTEL_SDK_DISABLED": "true", "LANGCHAIN_TRACING_V2": "false", "LANGSMITH_TRACING": "false",
                        "LANGCHAIN_TRACING": "false", "OPENAI_AGENTS_DISABLE_TRACING": "1",
                        "LOGFIRE_SEND_TO_LOGFIRE": "false"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    blocked: list[object] = []
    real_connect, real_connect_ex, real_getaddrinfo = socket.socket.connect, socket.socket.connect_ex, \
        socket.getaddrinfo

    def connect(self: socket.socket, address: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address[0]):
            blocked.append(address)
            raise OSError(f"test_agent_frameworks: connection to {address} refused, only loopback")
        return real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address[0]):
            blocked.append(address)
            return 111  # ECONNREFUSED
        return real_connect_ex(self, address)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host is not None and not _loopback(host.decode() if isinstance(host, bytes) else host):
            blocked.append(host)
            raise socket.gaierror(f"test_agent_frameworks: lookup of {host} refused, only loopback")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield
    assert blocked == [], f"something tried to reach beyond loopback: {blocked}"


def finished_requests(server: LiveServer) -> float:
    """sessionserve_requests_total summed over its labels."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "sessionserve_requests_total")


def wait_finished(server: LiveServer, before: float, n: int) -> float:
    """The requests finished since `before` once there are `n` (a finished request is counted just after its
    last byte is sent)."""
    deadline = time.monotonic() + 10
    while (done := finished_requests(server) - before) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return done


def check_wire(rec: Recorder, forced: object, first_call_id: str, previous_response_id: str | None,
               stream: bool) -> None:
    """Two POST /v1/responses, both answered 200: the first forced to call `run`, the second carrying the tool's
    output for that call, with the whole history or on `previous_response_id`."""
    assert [status for status, _ in rec.responses] == [200, 200], rec.responses
    first, second = rec.turns()
    assert first["tool_choice"] == forced
    assert [t["name"] for t in first["tools"]] == ["run"]
    assert first["tools"][0]["parameters"]["properties"]["cmd"]["enum"] == list(CMDS)
    assert bool(first.get("stream")) is stream and bool(second.get("stream")) is stream
    assert second.get("tool_choice") in (None, "auto")  # turn 2 is free
    items = second["input"] if isinstance(second["input"], list) else []
    outputs = [i for i in items if i.get("type") == "function_call_output"]
    assert [o["call_id"] for o in outputs] == [first_call_id]
    assert TOOL_OUTPUT in json.dumps(outputs[0]["output"])
    if previous_response_id is not None:
        assert second["previous_response_id"] == previous_response_id
        assert items == outputs  # only what is new since that response
    else:
        assert "previous_response_id" not in second
        assert [i["call_id"] for i in items if i.get("type") == "function_call"] == [first_call_id]


@pytest.mark.parametrize("chain, stream", MODES)
def test_openai_agents_default_model_tool_loop(server: LiveServer, chain: bool, stream: bool) -> None:
    """openai-agents' default model for an OpenAI client is its Responses model.

    openai-agents raises `ModelBehaviorError` on a response that ends `incomplete` (at max_output_tokens), so
    the free turn 2 must end on its own: the tool is usable once (`is_enabled`) and the agent has a JSON
    `output_type`, which the server enforces with a grammar on a turn without tools (as OpenAI applies the
    format to the final answer).
    """
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI
    from pydantic import BaseModel

    from agents.models.openai_provider import OpenAIProvider
    from agents.models.openai_responses import OpenAIResponsesModel

    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool(is_enabled=lambda ctx, agent: not calls)
    def run(cmd: Literal["ls", "pwd", "make"]) -> str:
        """Run a shell command."""
        calls.append(cmd)
        return TOOL_OUTPUT

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]

    rec = Recorder()
    agent = agents.Agent(name="ops", instructions="Use the tool, then answer.", tools=[run], output_type=Verdict,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=MAX_TOKENS,
                                                             temperature=0))

    async def go() -> Any:
        async with AsyncOpenAI(base_url=server.url + "/v1", api_key="key-alice", max_retries=0,
                               http_client=rec.async_client()) as client:
            provider = OpenAIProvider(openai_client=client)
            assert isinstance(provider.get_model("tiny"), OpenAIResponsesModel)  # the default API is Responses
            config = agents.RunConfig(model_provider=provider, model="tiny", tracing_disabled=True)
            kw = {"run_config": config, "max_turns": 3, "auto_previous_response_id": chain}
            if stream:
                result = agents.Runner.run_streamed(agent, "List the files.", **kw)
                async for _ in result.stream_events():
                    pass
                return result
            return await agents.Runner.run(agent, "List the files.", **kw)

    before = finished_requests(server)
    result = asyncio.run(go())
    assert len(calls) == 1 and calls[0] in CMDS
    assert isinstance(result.final_output, Verdict)
    assert len(result.raw_responses) == 2
    assert wait_finished(server, before, 2) == 2
    call_id = next(i.call_id for i in result.raw_responses[0].output if i.type == "function_call")
    check_wire(rec, "required", call_id, result.raw_responses[0].response_id if chain else None, stream)


@pytest.mark.parametrize("chain, stream", MODES)
def test_pydantic_ai_responses_model_tool_loop(server: LiveServer, chain: bool, stream: bool) -> None:
    """pydantic-ai forces a tool on the first step only through a capability's per-step model settings (a static
    forced tool_choice is refused, as the run could never end); turn 2 writes text until max tokens, which
    pydantic-ai takes as the run's output."""
    pytest.importorskip("pydantic_ai")
    from openai import AsyncOpenAI

    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.messages import ModelResponse, ToolCallPart
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class ForceToolFirst(AbstractCapability[Any]):
        def get_model_settings(self) -> Any:
            return lambda ctx: {"tool_choice": ["run"]} if ctx.run_step == 1 else {}

    rec = Recorder()
    settings: dict[str, Any] = {"max_tokens": MAX_TOKENS, "temperature": 0}
    if chain:
        settings["openai_previous_response_id"] = "auto"
    calls: list[str] = []

    def run(cmd: Literal["ls", "pwd", "make"]) -> str:
        """Run a shell command."""
        calls.append(cmd)
        return TOOL_OUTPUT

    async def go() -> tuple[str, Any, list[Any]]:
        async with AsyncOpenAI(base_url=server.url + "/v1", api_key="key-alice", max_retries=0,
                               http_client=rec.async_client()) as client:
            model = OpenAIResponsesModel("tiny", provider=OpenAIProvider(openai_client=client), settings=settings)
            agent = Agent(model, instructions="Use the tool, then answer.", tools=[run],
                          capabilities=[ForceToolFirst()])
            if stream:
                async with agent.run_stream("List the files.") as result:
                    output = await result.get_output()
                return output, result.usage, result.all_messages()
            result = await agent.run("List the files.")
            return result.output, result.usage, result.all_messages()

    before = finished_requests(server)
    output, usage, messages = asyncio.run(go())
    assert len(calls) == 1 and calls[0] in CMDS
    assert isinstance(output, str) and output
    assert usage.requests == 2 and usage.tool_calls == 1
    assert wait_finished(server, before, 2) == 2
    first = next(m for m in messages if isinstance(m, ModelResponse))
    call = next(p for p in first.parts if isinstance(p, ToolCallPart))
    # One tool, so pydantic-ai sends the forced ["run"] as "required".
    check_wire(rec, "required", call.tool_call_id, first.provider_response_id if chain else None, stream)


@pytest.mark.parametrize("chain, stream", MODES)
def test_langchain_responses_api_tool_loop(server: LiveServer, chain: bool, stream: bool) -> None:
    """langchain's ChatOpenAI with `use_responses_api=True` in a hand-written tool loop: `bind_tools` with
    `tool_choice` naming the tool, the tool's ToolMessage back, and a second turn with the tool offered freely
    (it writes text until it ends or reaches max tokens; langchain returns it as the answer either way)."""
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    calls: list[str] = []

    @tool
    def run(cmd: Literal["ls", "pwd", "make"]) -> str:
        """Run a shell command."""
        calls.append(cmd)
        return TOOL_OUTPUT

    rec = Recorder()
    before = finished_requests(server)
    with rec.client() as http:
        llm = ChatOpenAI(model="tiny", base_url=server.url + "/v1", api_key="key-alice", use_responses_api=True,
                         use_previous_response_id=chain, streaming=stream, max_tokens=MAX_TOKENS, temperature=0,
                         max_retries=0, http_client=http)
        messages: list[Any] = [HumanMessage("List the files.")]
        first = llm.bind_tools([run], tool_choice="run").invoke(messages)
        assert isinstance(first, AIMessage) and first.tool_calls
        messages.append(first)
        messages += [run.invoke(call) for call in first.tool_calls]  # ToolMessages
        second = llm.bind_tools([run]).invoke(messages)
    assert isinstance(second, AIMessage) and not second.tool_calls and second.text
    assert len(calls) == 1 and calls[0] in CMDS
    assert wait_finished(server, before, 2) == 2
    assert first.response_metadata["status"] == "completed"
    assert second.response_metadata["status"] in ("completed", "incomplete")
    if second.response_metadata["status"] == "incomplete":
        assert second.response_metadata["incomplete_details"] == {"reason": "max_output_tokens"}
    check_wire(rec, {"type": "function", "name": "run"}, first.tool_calls[0]["id"], first.id if chain else None,
               stream)
