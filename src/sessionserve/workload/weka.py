"""Loader for the WEKA Claude Code trace (`requests.csv` from ../shared/traces/weka_claude_code).

Real coding-agent sessions: per call the whole prompt size, output size, and
the client's wait before the call (tool time after a `tool_use` stop, human
time after `end_turn`). The trace has no tool names (every call is "tool")
and no arrival times (the replay driver sets them). Token counts and times are
divided by stated scale factors so a replay fits a CPU; ratios are kept.

Prefix structure: a call whose common prefix with the previous call
(`lcp_prev_stream_blocks`, 64-token blocks) keeps less than `BREAK_KEEP_FRACTION`
of that call's blocks is a context compaction or restart: its step carries
`context_kept_tokens`. The hash ids are per session, so the trace cannot show
sharing across sessions; `weka_trace` adds the tool-definition prefix that
every session of one agent version shares, and says so in its provenance.
"""

from __future__ import annotations

import csv
import json
import statistics
from collections import defaultdict
from pathlib import Path

from sessionserve.workload.trace import AgentSession, Step, ToolCall, TraceSet

WEKA_BLOCK_TOKENS = 64
# A call keeping < 90% of the previous call's blocks broke the prefix (the kept fraction is bimodal: p50 0.23
# among breaks, > 0.98 otherwise; 2.9% of main-agent calls break).
BREAK_KEEP_FRACTION = 0.9
# Median `tool_tokens` of the 12 raw traces here (11,899-12,974): Claude Code's tool definitions, the same
# bytes in every session of one client version.
SHARED_TOOL_PREFIX_TOKENS = 12_439
SHARED_PREFIX_BLOCK_ID = 0


def load_weka(path: str | Path, *, token_scale: float = 1.0, time_scale: float = 1.0, max_steps: int | None = None,
              max_sessions: int | None = None, min_steps: int = 2, max_context_tokens: int | None = None,
              min_new_tokens: int = 1, max_wait_s: float | None = None,
              shared_prefix_tokens: int = 0) -> list[AgentSession]:
    """Main-agent sessions from `requests.csv` (or a folder holding it, or upstream `trace_*.json` files).

    token_scale / time_scale: divide token counts / waits by these. A session
    is cut at `max_steps` steps or when its scaled context would exceed
    `max_context_tokens`; human waits are kept but capped at `max_wait_s`.
    shared_prefix_tokens: unscaled tokens at the start of every session's
    first prompt given one shared block id (0: none).
    """
    by_session = _read_rows(Path(path))
    sessions: list[AgentSession] = []
    for sid, rows in by_session.items():
        rows.sort(key=lambda r: int(r["req_idx"]))
        steps = _steps(rows, token_scale, time_scale, max_steps, max_context_tokens, min_new_tokens, max_wait_s,
                       shared_prefix_tokens)
        if len(steps) >= min_steps:
            if steps[-1].wait_kind != "end":
                last = steps[-1]
                steps[-1] = Step(last.new_input_tokens, last.output_tokens, (), "end", last.prefix_block_ids,
                                 last.prefix_block_tokens, last.context_kept_tokens)
            sessions.append(AgentSession(sid, tuple(steps), source="weka_claude_code",
                                         meta={"token_scale": token_scale, "time_scale": time_scale}))
        if max_sessions is not None and len(sessions) >= max_sessions:
            break
    return sessions


def _read_rows(p: Path) -> dict[str, list[dict[str, str]]]:
    """Main-agent rows per session from `requests.csv`, or from upstream `trace_*.json` files (a file or folder)."""
    if p.is_dir() and (p / "requests.csv").is_file():
        p = p / "requests.csv"
    by_session: dict[str, list[dict[str, str]]] = defaultdict(list)
    if p.suffix == ".csv":
        with p.open(newline="") as f:
            for row in csv.DictReader(f):
                # NOTE: sub-agent calls (agent > 0) have their own req_idx from 0; mixing them in would interleave
                # two conversations.
                if row.get("stream", "main") == "main" and row.get("agent", "0") == "0":
                    by_session[row["session_id"]].append(row)
        return by_session
    files = sorted(p.glob("*.json")) if p.is_dir() else [p]
    for file in files:
        data = json.loads(file.read_text())
        if isinstance(data, dict) and "requests" in data:
            by_session[str(data.get("id", file.stem))] = raw_rows(data)
    return by_session


def raw_rows(trace: dict) -> list[dict[str, str]]:
    """The parent agent's main-stream calls of one upstream trace file, as `requests.csv`-style rows.

    Same derivation as shared/traces/weka_claude_code/derive.py: haiku calls
    are another stream; `lcp_prev_stream_blocks` is the common `hash_ids`
    prefix with the previous main-stream call.
    """
    rows: list[dict[str, str]] = []
    prev_hashes: list[int] | None = None
    for idx, r in enumerate(q for q in trace["requests"] if q.get("type") != "subagent"):
        if "haiku" in (r.get("model") or ""):
            continue
        hashes = r.get("hash_ids", [])
        lcp = ""
        if prev_hashes is not None:
            n = 0
            while n < min(len(prev_hashes), len(hashes)) and prev_hashes[n] == hashes[n]:
                n += 1
            lcp = str(n)
        rows.append({"req_idx": str(idx), "in_tokens": str(r["in"]), "out_tokens": str(r["out"]),
                     "think_time_s": str(r.get("think_time", "") or ""), "stop": r.get("stop", ""),
                     "n_blocks": str(len(hashes)), "lcp_prev_stream_blocks": lcp})
        prev_hashes = hashes
    return rows


