"""Loader for TraceLab round traces (JSONL, one LLM round per line, with real per-tool-call latencies).

A session is a `session_id`'s rounds by `round_index`. A round's tool calls
keep their names and effective latency (`tool_internal_latency_ms` if > 0,
else `tool_wall_latency_ms`, TraceLab's definition); calls whose
[emitted_at, result_at] intervals overlap share a parallel group. A round
with no tool call followed by a user-triggered round waits for the human:
from the round's last event to the next user message.
"""

from __future__ import annotations

import json
from collections import defaultdict
from datetime import datetime
from pathlib import Path

from sessionserve.workload.trace import AgentSession, Step, ToolCall, TraceSet


def _ts(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def tool_calls(tools: list[dict], time_scale: float = 1.0, max_wait_s: float | None = None) -> tuple[ToolCall, ...]:
    """A round's `tools[]` as ToolCalls; overlapping calls share a group, groups in emission order."""
    calls: list[ToolCall] = []
    group, group_end_s = -1, float("-inf")
    for t in sorted(tools, key=lambda t: (_ts(t["emitted_at"]), t.get("tool_index", 0))):
        start_s, end_s = _ts(t["emitted_at"]), _ts(t["result_at"])
        if start_s >= group_end_s:
            group += 1
        group_end_s = max(group_end_s, end_s)
        internal = t.get("tool_internal_latency_ms") or 0
        dur_s = (internal if internal > 0 else t["tool_wall_latency_ms"]) / 1000 / time_scale
        calls.append(ToolCall(t["tool_name"], dur_s if max_wait_s is None else min(dur_s, max_wait_s), group))
    return tuple(calls)


def tracelab_trace(path: str | Path, *, token_scale: float = 1.0, time_scale: float = 1.0,
                   max_steps: int | None = None, max_sessions: int | None = None, min_steps: int = 2,
                   max_context_tokens: int | None = None, max_wait_s: float | None = None,
                   **_: object) -> TraceSet:
    """Agent sessions from a TraceLab round trace; `provenance` says what is real and what is derived."""
    p = Path(path)
    rounds: dict[str, list[dict]] = defaultdict(list)
    with p.open() as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rounds[r["session_id"]].append(r)
    sessions: list[AgentSession] = []
    for sid, rs in rounds.items():
        rs.sort(key=lambda r: r["round_index"])
        steps: list[Step] = []
        context = 0
        for k, r in enumerate(rs):
            in_tok, out_tok = r["input_tokens_total"], r["output_tokens"] or 0
            grown = in_tok if k == 0 else in_tok - rs[k - 1]["input_tokens_total"] - (rs[k - 1]["output_tokens"] or 0)
            new, out = max(1, round(grown / token_scale)), max(1, round(out_tok / token_scale))
            if max_context_tokens is not None and context + new + out > max_context_tokens:
                break
            context += new + out
            nxt = rs[k + 1] if k + 1 < len(rs) else None
            if nxt is None or (max_steps is not None and len(steps) + 1 >= max_steps):
                steps.append(Step(new, out, (), "end"))
                break
            calls = tool_calls(r.get("tools") or [], time_scale, max_wait_s)
            if calls:
                steps.append(Step(new, out, calls, "tool"))
                continue
            # No tool call: the next round was a user's message; the wait is human time.
            last_s = max((_ts(e["timestamp"]) for e in r.get("timing_events", ())), default=None)
            user_s = min((_ts(e["timestamp"]) for e in nxt.get("timing_events", ())
                          if e["event_type"] == "user_message"), default=None)
            wait_s = max(0.0, user_s - last_s) / time_scale if last_s is not None and user_s is not None else 0.0
            steps.append(Step(new, out, (ToolCall("user", wait_s if max_wait_s is None else min(wait_s, max_wait_s)),),
                              "human"))
        if len(steps) >= min_steps:
            if steps[-1].wait_kind != "end":
                last = steps[-1]
                steps[-1] = Step(last.new_input_tokens, last.output_tokens, (), "end")
            sessions.append(AgentSession(sid, tuple(steps), None, "tracelab", {"provider": rs[0].get("provider")}))
        if max_sessions is not None and len(sessions) >= max_sessions:
            break
    prov = (
        "Sessions, lengths, tool names and per-call tool latencies are real: TraceLab round trace "
        "(github.com/uw-syfi/TraceLab example_sessions/sanitized/round_trace.jsonl, commit 9fb3d76, CC BY 4.0; "
        "Zhu et al., arXiv 2606.30560).",
        "A step's new input is the growth of input_tokens_total over the previous round's input plus output; "
        "tool latency is TraceLab's effective latency (internal if > 0, else wall); overlapping calls run in "
        "parallel.",
        "Arrivals are not used (the sample's sessions are from different days): the replay driver sets them.",
        "The shipped sample has 19 rounds in 2 sessions: a schema example, too small to benchmark with.",
    )
    return TraceSet(p.parent.name if p.is_file() else p.name, tuple(sessions), token_scale, time_scale, prov)
