"""Failover: a replica killed mid-replay, its sessions continued from the KV store folder vs by recompute.

Starts a local Ray cluster with two Serve apps side by side, each an ingress
and N engine replicas behind our session/KV-aware router, same model and
settings; /store's replicas share a KV store folder (`kv_store_dir`), /plain's
do not. Replays the same agent trace over HTTP against each in turn (streamed
/v1/completions with X-Session-ID, full prompt every step) and, once a
fraction of the trace's steps is done, kills the replica that holds the most
sessions (`ray.kill`, no drain). Serve starts a replacement; meanwhile the
other replica continues the dead one's sessions: from the folder, or by
prefilling their histories again.

Reported per app: the TTFT of the dead replica's sessions' first turns after
the kill (the turns a failover serves), TTFT of every turn after the kill,
history tokens the heirs prefilled again, blocks read from the folder,
sessions/hour, JCT and failed sessions.

    .venv/bin/python bench/failover.py                 # defaults recorded in bench/RESULTS.md
    .venv/bin/python bench/failover.py --rounds 2 --num-sessions 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from bench.serve_bench import add_serve_args, engine_kwargs, load_bench_trace, start_cluster

MiB = 1 << 20


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_args(p, max_context=3000, token_scale=64.0, max_wait_s=2.0, device_kv_bytes=192 * MiB)
    p.add_argument("--load", type=int, default=8, help="closed loop: concurrent agents")
    p.add_argument("--kill-at", type=float, default=0.4, help="kill once this fraction of the steps is done")
    p.add_argument("--rounds", type=int, default=1, help="repeats; each round runs both apps, order alternating")
    args = p.parse_args()

    import httpx
    import ray
    from ray import serve

    from sessionserve.cli_bench import _machine
    from sessionserve.modelgen.make_model import ensure_model
    from sessionserve.router.ray_app import ServeOptions, build_app
    from sessionserve.router.store import SQLiteStore
    from sessionserve.workload.http_backend import HttpBackend
    from sessionserve.workload.replay import LoadSpec, replay
    from sessionserve.workload.results import build_results

    model_dir = ensure_model("llama", args.model_size)
    trace = load_bench_trace(args)
    total_steps = sum(len(s.steps) for s in trace.sessions)
    load = LoadSpec("closed", concurrency=args.load)
    engine = engine_kwargs(args)
    out = Path(args.out or ROOT / "bench" / "out" / f"failover-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    kv_dir = Path(tempfile.mkdtemp(prefix="sessionserve-kv-store-"))

    port = start_cluster(args.threads)

    def deploy(name: str, round_no: int) -> SQLiteStore:
        db = out / f"{name}-{round_no}.db"
        kwargs = {**engine, "kv_store_dir": str(kv_dir / f"{name}-{round_no}")} if name == "store" else engine
        opts = ServeOptions(num_replicas=args.replicas, model=str(model_dir), model_name="m", engine_kwargs=kwargs,
                            store_url=f"sqlite://{db}", router="session_kv", replica_num_cpus=0)
        serve.run(build_app(opts), name=name, route_prefix=f"/{name}")
        return SQLiteStore(db)

    def run_one(name: str, round_no: int) -> dict:
        store = deploy(name, round_no)
        url = f"http://127.0.0.1:{port}/{name}"

        def stats() -> dict:
            return httpx.get(url + "/router/stats", timeout=30).json()

        box: dict = {}

        def drive() -> None:
            box["result"] = asyncio.run(replay(HttpBackend(url, model="m", seed=args.seed), trace.sessions, load,
                                               seed=args.seed))

        t0 = time.monotonic()
        worker = threading.Thread(target=drive)
        worker.start()
        victim, owned, kill_s = None, [], None
        while worker.is_alive():
            time.sleep(0.25)
            replicas = stats()["replicas"]
            if sum(r.get("num_turns", 0) for r in replicas.values()) >= args.kill_at * total_steps:
                victim = max(replicas, key=lambda r: len(store.owned_by(r)))
                owned = [k.split("/", 1)[1] for k in store.owned_by(victim)]
                kill_s = time.monotonic() - t0
                ray.kill(ray.get_actor(f"SERVE_REPLICA::{name}#Engine#{victim}", namespace="serve"),
                         no_restart=True)
                break
        worker.join()
        result = box["result"]
        final = stats()
        serve.delete(name)
        # The dead replica's sessions: their turns cut by the kill (continued on the heir) and their first turns
        # sent after it (the heir's first own turn of each).
        first_after: dict[str, float] = {}
        cut: list[float] = []
        after: list[float] = []
        for st in sorted(result.steps, key=lambda s: s.start_s):
            end_s = st.start_s + st.result.latency_s
            if kill_s is None or end_s < kill_s:
                continue
            if st.start_s < kill_s:
                if st.session_id in owned:
                    cut.append(st.result.latency_s)
                continue
            if st.result.ttft_s is not None:
                after.append(st.result.ttft_s)
                if st.session_id in owned and st.session_id not in first_after:
                    first_after[st.session_id] = st.result.ttft_s
        heirs = [r for rid, r in final["replicas"].items() if rid != victim]
        summary = build_results(trace, {name: [result]}, meta={}, baseline=name)["policies"][name]
        row = {"app": name, "round": round_no, "kill_s": kill_s, "victim_sessions": len(owned),
               "adopted_ttft": sorted(first_after.values()), "cut_latency": sorted(cut),
               "resumed_streams": final.get("ingress", {}).get("num_streams_resumed"), "after_ttft_p50": pct(after, 0.5),
               "after_ttft_p99": pct(after, 0.99),
               "recomputed_tokens": sum(r.get("num_tokens_recomputed", 0) for r in heirs),
               "adopted": sum(r.get("num_sessions_adopted", 0) for r in heirs),
               "store_blocks_loaded": sum(r.get("kv_store_num_blocks_loaded", 0) for r in heirs),
               "sessions_per_hour": summary["sessions_per_hour"], "jct_p50_s": summary["jct_p50_s"],
               "jct_p99_s": summary["jct_p99_s"], "failed": summary["num_failed"],
               "errors": [f"{x.session_id}: {x.error}" for x in result.sessions if x.error][:5]}
        (out / f"{name}-{round_no}-router-stats.json").write_text(json.dumps(final, indent=1))
        print(json.dumps(row), flush=True)
        return row

    rows = []
    try:
        for round_no in range(args.rounds):
            order = ("store", "plain") if round_no % 2 == 0 else ("plain", "store")
            for name in order:
                rows.append(run_one(name, round_no))
    finally:
        serve.shutdown()
        ray.shutdown()

    def f(x: float | None, fmt: str = ".2f") -> str:
        return "n/a" if x is None else format(x, fmt)

    lines = [("| round | app | victim's sessions | their next turn's TTFT p50 / max s | turns cut: n, latency p50 s | "
              "TTFT p50 / p99 after the kill s | history tokens recomputed | blocks from the store | sessions/h | "
              "JCT p50 / p99 s | failed |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = r["adopted_ttft"]
        lines.append(f"| {r['round']} | {r['app']} | {r['victim_sessions']} | "
                     f"{f(statistics.median(a) if a else None)} / "
                     f"{f(max(a) if a else None)} | {len(r['cut_latency'])}, "
                     f"{f(statistics.median(r['cut_latency']) if r['cut_latency'] else None)} | {f(r['after_ttft_p50'])} / {f(r['after_ttft_p99'])} | "
                     f"{r['recomputed_tokens']} | {r['store_blocks_loaded']} | {f(r['sessions_per_hour'], '.1f')} | "
                     f"{f(r['jct_p50_s'])} / {f(r['jct_p99_s'])} | {r['failed']} |")
    for round_no in range(args.rounds):
        by = {r["app"]: r for r in rows if r["round"] == round_no}
        s, pl = by["store"]["adopted_ttft"], by["plain"]["adopted_ttft"]
        if s and pl:
            lines.append(f"\nround {round_no}: failover turns' TTFT median {statistics.median(pl):.2f} s (recompute) "
                         f"vs {statistics.median(s):.2f} s (store) = {statistics.median(pl) / statistics.median(s):.2f}x")
    meta = {"command": shlex.join([".venv/bin/python", "bench/failover.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": _machine(),
            "model": f"embedded llama {args.model_size}", "settings": {**engine, "load": args.load,
                                                                     "kill_at": args.kill_at}}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    summary = "\n".join(lines)
    (out / "summary.md").write_text(summary + "\n")
    print(summary)
    print(f"report: {out}")


if __name__ == "__main__":
    main()
