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
import zlib
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

from sessionserve.workload.trace import AgentSession, Step, SubAgent, ToolCall, TraceSet

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
              shared_prefix_tokens: int = 0, subagents: bool = False,
              only_with_subagents: bool = False) -> list[AgentSession]:
    """Main-agent sessions from `requests.csv` (or a folder holding it, or upstream `trace_*.json` files).

    token_scale / time_scale: divide token counts / waits by these. A session
    is cut at `max_steps` steps or when its scaled context would exceed
    `max_context_tokens`; human waits are kept but capped at `max_wait_s`.
    shared_prefix_tokens: unscaled tokens at the start of every session's
    first prompt given one shared block id (0: none).
    subagents: attach each session's sub-agents (`SubAgent`, from the trace's
    markers) that start before its last kept step; only_with_subagents: keep
    only sessions that have one.
    """
    sessions: list[AgentSession] = []
    for sid, rows in _read_sessions(Path(path)).items():
        steps = _steps(rows.main, token_scale, time_scale, max_steps, max_context_tokens, min_new_tokens, max_wait_s,
                       shared_prefix_tokens)
        if len(steps) < min_steps:
            continue
        children = _subagents(sid, rows, steps, token_scale, time_scale, max_context_tokens, min_new_tokens,
                              max_wait_s) if subagents or only_with_subagents else ()
        if only_with_subagents and not children:
            continue
        sessions.append(AgentSession(sid, tuple(steps), source="weka_claude_code",
                                     meta={"token_scale": token_scale, "time_scale": time_scale},
                                     subagents=children if subagents else ()))
        if max_sessions is not None and len(sessions) >= max_sessions:
            break
    return sessions


@dataclass
class _SubagentRows:
    after: int  # index of the parent's main-stream call before the marker
    rows: list[dict[str, str]]


@dataclass
class _SessionRows:
    main: list[dict[str, str]] = field(default_factory=list)  # the parent's main-stream calls, in order
    subagents: list[_SubagentRows] = field(default_factory=list)


def _read_sessions(p: Path) -> dict[str, _SessionRows]:
    """Per session: the parent's main-stream rows and each sub-agent's rows, from `requests.csv` or upstream
    `trace_*.json` files (a file or folder)."""
    if p.is_dir() and (p / "requests.csv").is_file():
        p = p / "requests.csv"
    if p.suffix != ".csv":
        files = sorted(p.glob("*.json")) if p.is_dir() else [p]
        out: dict[str, _SessionRows] = {}
        for file in files:
            data = json.loads(file.read_text())
            if isinstance(data, dict) and "requests" in data:
                out[str(data.get("id", file.stem))] = raw_session(data)
        return out
    by_session: dict[str, _SessionRows] = defaultdict(_SessionRows)
    open_agents: dict[tuple[str, str], _SubagentRows] = {}
    with p.open(newline="") as f:
        # File order: a sub-agent's calls follow the parent call before its marker. Each agent numbers its own
        # calls (`req_idx`) from 0, so the streams are kept apart.
        for row in csv.DictReader(f):
            sess, agent = by_session[row["session_id"]], row.get("agent", "0")
            if agent == "0":
                if row.get("stream", "main") == "main":
                    sess.main.append(row)
                continue
            key = (row["session_id"], agent)
            if key not in open_agents:
                open_agents[key] = _SubagentRows(len(sess.main) - 1, [])
                sess.subagents.append(open_agents[key])
            open_agents[key].rows.append(row)
    for sess in by_session.values():
        sess.main.sort(key=lambda r: int(r["req_idx"]))
    return by_session


def raw_session(trace: dict) -> _SessionRows:
    """One upstream trace file as `requests.csv`-style rows: the parent's main-stream calls, and each
    sub-agent's calls with the blocks it had seen earlier in the session (`seen_blocks`).

    Same derivation as shared/traces/weka_claude_code/derive.py: haiku calls
    of the parent are another stream; `lcp_prev_stream_blocks` is the common
    `hash_ids` prefix with the previous call of the same stream.
    """
    out = _SessionRows()
    seen: set[int] = set()

    def row(r: dict, idx: int, prev_hashes: list[int] | None) -> dict[str, str]:
        hashes = r.get("hash_ids", [])
        lcp = ""
        if prev_hashes is not None:
            n = 0
            while n < min(len(prev_hashes), len(hashes)) and prev_hashes[n] == hashes[n]:
                n += 1
            lcp = str(n)
        return {"req_idx": str(idx), "in_tokens": str(r["in"]), "out_tokens": str(r["out"]),
                "think_time_s": str(r.get("think_time", "") or ""), "stop": r.get("stop", ""),
                "n_blocks": str(len(hashes)), "lcp_prev_stream_blocks": lcp, "t_s": str(r.get("t", 0.0)),
                "api_time_s": str(r.get("api_time", "") or ""),
                "seen_blocks": str(sum(1 for h in hashes if h in seen))}

    prev_main: list[int] | None = None
    for idx, r in enumerate(trace["requests"]):
        if r.get("type") == "subagent":
            sub = _SubagentRows(len(out.main) - 1, [])
            prev: list[int] | None = None
            for k, q in enumerate(r.get("requests", ())):
                sub.rows.append(row(q, k, prev))
                prev = q.get("hash_ids", [])
                seen.update(prev)
            out.subagents.append(sub)
            continue
        if "haiku" not in (r.get("model") or ""):
            out.main.append(row(r, idx, prev_main))
            prev_main = r.get("hash_ids", [])
        seen.update(r.get("hash_ids", []))
    return out


