"""Agent sessions under memory pressure: residency policies side by side, in one run.

Replays real Claude Code sessions (../shared/traces/weka_claude_code: per-step
prompt growth, output length, and the real wait after each step) through the
in-process engine on the `small` model. C agents run concurrently (closed
loop); each takes the next session from the trace, runs its steps, and sleeps
the recorded tool/human wait between them. The device KV budget is set too
small to keep every waiting session resident, so the policy decides.

Token counts are divided by --token-scale and waits by --time-scale (stated in
the output); the prompt contents are random token ids, distinct per session.

    .venv/bin/python bench/sessions.py --policies discard,keep,ttl,least-waste,predictive
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sessionserve import LLMEngine, SamplingParams  # noqa: E402
from sessionserve.config import Config  # noqa: E402
from sessionserve.model.make_model import ensure_model  # noqa: E402
from sessionserve.workload.trace import AgentSession  # noqa: E402
from sessionserve.workload.weka import load_weka  # noqa: E402

TRACE = ROOT.parent / "shared" / "traces" / "weka_claude_code"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def replay(eng: LLMEngine, sessions: list[AgentSession], concurrency: int, seed: int) -> dict:
    """Run every session through `eng` with `concurrency` agents; return per-session and per-step figures."""
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(1, thread_name_prefix="engine")
    queue = list(sessions)
    waiters: dict[str, asyncio.Future] = {}
    jct: list[float] = []
    ttft: list[float] = []
    stats: list[dict] = []
    done = asyncio.Event()
    active = 0
    vocab = eng.runner.arch.vocab_size

    async def agent() -> None:
        nonlocal active
        while queue:
            trace = queue.pop(0)
            rng = random.Random(f"{seed}:{trace.session_id}")
            sid = eng.open_session()
            t0 = time.monotonic()
            for step in trace.steps:
                ids = [rng.randrange(100, vocab - 100) for _ in range(step.new_input_tokens)]
                params = SamplingParams(max_tokens=step.output_tokens, temperature=0, ignore_eos=True)
                rid = eng.add_request(ids, params, session_id=sid)
                fut = loop.create_future()
                waiters[rid] = fut
                out = await fut
                if out.first_token_s is not None:
                    ttft.append(out.first_token_s - out.arrival_s)
                if step.wait_kind != "end":
                    eng.park(sid, tools=step.tool_names)
                    await asyncio.sleep(step.wait_s)
            jct.append(time.monotonic() - t0)
            s = eng.get_session(sid).stats
            stats.append({"recompute_tokens": s.num_recompute_tokens, "prefill_tokens": s.num_computed_prompt_tokens,
                          "prefetch_hits": s.num_prefetch_hits, "prefetch_late": s.num_prefetch_late,
                          "restore_misses": s.num_restore_misses, "blocked_s": s.restore_blocked_s,
                          "offloaded_bytes": s.num_offloaded_bytes})
            eng.close_session(sid)
        active -= 1
        if active == 0:
            done.set()

    residency: list[dict] = []
    next_sample = 0.0

    async def engine_loop() -> None:
        nonlocal next_sample
        while not done.is_set():
            now = time.monotonic() - t_start
            if now >= next_sample:  # KV residency by tier over time, twice a second
                residency.append({"t_s": round(now, 2), **eng.kv_usage()})
                next_sample = now + 0.5
            outs = await loop.run_in_executor(pool, eng.step)
            for out in outs:
                if out.finished and out.request_id in waiters:
                    waiters.pop(out.request_id).set_result(out)
            if not outs and not eng.has_unfinished():
                await asyncio.sleep(0.002)

    t_start = time.monotonic()
    active = concurrency
    tasks = [asyncio.create_task(agent()) for _ in range(concurrency)]
    await asyncio.gather(engine_loop(), *tasks)
    pool.shutdown()
    makespan = time.monotonic() - t_start
    total = {k: sum(s[k] for s in stats) for k in stats[0]}
    return {
        "sessions": len(jct), "makespan_s": makespan, "sessions_per_hour": 3600 * len(jct) / makespan,
        "jct_p50_s": pct(jct, 0.5), "jct_p99_s": pct(jct, 0.99), "jct_mean_s": statistics.fmean(jct),
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99), **total,
        "preemptions": eng.core.scheduler.num_preemptions,
        "corrupt_restores": eng.sessions.num_corrupt_restores,
        "residency": residency,
    }


def run_policy(policy: str, model: str, sessions: list[AgentSession], args: argparse.Namespace) -> dict:
    config = Config.from_kwargs(
        kv_cache_bytes=args.device_kv_bytes, residency_policy=policy, host_kv_bytes=args.host_kv_bytes,
        disk_kv_bytes=args.disk_kv_bytes, num_threads=args.threads, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens)
    eng = LLMEngine(config, model)
    try:
        result = asyncio.run(replay(eng, sessions, args.concurrency, args.seed))
    finally:
        eng.kv.check_integrity()
        leaked = eng.kv.pool.num_blocks - eng.kv.num_free_blocks
        eng.close()
    result["leaked_blocks"] = leaked
    result["device_blocks"] = eng.runner.num_blocks
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="discard,keep,ttl,least-waste,predictive")
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded llama-small)")
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--num-sessions", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--token-scale", type=float, default=128.0)
    ap.add_argument("--time-scale", type=float, default=10.0)
    ap.add_argument("--max-context", type=int, default=1500)
    ap.add_argument("--max-wait-s", type=float, default=30.0, help="cap on a scaled wait (human waits are long)")
    ap.add_argument("--device-kv-bytes", type=int, default=160 << 20)
    ap.add_argument("--host-kv-bytes", type=int, default=2 << 30)
    ap.add_argument("--disk-kv-bytes", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-residency", action="store_true", help="store residency samples in the JSON")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "sessions.json"))
    args = ap.parse_args()

    model = args.model or str(ensure_model("llama", "small"))
    sessions = load_weka(args.trace, token_scale=args.token_scale, time_scale=args.time_scale,
                         max_steps=args.max_steps, max_context_tokens=args.max_context, min_steps=args.max_steps,
                         max_wait_s=args.max_wait_s, max_sessions=args.num_sessions)
    waits = [s.wait_s for t in sessions for s in t.steps if s.wait_kind != "end"]
    print(f"trace: {len(sessions)} weka_claude_code sessions x {args.max_steps} steps; tokens / {args.token_scale:g}, "
          f"waits / {args.time_scale:g} (capped at {args.max_wait_s:g} s): wait p50 {pct(waits, .5):.2f} s, "
          f"p90 {pct(waits, .9):.2f} s; context at end p50 {pct([t.num_tokens for t in sessions], .5)} tokens")
    print(f"device KV {args.device_kv_bytes >> 20} MiB, host KV {args.host_kv_bytes >> 20} MiB, "
          f"{args.concurrency} concurrent agents, model {model}")
    policies = args.policies.split(",")
    results: dict[str, list[dict]] = {p: [] for p in policies}
    for r in range(args.repeats):
        for policy in policies:
            res = run_policy(policy, model, sessions, args)
            results[policy].append(res)
            print(f"[{r + 1}/{args.repeats}] {policy:12s} {res['sessions_per_hour']:7.1f} sessions/h  "
                  f"JCT p50 {res['jct_p50_s']:6.1f} s p99 {res['jct_p99_s']:6.1f} s  TTFT p50 {res['ttft_p50_s']:.2f} s "
                  f"p99 {res['ttft_p99_s']:.2f} s  recompute {res['recompute_tokens']} tok  "
                  f"hits/late/miss {res['prefetch_hits']}/{res['prefetch_late']}/{res['restore_misses']}  "
                  f"preempt {res['preemptions']} leaked {res['leaked_blocks']}", flush=True)
            res.pop("residency") if not args.keep_residency else None
    base = statistics.median(x["sessions_per_hour"] for x in results.get("discard", results[policies[0]]))
    print("\n| policy | sessions/h (median) | vs discard | JCT p50 s | JCT p99 s | TTFT p99 s | recompute tokens |")
    print("|---|---|---|---|---|---|---|")
    for p in policies:
        rs = results[p]
        sph = statistics.median(x["sessions_per_hour"] for x in rs)
        print(f"| {p} | {sph:.1f} (min {min(x['sessions_per_hour'] for x in rs):.1f}) | {sph / base:.2f}x | "
              f"{statistics.median(x['jct_p50_s'] for x in rs):.1f} | {statistics.median(x['jct_p99_s'] for x in rs):.1f} | "
              f"{statistics.median(x['ttft_p99_s'] for x in rs):.2f} | "
              f"{statistics.median(x['recompute_tokens'] for x in rs):.0f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "machine": platform.processor() or platform.machine(),
                               "date": time.strftime("%Y-%m-%d"), "results": results}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
