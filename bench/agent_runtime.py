"""Agent runtime: a step costs its critical path, and a failing dependency is not amplified by retries.

    .venv/bin/python bench/agent_runtime.py            # both parts; JSON to bench/out/agent_runtime.json
    .venv/bin/python bench/agent_runtime.py --quick    # fewer repeats and calls (smoke run)

(a) Concurrency. A local fake OpenAI endpoint (FastAPI on 127.0.0.1, instant
replies) asks for k tool calls in one step; each sleeps a random 50-300 ms
(seeded), half as sync tools (thread pool) and half async. The step runs
with the runtime's concurrent executor, then with the same tools limited to
one call at a time (`max_concurrent_calls=1`: sequential). Reported: the tool
phase against max(d) and sum(d), and the whole step (model call included).

(b) Retry amplification. 200 logical calls: agent runs whose model asks for
one call of a tool that fails 100% or 30% of the time (and a case where the
model endpoint itself answers 503 30% of the time). Policies:
  naive   every layer retries on its own: 3 tool attempts x 3 plans, 4 HTTP attempts
  budget  the same limits, but every retry (HTTP, tool, re-plan) draws from one RetryBudget (ratio 0.1)
  budget+breaker  plus a circuit breaker per tool
Attempts are counted at the tool and at the endpoint. A run with no failure
costs 3 attempts (model call, tool call, model call with the result). The
budget's 10 s window holds the whole run, so the bound (retries <= 10% of
the requests in the window) holds over all calls; the last half alone can
spend tokens the first half left unused (a token bucket's burst).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sessionserve.agent import (Agent, AgentConfig, Backoff, BreakerConfig, ChatClient, RetryBudget,  # noqa: E402
                                ToolExecutor, ToolRegistry)
from sessionserve.agent.fake_endpoint import FakeModelConfig, make_app, serve  # noqa: E402

NO_FAILURE_ATTEMPTS = 3  # model call + tool call + model call with the result


def sleep_tools() -> ToolRegistry:
    tools = ToolRegistry()

    def sleep_sync(ms: int) -> str:
        time.sleep(ms / 1000)
        return f"slept {ms} ms"

    async def sleep_async(ms: int) -> str:
        await asyncio.sleep(ms / 1000)
        return f"slept {ms} ms"

    tools.add(sleep_sync)
    tools.add(sleep_async)
    return tools


async def concurrency_part(url: str, ks: list[int], repeats: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    tools, budget = sleep_tools(), RetryBudget()
    agents = {mode: Agent(ChatClient(url, "k", budget=budget), tools, AgentConfig(use_sessions=False),
                          executor=ToolExecutor(tools, budget=budget, max_concurrent_calls=limit))
              for mode, limit in (("concurrent", None), ("sequential", 1))}
    for k in ks:
        for rep in range(repeats):
            durations_ms = [rng.randint(50, 300) for _ in range(k)]
            calls = [{"name": "sleep_sync" if i % 2 else "sleep_async", "arguments": {"ms": d}}
                     for i, d in enumerate(durations_ms)]
            task = json.dumps({"steps": [calls]})
            row = {"k": k, "rep": rep, "max_d_s": max(durations_ms) / 1000, "sum_d_s": sum(durations_ms) / 1000}
            for mode, agent in agents.items():
                result = await agent.run(task)
                step = result.steps[0]
                assert len(step.tool_calls) == k and all(c.is_ok for c in step.tool_calls)
                row[mode] = {"tools_s": step.tools_s, "model_s": step.model_s, "step_s": step.step_s,
                             "critical_path_s": step.critical_path_s, "measured_max_s": max(
                                 c.duration_s for c in step.tool_calls), "queued_s": step.queued_s}
            rows.append(row)
    for agent in agents.values():
        agent.close()
        await agent.client.aclose()
    return rows


def summarize_concurrency(rows: list[dict]) -> list[dict]:
    out = []
    for k in sorted({r["k"] for r in rows}):
        rs = [r for r in rows if r["k"] == k]
        med = statistics.median
        out.append({
            "k": k, "max_d_s": med(r["max_d_s"] for r in rs), "sum_d_s": med(r["sum_d_s"] for r in rs),
            "concurrent_tools_s": med(r["concurrent"]["tools_s"] for r in rs),
            "concurrent_step_s": med(r["concurrent"]["step_s"] for r in rs),
            "sequential_step_s": med(r["sequential"]["step_s"] for r in rs),
            "model_s": med(r["concurrent"]["model_s"] for r in rs),
            "tools_over_max_d": max(r["concurrent"]["tools_s"] / r["max_d_s"] for r in rs),
            "tools_over_measured_max": max(r["concurrent"]["tools_s"] / r["concurrent"]["measured_max_s"]
                                           for r in rs),
            "sequential_over_sum_d": med(r["sequential"]["tools_s"] / r["sum_d_s"] for r in rs),
            "speedup": med(r["sequential"]["step_s"] / r["concurrent"]["step_s"] for r in rs),
        })
    return out


POLICIES = {
    # budget ratio, breaker threshold (None: off)
    "naive": (None, None),
    "budget": (0.1, None),
    "budget+breaker": (0.1, 5),
}


async def amplification_case(tool_fail_rate: float, model_fail_rate: float, policy: str, num_calls: int,
                             concurrency: int, seed: int) -> dict:
    ratio, threshold = POLICIES[policy]
    budget = RetryBudget.unlimited() if ratio is None else RetryBudget(ratio=ratio, min_retries_per_s=0.5,
                                                                      window_s=10.0)
    rng = random.Random(seed)
    counts = {"tool": 0}

    def flaky(x: int) -> str:
        counts["tool"] += 1
        if rng.random() < tool_fail_rate:
            raise RuntimeError("dependency unavailable")
        return f"ok {x}"

    tools = ToolRegistry()
    tools.add(flaky, timeout_s=5.0)
    breaker = BreakerConfig(failure_threshold=threshold or 10**9, open_s=1.0)
    fast = dict(base_s=0.001, max_s=0.005)  # backoff shape as in production, scaled down to keep the run short
    executor = ToolExecutor(tools, budget=budget, backoff=Backoff(max_attempts=3, **fast), breaker=breaker,
                            rng=random.Random(seed), num_warm_threads=concurrency)
    app = make_app(FakeModelConfig(fail_rate=model_fail_rate, fail_status=503, retry_after_s=0, seed=seed))
    with serve(app) as url:
        client = ChatClient(url, "k", budget=budget, backoff=Backoff(max_attempts=4, **fast), rng=random.Random(seed))
        agent = Agent(client, tools, AgentConfig(max_steps=8, max_replans=2, use_sessions=False), executor=executor)
        task = json.dumps({"steps": [[{"name": "flaky", "arguments": {"x": 1}}]]})
        halves = []
        for half in range(2):
            tool0, model0 = counts["tool"], len(app.state.requests)
            sem = asyncio.Semaphore(concurrency)

            async def one() -> bool:
                async with sem:
                    result = await agent.run(task)
                    return result.stop_reason == "answer" and any(
                        m["role"] == "tool" and not m["content"].startswith("ERROR") for m in result.messages)

            oks = await asyncio.gather(*[one() for _ in range(num_calls // 2)])
            halves.append({"tool": counts["tool"] - tool0, "model": len(app.state.requests) - model0,
                           "num_ok": sum(oks)})
        agent.close()
        await client.aclose()
    n = num_calls
    tool_att, model_att = sum(h["tool"] for h in halves), sum(h["model"] for h in halves)
    last = halves[1]
    return {"tool_fail_rate": tool_fail_rate, "model_fail_rate": model_fail_rate, "policy": policy,
            "num_logical_calls": n, "tool_attempts_per_call": tool_att / n, "model_attempts_per_call": model_att / n,
            "total_vs_no_failure": (tool_att + model_att) / (NO_FAILURE_ATTEMPTS * n),
            "last_half_total_vs_no_failure": (last["tool"] + last["model"]) / (NO_FAILURE_ATTEMPTS * n / 2),
            "success_rate": sum(h["num_ok"] for h in halves) / n,
            "budget_retries": budget.num_retries, "budget_denied": budget.num_denied}


async def amplification_part(num_calls: int, concurrency: int, seed: int) -> list[dict]:
    rows = []
    for tool_fail, model_fail in [(0.0, 0.0), (1.0, 0.0), (0.3, 0.0), (0.0, 0.3)]:
        for policy in POLICIES:
            rows.append(await amplification_case(tool_fail, model_fail, policy, num_calls, concurrency, seed))
    return rows


def print_tables(conc: list[dict], amp: list[dict]) -> None:
    print("\n### (a) One step with k independent tools (50-300 ms each); medians, ratio = worst run\n")
    print("| k | max(d) s | sum(d) s | model s | concurrent step s | sequential step s | speedup "
          "| tools / max(d) | tools / measured max | sequential / sum(d) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in conc:
        print(f"| {r['k']} | {r['max_d_s']:.3f} | {r['sum_d_s']:.3f} | {r['model_s']:.3f} | "
              f"{r['concurrent_step_s']:.3f} | {r['sequential_step_s']:.3f} | {r['speedup']:.1f}x | "
              f"{r['tools_over_max_d']:.3f} | {r['tools_over_measured_max']:.3f} | {r['sequential_over_sum_d']:.3f} |")
    print("\n### (b) Attempts per logical call (no-failure run = 3 attempts: model, tool, model)\n")
    print("| tool fails | model 503s | policy | tool attempts/call | model attempts/call | total vs no-failure "
          "| last 100 calls | succeeded |")
    print("|---|---|---|---|---|---|---|---|")
    for r in amp:
        print(f"| {r['tool_fail_rate']:.0%} | {r['model_fail_rate']:.0%} | {r['policy']} | "
              f"{r['tool_attempts_per_call']:.2f} | {r['model_attempts_per_call']:.2f} | "
              f"{r['total_vs_no_failure']:.2f}x | {r['last_half_total_vs_no_failure']:.2f}x | "
              f"{r['success_rate']:.0%} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-calls", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=10, help="agent runs in flight in part (b)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "agent_runtime.json"))
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.num_calls = 1, 40
    ks = [int(k) for k in args.ks.split(",")]

    t0 = time.perf_counter()
    with serve(make_app()) as url:
        conc_rows = asyncio.run(concurrency_part(url, ks, args.repeats, args.seed))
    conc = summarize_concurrency(conc_rows)
    amp = asyncio.run(amplification_part(args.num_calls, args.concurrency, args.seed))
    print_tables(conc, amp)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"host": platform.node(), "python": platform.python_version(), "args": vars(args),
                               "wall_s": time.perf_counter() - t0, "concurrency": conc,
                               "concurrency_runs": conc_rows, "amplification": amp}, indent=1))
    print(f"\nwrote {out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