def _steps(rows: list[dict[str, str]], token_scale: float, time_scale: float, max_steps: int | None,
           max_context_tokens: int | None, min_new_tokens: int, max_wait_s: float | None,
           shared_prefix_tokens: int) -> list[Step]:
    steps: list[Step] = []
    context = 0  # scaled tokens the replayed session holds
    prev_total = 0
    for i, row in enumerate(rows):
        in_tok, out_tok = int(row["in_tokens"]), int(row["out_tokens"])
        kept: int | None = None
        new_in = in_tok if i == 0 else max(0, in_tok - prev_total)
        if i > 0 and row.get("lcp_prev_stream_blocks"):
            lcp_blocks, prev_blocks = int(row["lcp_prev_stream_blocks"]), int(rows[i - 1]["n_blocks"])
            if lcp_blocks < BREAK_KEEP_FRACTION * prev_blocks:
                kept = min(context, round(lcp_blocks * WEKA_BLOCK_TOKENS / token_scale))
                new_in = in_tok - lcp_blocks * WEKA_BLOCK_TOKENS
        prev_total = in_tok + out_tok
        new_scaled = max(min_new_tokens, round(new_in / token_scale))
        out_scaled = max(1, round(out_tok / token_scale))
        base = context if kept is None else kept
        if max_context_tokens is not None and base + new_scaled + out_scaled > max_context_tokens:
            break
        context = base + new_scaled + out_scaled
        blocks: tuple[int, ...] = ()
        block_tokens = 0
        if i == 0 and shared_prefix_tokens > 0:
            blocks, block_tokens = (SHARED_PREFIX_BLOCK_ID,), min(new_scaled, round(shared_prefix_tokens / token_scale))
        nxt = rows[i + 1] if i + 1 < len(rows) else None
        if nxt is None or (max_steps is not None and len(steps) + 1 >= max_steps):
            steps.append(Step(new_scaled, out_scaled, (), "end", blocks, block_tokens, kept))
            break
        wait = float(nxt["think_time_s"] or 0.0) / time_scale
        kind = "tool" if row["stop"] == "tool_use" else "human"
        if max_wait_s is not None:
            wait = min(wait, max_wait_s)
        steps.append(Step(new_scaled, out_scaled, (ToolCall("tool" if kind == "tool" else "user", wait),), kind,
                          blocks, block_tokens, kept))
    return steps


def weka_trace(path: str | Path, *, token_scale: float = 1.0, time_scale: float = 1.0,
               max_steps: int | None = None, max_sessions: int | None = None, min_steps: int = 2,
               max_context_tokens: int | None = None, max_wait_s: float | None = None,
               shared_prefix_tokens: int = SHARED_TOOL_PREFIX_TOKENS, **_: object) -> TraceSet:
    """`load_weka` as a `TraceSet` whose provenance states every choice made for the replay."""
    sessions = load_weka(path, token_scale=token_scale, time_scale=time_scale, max_steps=max_steps,
                         max_sessions=max_sessions, min_steps=min_steps, max_context_tokens=max_context_tokens,
                         max_wait_s=max_wait_s, shared_prefix_tokens=shared_prefix_tokens)
    waits = [s.wait_s for t in sessions for s in t.steps if s.wait_kind == "tool"]
    num_breaks = sum(1 for t in sessions for s in t.steps if s.context_kept_tokens is not None)
    prov = [
        "Sessions, per-step prompt growth, output lengths and the wait before each call are real: WEKA "
        "kv-cache-tester Claude Code traces (github.com/callanjfox/kv-cache-tester, commit 94f6046, Apache-2.0), "
        "main agent only (sub-agent and haiku streams dropped).",
        "Arrival times are not in the trace (every session starts at t=0): the replay driver sets them "
        "(closed loop or Poisson), as stated in the run settings.",
        "Tool names are not in the trace: every tool wait is one call named 'tool' (after a tool_use stop) or "
        "'user' (after end_turn, human think time); waits are whole seconds in the trace.",
        f"Context compaction/restarts (a call keeping < {BREAK_KEEP_FRACTION:.0%} of the previous call's 64-token "
        f"blocks) cut the replayed context to the kept prefix: {num_breaks} such steps in this selection.",
        f"Cross-session sharing is not in the trace (hash ids are per session): we assume the first "
        f"{shared_prefix_tokens:,} tokens of every session (the median tool-definition size, `tool_tokens`, of "
        "the 12 raw files) are identical across sessions, as they are for one Claude Code version.",
    ]
    if max_wait_s is not None:
        prov.append(f"Scaled waits are capped at {max_wait_s:g} s (human waits reach hours).")
    if waits:
        prov.append(f"Scaled tool waits in this selection: p50 {statistics.median(waits):.2f} s, "
                    f"max {max(waits):.2f} s.")
    return TraceSet("weka_claude_code", tuple(sessions), token_scale, time_scale, tuple(prov))
