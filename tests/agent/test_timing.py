"""Step records: model time, tool phase, critical path, queueing; and reply assembly from chunks."""

from __future__ import annotations

import pytest

from sessionserve.agent.reply import StreamAssembler, reply_from_json
from sessionserve.agent.timing import StepRecord, ToolCallRecord


def test_step_record_figures() -> None:
    calls = [ToolCallRecord("a", "x", ready_s=1.0, started_s=1.0, finished_s=1.3, is_ok=True),
             ToolCallRecord("b", "y", ready_s=1.0, started_s=1.1, finished_s=1.2, is_ok=True)]
    rec = StepRecord(0, started_s=0.0, model_started_s=0.0, model_finished_s=1.0, tools_started_s=1.0,
                     tools_finished_s=1.32, critical_path_s=0.3, tool_calls=calls)
    assert rec.model_s == 1.0 and rec.tools_s == pytest.approx(0.32) and rec.sum_tool_s == pytest.approx(0.4)
    assert rec.queued_s == pytest.approx(0.1) and rec.overhead_s == pytest.approx(0.02)
    assert rec.step_s == pytest.approx(1.32)
    assert rec.summary()["num_tool_calls"] == 2
    answer = StepRecord(1, started_s=2.0, model_started_s=2.0, model_finished_s=2.5)
    assert answer.tools_s == 0.0 and answer.step_s == 0.5 and answer.overhead_s == 0.0


def test_reply_from_json_and_chunks_agree() -> None:
    body = {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}},
        {"type": "function", "function": {"name": "g"}}]}, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}}
    reply = reply_from_json(body)
    assert [(c.call_id, c.name, c.arguments) for c in reply.tool_calls] == [("c1", "f", "{\"a\": 1}"),
                                                                          ("call_1", "g", "")]
    assert reply.num_cached_tokens == 4 and reply.message()["content"] is None
    asm = StreamAssembler()
    for delta in ({"role": "assistant", "content": ""},
                  {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{\"a\""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}):
        asm.feed({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    asm.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    asm.feed({"choices": [], "usage": body["usage"]})
    streamed = asm.reply()
    assert streamed.tool_calls[0] == reply.tool_calls[0] and streamed.finish_reason == "tool_calls"
    assert streamed.content is None and streamed.num_cached_tokens == 4
