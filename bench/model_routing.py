"""Step routing on an agent trace: `model: "auto"` (large plans, small executes) vs the large model alone.

One server with both models (`sessionserve serve --model large=... --model
small=...`, the trained pair by default); the same agent sessions are driven
through `/v1/chat/completions` first with `model: "large"` for every step,
then with `model: "auto"`, alternating for `--repeats` rounds, all against the
same warm server.

Sessions come from a real trace (`weka_claude_code` by default): per step the
new input tokens (the first step's system prompt and task; later, tool results
or the user's next message), the output length, and whether the step ended in
tool calls (then the next message is a tool result) or in text for the user.
Text of the right token length is cut from local Python sources. A step that
the trace ends in tool calls asks for one (`tool_choice: "required"`,
constrained decoding) from a few file/shell tools; the reply's real tool
calls are sent back with the next step's tool results, so routing sees real
tool errors (the trace carries no results: a stated share of tool results
are error outputs, `--tool-error-rate`). Closed loop of `--agents` concurrent
agents; tool waits from the trace, divided by `--time-scale`.

Reported per mode: sessions/hour (completed sessions / makespan; and sustained:
completions between the first completion and the last start, per hour, without
the drain at the end of the run), JCT p50/p99,
step latency p50/p99, the share of steps the small model ran, escalations.

    .venv/bin/python bench/model_routing.py                   # trained pair, 16 agents
    .venv/bin/python bench/model_routing.py --repeats 3 --agents 32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sessionserve.cli_bench import _machine  # noqa: E402
from sessionserve.workload.loader import load_trace  # noqa: E402
from sessionserve.workload.metrics import sustained_rate_per_hour  # noqa: E402
from sessionserve.workload.report import fmt  # noqa: E402
from sessionserve.workload.server_process import server_process  # noqa: E402
from sessionserve.workload.trace import AgentSession  # noqa: E402

MODELS = Path.home() / ".cache" / "sessionserve" / "models"
FILES = ["src/app.py", "src/utils.py", "src/db.py", "tests/test_app.py", "README.md", "setup.cfg"]
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string", "enum": FILES}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite",
                                      "parameters": {"type": "object", "properties": {
                                          "target": {"type": "string", "enum": ["all", "unit", "integration"]}},
                                          "required": ["target"]}}},
    {"type": "function", "function": {"name": "edit_file", "description": "Replace a line of a file",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string", "enum": FILES},
                                          "line": {"type": "integer", "minimum": 1, "maximum": 999}},
                                          "required": ["path", "line"]}}},
]
ERROR_TEXT = ("Traceback (most recent call last):\n  File \"src/app.py\", line 12, in <module>\n"
              "KeyError: 'config'\n")


class TextCutter:
    """Text of about n tokens (of the served models' tokenizer), cut from local Python sources."""

    def __init__(self, model_dir: Path, seed: int) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        lib = Path(os.__file__).parent
        text = "".join(p.read_text(errors="replace") for p in sorted(lib.glob("*.py"))[:60])
        self.ids = self.tok.encode(text).ids
        self.rng = random.Random(seed)

    def text(self, n: int) -> str:
        n = max(1, min(n, len(self.ids) - 1))
        start = self.rng.randrange(0, len(self.ids) - n)
        return self.tok.decode(self.ids[start:start + n])


@dataclass
class StepLog:
    model: str
    escalated: bool
    latency_s: float
    prompt_tokens: int
    cached_tokens: int


@dataclass
class SessionLog:
    start_s: float
    end_s: float = 0.0
    steps: list[StepLog] = field(default_factory=list)
    failed: str | None = None


async def run_session(client: Any, session: AgentSession, mode: str, cutter: TextCutter, a: argparse.Namespace,
                      rng: random.Random, tag: str) -> SessionLog:
    log = SessionLog(time.monotonic())
    sid = f"{tag}-{session.session_id}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent working in a Python repository. " +
         cutter.text(min(a.system_tokens, session.steps[0].new_input_tokens // 2))},
        {"role": "user", "content": cutter.text(max(8, session.steps[0].new_input_tokens // 2))}]
    try:
        for i, step in enumerate(session.steps):
            wants_tool = step.wait_kind == "tool"
            body: dict[str, Any] = {"model": mode, "messages": messages, "tools": TOOLS, "temperature": 0,
                                    "tool_choice": "required" if wants_tool else "none",
                                    "parallel_tool_calls": False,
                                    "max_tokens": max(a.min_tool_tokens, step.output_tokens) if wants_tool
                                    else max(4, step.output_tokens)}
            t0 = time.monotonic()
            r = await client.post("/v1/chat/completions", json=body, headers={"X-Session-ID": sid})
            if r.status_code != 200:
                raise RuntimeError(f"step {i}: HTTP {r.status_code} {r.text[:200]}")
            out = r.json()
            usage = out["usage"]
            log.steps.append(StepLog(out["model"], "escalated_from" in out, time.monotonic() - t0,
                                     usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
            msg = out["choices"][0]["message"]
            if i + 1 == len(session.steps):
                break
            nxt = session.steps[i + 1]
            if wants_tool and msg.get("tool_calls"):
                messages.append({"role": "assistant", "content": msg.get("content"), "tool_calls": msg["tool_calls"]})
                await asyncio.sleep(step.wait_s / a.time_scale)
                calls = msg["tool_calls"]
                for call in calls:
                    result = ERROR_TEXT if rng.random() < a.tool_error_rate else cutter.text(
                        max(4, nxt.new_input_tokens // len(calls)))
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            else:
                messages.append({"role": "assistant", "content": msg.get("content") or "done"})
                await asyncio.sleep(min(step.wait_s, a.max_human_wait_s) / a.time_scale)
                messages.append({"role": "user", "content": cutter.text(max(4, nxt.new_input_tokens))})
    except Exception as exc:  # noqa: BLE001 - recorded as a failed session
        log.failed = str(exc)
    finally:
        log.end_s = time.monotonic()
        with contextlib.suppress(Exception):
            await client.delete(f"/v1/sessions/{sid}")
    return log


async def run_mode(url: str, sessions: list[AgentSession], mode: str, cutter: TextCutter,
                   a: argparse.Namespace, tag: str) -> dict[str, Any]:
    import httpx

    rng = random.Random(a.seed)
    queue: asyncio.Queue[AgentSession] = asyncio.Queue()
    for s in sessions:
        queue.put_nowait(s)
    logs: list[SessionLog] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def agent() -> None:
            while not queue.empty():
                logs.append(await run_session(client, queue.get_nowait(), mode, cutter, a, rng, tag))

        t0 = time.monotonic()
        await asyncio.gather(*(agent() for _ in range(a.agents)))
        makespan = time.monotonic() - t0
    done = [lg for lg in logs if lg.failed is None]
    steps = [st for lg in done for st in lg.steps]
    jct = sorted(lg.end_s - lg.start_s for lg in done)
    lat = sorted(st.latency_s for st in steps)

    def pct(xs: list[float], q: float) -> float | None:
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None

    return {"mode": mode, "sessions": len(logs), "completed": len(done),
            "failed": [lg.failed for lg in logs if lg.failed][:3], "makespan_s": makespan,
            "sessions_per_hour": len(done) / makespan * 3600,
            # the rate while every agent has a session, without the drain at the end
            "sessions_per_hour_sustained": sustained_rate_per_hour(
                [lg.start_s - t0 for lg in logs], [None if lg.failed else lg.end_s - t0 for lg in logs], a.agents),
            "jct_p50_s": pct(jct, 0.5), "jct_p99_s": pct(jct, 0.99),
            "step_p50_s": pct(lat, 0.5), "step_p99_s": pct(lat, 0.99), "steps": len(steps),
            "share_small": sum(st.model == a.small_name for st in steps) / max(1, len(steps)),
            "escalations": sum(st.escalated for st in steps),
            "escalation_rate_of_small_steps": sum(st.escalated for st in steps) / max(
                1, sum(st.model == a.small_name or st.escalated for st in steps)),
            "cached_share": sum(st.cached_tokens for st in steps) / max(1, sum(st.prompt_tokens for st in steps))}


@contextlib.contextmanager
def server(a: argparse.Namespace, log_path: Path) -> Iterator[tuple[str, list[str]]]:
    """Our server with both models on `a.port`: yields its URL and command line."""
    cmd = [sys.executable, "-m", "sessionserve.cli", "serve", "--port", str(a.port),
           "--model", f"{a.large_name}={a.large}", "--model", f"{a.small_name}={a.small}",
           "--threads", str(a.threads), "--kv-cache-bytes", str(a.kv_cache_bytes), "--max-num-seqs", "64"]
    with server_process(cmd, a.port, log_path, start_timeout_s=300):
        yield f"http://127.0.0.1:{a.port}", cmd


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--large", type=Path, default=MODELS / "trained-target")
    p.add_argument("--small", type=Path, default=MODELS / "trained-draft")
    p.add_argument("--large-name", default="large")
    p.add_argument("--small-name", default="small")
    p.add_argument("--trace", default="weka_claude_code")
    p.add_argument("--traces-dir", default=None)
    p.add_argument("--num-sessions", type=int, default=32)
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--min-steps", type=int, default=4)
    p.add_argument("--max-context", type=int, default=2500, help="scaled tokens; longer sessions are cut")
    p.add_argument("--token-scale", type=float, default=64.0)
    p.add_argument("--time-scale", type=float, default=100.0, help="divide the trace's waits by this")
    p.add_argument("--max-human-wait-s", type=float, default=60.0, help="cap on a (real) human wait")
    p.add_argument("--system-tokens", type=int, default=200)
    p.add_argument("--min-tool-tokens", type=int, default=160, help="max_tokens of a step that must call a tool")
    p.add_argument("--tool-error-rate", type=float, default=0.1, help="share of tool results that are errors")
    p.add_argument("--agents", type=int, default=16, help="concurrent agents (closed loop)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-bytes", type=int, default=512 << 20, help="per model")
    p.add_argument("--port", type=int, default=8766)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "model_routing"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    for path in (a.large, a.small):
        if not (path / "config.json").is_file():
            raise SystemExit(f"no model at {path}: run `sessionserve make-model --train --pair` first")
    trace = load_trace(a.trace, traces_dir=a.traces_dir, token_scale=a.token_scale, time_scale=1.0,
                       max_sessions=a.num_sessions, max_steps=a.max_steps, min_steps=a.min_steps,
                       max_context_tokens=a.max_context, seed=a.seed)
    sessions = list(trace.sessions)
    cutter = TextCutter(a.large, a.seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{len(sessions)} sessions, {sum(len(s.steps) for s in sessions)} steps of {trace.name}",
          file=sys.stderr)
    runs: list[dict[str, Any]] = []
    with server(a, out / "server.log") as (url, cmd):
        # Warm-up: both models, with and without tools, so no one-time compile lands in a timed run.
        asyncio.run(run_mode(url, sessions[:2], "auto", cutter, a, "warm"))
        for r in range(a.repeats):
            for mode in ("large", "auto"):
                res = asyncio.run(run_mode(url, sessions, mode, cutter, a, f"{mode}{r}"))
                res["round"] = r
                runs.append(res)
                print(f"[{mode} #{r}] {fmt(res['sessions_per_hour'], 0)} sessions/h (sustained "
                      f"{fmt(res['sessions_per_hour_sustained'], 0)}), JCT p50 {res['jct_p50_s']:.1f} s "
                      f"p99 {res['jct_p99_s']:.1f} s, small {res['share_small']:.0%}, escalations "
                      f"{res['escalations']}, failed {res['sessions'] - res['completed']}", file=sys.stderr,
                      flush=True)
    summary: dict[str, Any] = {}
    for mode in ("large", "auto"):
        rs = [r for r in runs if r["mode"] == mode]
        summary[mode] = {k: {"min": min(r[k] for r in rs), "median": statistics.median(r[k] for r in rs)}
                         for k in ("sessions_per_hour", "jct_p50_s", "jct_p99_s", "step_p50_s", "step_p99_s",
                                   "share_small", "escalation_rate_of_small_steps")}
    pairs = list(zip([r for r in runs if r["mode"] == "auto"], [r for r in runs if r["mode"] == "large"],
                     strict=True))
    for key in ("sessions_per_hour", "sessions_per_hour_sustained"):
        ratios = [auto[key] / large[key] for auto, large in pairs if auto[key] and large[key]]
        if ratios:
            summary[f"auto_over_large_{key}"] = {"per_round": ratios, "min": min(ratios),
                                                 "median": statistics.median(ratios)}
    result = {"command": shlex.join(["bench/model_routing.py", *(argv if argv is not None else sys.argv[1:])]),
              "server": shlex.join(cmd), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": _machine(),
              "trace": trace.name, "provenance": list(trace.provenance), "settings": vars(a) | {
                  "large": str(a.large), "small": str(a.small)}, "runs": runs, "summary": summary}
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
