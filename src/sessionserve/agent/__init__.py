"""Agent runtime: concurrent tool calls, one retry budget for the process, sessions that park and resume.

    from sessionserve.agent import Agent, AgentConfig, ChatClient, ToolRegistry

    tools = ToolRegistry()

    @tools.tool(timeout_s=10)
    def search_files(pattern: str, path: str = ".") -> list[str]: ...

    client = ChatClient("http://127.0.0.1:8000/v1", api_key="...")
    result = await Agent(client, tools).run("find the config parser")

Works against any OpenAI-compatible endpoint; on sessionserve it opens a
session and tells the server how long each park will last.
"""

from __future__ import annotations

from sessionserve.agent.breaker import BreakerConfig, BreakerState, CircuitBreaker
from sessionserve.agent.client import ChatClient, ModelError
from sessionserve.agent.executor import PlannedCall, ToolExecutor, ToolResult
from sessionserve.agent.graph import critical_path_s, topological_waves
from sessionserve.agent.latency import LatencyEstimator
from sessionserve.agent.loop import (Agent, AgentConfig, AgentEvent, AgentResult, RunDone, StepDone, TextDelta,
                                     ToolDone)
from sessionserve.agent.reply import ModelReply, ToolCall
from sessionserve.agent.retry import Backoff, RetryBudget, parse_retry_after_s, process_budget
from sessionserve.agent.timing import RunTracer, StepRecord, ToolCallRecord
from sessionserve.agent.tools import Tool, ToolArgumentsError, ToolError, ToolRegistry, make_tool

__all__ = [
    "Agent", "AgentConfig", "AgentEvent", "AgentResult", "Backoff", "BreakerConfig", "BreakerState", "ChatClient",
    "CircuitBreaker", "LatencyEstimator", "ModelError", "ModelReply", "PlannedCall", "RetryBudget", "RunDone",
    "RunTracer", "StepDone", "StepRecord", "TextDelta", "Tool", "ToolArgumentsError", "ToolCall", "ToolCallRecord",
    "ToolDone", "ToolError", "ToolExecutor", "ToolRegistry", "ToolResult", "critical_path_s", "make_tool",
    "parse_retry_after_s", "process_budget", "topological_waves",
]