def _subagents(sid: str, rows: _SessionRows, steps: list[Step], token_scale: float, time_scale: float,
               max_context_tokens: int | None, min_new_tokens: int, max_wait_s: float | None) -> tuple[SubAgent, ...]:
    """The sub-agents started after one of the kept steps but the last, and the parent's waits rewritten: a
    step's wait covers its blocking sub-agents (replayed, not slept) plus the rest of its wait in the trace."""
    template = _template_block_id(sid)
    # The blocks a sub-agent shares with earlier ones are its template (system prompt and tool definitions of
    # the sub-agent type); the first one of a session defines it, as long as later ones reuse it.
    shared = [int(a.rows[0].get("seen_blocks") or 0) for a in rows.subagents]
    out: list[SubAgent] = []
    for k, agent in enumerate(rows.subagents):
        if not 0 <= agent.after < len(steps) - 1 or not agent.rows:
            continue
        sub_steps = _steps(agent.rows, token_scale, time_scale, None, max_context_tokens, min_new_tokens,
                           max_wait_s, 0)
        if not sub_steps:
            continue
        first_blocks = int(agent.rows[0]["n_blocks"])
        template_blocks = shared[k] or max(shared[k + 1:], default=0)
        if template_blocks:
            tokens = round(min(template_blocks, first_blocks) * WEKA_BLOCK_TOKENS / token_scale)
            sub_steps[0] = replace(sub_steps[0], prefix_block_ids=(template,),
                                   prefix_block_tokens=min(tokens, sub_steps[0].new_input_tokens))
        last = agent.rows[-1]
        duration = (float(last.get("t_s") or 0.0) + float(last.get("api_time_s") or 0.0)) / time_scale
        parent_wait = float(rows.main[agent.after + 1].get("think_time_s") or 0.0) / time_scale
        out.append(SubAgent(agent.after, AgentSession(f"{sid}.sub{k + 1}", tuple(sub_steps), source="weka_claude_code"),
                            duration, blocking=duration <= parent_wait + 2.0 / time_scale))
    for after in {a.after_step for a in out}:
        blocking = [a.duration_s for a in out if a.after_step == after and a.blocking]
        if blocking:  # the parent's own wait is what is left once its sub-agents are back
            step = steps[after]
            rest = max(0.0, step.wait_s - max(blocking))
            steps[after] = replace(step, tool_calls=tuple(replace(c, duration_s=rest) for c in step.tool_calls))
    return tuple(out)


def _template_block_id(session_id: str) -> int:
    """A shared-prefix block id for a session's sub-agent template: stable, never SHARED_PREFIX_BLOCK_ID."""
    return 1 + zlib.crc32(f"weka-subagent-template:{session_id}".encode())


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
    if steps and steps[-1].wait_kind != "end":  # cut by the context limit: nothing follows the last step
        steps[-1] = replace(steps[-1], tool_calls=(), wait_kind="end")
    return steps


def weka_trace(path: str | Path, *, token_scale: float = 1.0, time_scale: float = 1.0,
               max_steps: int | None = None, max_sessions: int | None = None, min_steps: int = 2,
               max_context_tokens: int | None = None, max_wait_s: float | None = None,
               shared_prefix_tokens: int = SHARED_TOOL_PREFIX_TOKENS, subagents: bool = False,
               only_with_subagents: bool = False, **_: object) -> TraceSet:
    """`load_weka` as a `TraceSet` whose provenance states every choice made for the replay."""
    sessions = load_weka(path, token_scale=token_scale, time_scale=time_scale, max_steps=max_steps,
                         max_sessions=max_sessions, min_steps=min_steps, max_context_tokens=max_context_tokens,
                         max_wait_s=max_wait_s, shared_prefix_tokens=shared_prefix_tokens, subagents=subagents,
                         only_with_subagents=only_with_subagents)
    waits = [s.wait_s for t in sessions for s in t.steps if s.wait_kind == "tool"]
    num_breaks = sum(1 for t in sessions for s in t.steps if s.context_kept_tokens is not None)
    prov = [
        "Sessions, per-step prompt growth, output lengths and the wait before each call are real: WEKA "
        "kv-cache-tester Claude Code traces (github.com/callanjfox/kv-cache-tester, commit 94f6046, Apache-2.0), "
        "main agent only (the parent's haiku side calls dropped)"
        + (", with its sub-agents." if subagents else "; sub-agents dropped."),
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
    children = [a for t in sessions for a in t.subagents]
    if subagents:
        prov.append(
            f"Sub-agents ({len(children)} in {sum(1 for t in sessions if t.subagents)} sessions) start where the "
            "trace's markers are, after the parent's call before the marker; those started together run "
            "concurrently. A sub-agent that ended before the parent's next call in the trace blocks it: the parent "
            "waits for the replayed sub-agents, then for the rest of its recorded wait (the recorded wait minus "
            "the sub-agents' recorded span); the others run in the background. A sub-agent's first prompt shares "
            "its leading blocks with earlier sub-agents of the session as far as the trace's `seen_blocks` says "
            "(their system prompt and tools; none with the parent's context, as in the trace). Sub-agents "
            "started at a session's last kept call are dropped.")
    if only_with_subagents:
        prov.append("Only sessions with at least one sub-agent are kept.")
    if max_wait_s is not None:
        prov.append(f"Scaled waits are capped at {max_wait_s:g} s (human waits reach hours).")
    if waits:
        prov.append(f"Scaled tool waits in this selection: p50 {statistics.median(waits):.2f} s, "
                    f"max {max(waits):.2f} s.")
    return TraceSet("weka_claude_code", tuple(sessions), token_scale, time_scale, tuple(prov))
