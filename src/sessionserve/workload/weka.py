"""Loader for the WEKA Claude Code trace (`requests.csv` from ../shared/traces/weka_claude_code).

Real coding-agent sessions: per call the whole prompt size, output size, and
the client's wait before the call (tool time after a `tool_use` stop, human
time after `end_turn`). The trace has no tool names (every call is "tool")
and no arrival times (the replay driver sets them). Token counts and times are
divided by stated scale factors so a replay fits a CPU; ratios are kept.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

from sessionserve.workload.trace import AgentSession, Step, ToolCall


def load_weka(path: str | Path, *, token_scale: float = 1.0, time_scale: float = 1.0, max_steps: int | None = None,
              max_sessions: int | None = None, min_steps: int = 2, max_context_tokens: int | None = None,
              min_new_tokens: int = 1, max_wait_s: float | None = None) -> list[AgentSession]:
    """Main-agent sessions from `requests.csv` (or a folder holding it), in file order.

    token_scale / time_scale: divide token counts / waits by these. A session
    is cut at `max_steps` steps or when its scaled context would exceed
    `max_context_tokens`; human waits are kept but capped at `max_wait_s`.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "requests.csv"
    by_session: dict[str, list[dict[str, str]]] = defaultdict(list)
    with p.open(newline="") as f:
        for row in csv.DictReader(f):
            if row.get("stream", "main") == "main":
                by_session[row["session_id"]].append(row)
    sessions: list[AgentSession] = []
    for sid, rows in by_session.items():
        rows.sort(key=lambda r: int(r["req_idx"]))
        steps: list[Step] = []
        context = 0
        prev_total = 0
        for i, row in enumerate(rows):
            in_tok, out_tok = int(row["in_tokens"]), int(row["out_tokens"])
            new_in = in_tok if i == 0 else max(0, in_tok - prev_total)
            prev_total = in_tok + out_tok
            new_scaled = max(min_new_tokens, round(new_in / token_scale))
            out_scaled = max(1, round(out_tok / token_scale))
            if max_context_tokens is not None and context + new_scaled + out_scaled > max_context_tokens:
                break
            context += new_scaled + out_scaled
            nxt = rows[i + 1] if i + 1 < len(rows) else None
            if nxt is None or (max_steps is not None and len(steps) + 1 >= max_steps):
                steps.append(Step(new_scaled, out_scaled, (), "end"))
                break
            wait = float(nxt["think_time_s"] or 0.0) / time_scale
            kind = "tool" if row["stop"] == "tool_use" else "human"
            if max_wait_s is not None:
                wait = min(wait, max_wait_s)
            steps.append(Step(new_scaled, out_scaled, (ToolCall("tool" if kind == "tool" else "user", wait),), kind))
        if len(steps) >= min_steps:
            if steps[-1].wait_kind != "end":
                last = steps[-1]
                steps[-1] = Step(last.new_input_tokens, last.output_tokens, (), "end")
            sessions.append(AgentSession(sid, tuple(steps), source="weka_claude_code",
                                         meta={"token_scale": token_scale, "time_scale": time_scale}))
        if max_sessions is not None and len(sessions) >= max_sessions:
            break
    return sessions
