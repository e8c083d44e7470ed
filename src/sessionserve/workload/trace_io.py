"""Agent traces on disk: versioned JSONL, one header line then one session per line.

    {"format": "sessionserve.agent_trace", "version": 1, "name": ..., "token_scale": ..., "time_scale": ...,
     "provenance": [...]}
    {"session_id": "s1", "arrival_s": null, "source": "...", "meta": {}, "priority": "interactive",
     "steps": [{"new_input_tokens": 900, "output_tokens": 120, "wait_kind": "tool",
                "tool_calls": [{"name": "Bash", "duration_s": 0.4, "group": 0}],
                "prefix_block_ids": [0, 1], "prefix_block_tokens": 64, "context_kept_tokens": null}, ...]}

Optional keys (a session's `priority` and `subagents`, a step's prefix and kept-context fields) may be left out
(their defaults apply). A sub-agent is `{"after_step": 3, "duration_s": 41.0, "blocking": true, "session": {...}}`
with a session in the same form. A reader refuses a newer `version` than it knows, so an old harness never
misreads a new trace.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sessionserve.workload.trace import SCHEMA_VERSION, AgentSession, Step, SubAgent, ToolCall, TraceSet

FORMAT = "sessionserve.agent_trace"


def step_to_dict(step: Step) -> dict[str, Any]:
    d: dict[str, Any] = {"new_input_tokens": step.new_input_tokens, "output_tokens": step.output_tokens,
                         "wait_kind": step.wait_kind,
                         "tool_calls": [{"name": c.name, "duration_s": c.duration_s, "group": c.group}
                                        for c in step.tool_calls]}
    if step.prefix_block_ids:
        d["prefix_block_ids"] = list(step.prefix_block_ids)
        d["prefix_block_tokens"] = step.prefix_block_tokens
    if step.context_kept_tokens is not None:
        d["context_kept_tokens"] = step.context_kept_tokens
    return d


def step_from_dict(d: dict[str, Any]) -> Step:
    calls = tuple(ToolCall(str(c["name"]), float(c["duration_s"]), int(c.get("group", 0)))
                  for c in d.get("tool_calls", ()))
    kept = d.get("context_kept_tokens")
    return Step(int(d["new_input_tokens"]), int(d["output_tokens"]), calls, str(d.get("wait_kind", "tool")),
                tuple(int(b) for b in d.get("prefix_block_ids", ())), int(d.get("prefix_block_tokens", 0)),
                None if kept is None else int(kept))


def session_to_dict(session: AgentSession) -> dict[str, Any]:
    d = {"session_id": session.session_id, "arrival_s": session.arrival_s, "source": session.source,
         "meta": session.meta, "steps": [step_to_dict(s) for s in session.steps]}
    if session.priority != "interactive":
        d["priority"] = session.priority
    if session.subagents:
        d["subagents"] = [{"after_step": a.after_step, "duration_s": a.duration_s, "blocking": a.blocking,
                           "session": session_to_dict(a.session)} for a in session.subagents]
    return d


def session_from_dict(d: dict[str, Any]) -> AgentSession:
    arrival = d.get("arrival_s")
    subagents = tuple(SubAgent(int(a["after_step"]), session_from_dict(a["session"]), float(a["duration_s"]),
                               bool(a.get("blocking", True))) for a in d.get("subagents", ()))
    return AgentSession(str(d["session_id"]), tuple(step_from_dict(s) for s in d["steps"]),
                        None if arrival is None else float(arrival), str(d.get("source", "")), dict(d.get("meta", {})),
                        str(d.get("priority", "interactive")), subagents)


def write_jsonl(trace: TraceSet, path: str | Path) -> Path:
    """Write `trace` to `path` (parents created). Returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = {"format": FORMAT, "version": SCHEMA_VERSION, "name": trace.name, "token_scale": trace.token_scale,
              "time_scale": trace.time_scale, "provenance": list(trace.provenance)}
    with out.open("w") as f:
        f.write(json.dumps(header) + "\n")
        for session in trace.sessions:
            f.write(json.dumps(session_to_dict(session), separators=(",", ":")) + "\n")
    return out


def is_agent_jsonl(path: str | Path) -> bool:
    """True if the file's first line is a sessionserve agent-trace header."""
    try:
        with Path(path).open() as f:
            first = f.readline()
        return json.loads(first).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read_jsonl(path: str | Path) -> TraceSet:
    """Read a trace written by `write_jsonl`. Raises ValueError on another format or a newer version."""
    p = Path(path)
    with p.open() as f:
        lines: Iterable[str] = (line for line in f if line.strip())
        try:
            header = json.loads(next(iter(lines)))
        except StopIteration:
            raise ValueError(f"{p}: empty file") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ValueError(f"{p}: not a {FORMAT} file (first line must be its header)")
        version = int(header.get("version", 0))
        if not 1 <= version <= SCHEMA_VERSION:
            raise ValueError(f"{p}: trace schema version {version}; this harness reads 1..{SCHEMA_VERSION}")
        sessions = tuple(session_from_dict(json.loads(line)) for line in lines)
    return TraceSet(str(header.get("name", p.stem)), sessions, float(header.get("token_scale", 1.0)),
                    float(header.get("time_scale", 1.0)), tuple(header.get("provenance", ())))
