"""Simulator fidelity on held-out runs: step costs fitted on one set of real runs, compared on others.

The simulator's error is only worth stating on runs it was not fitted to. This
runs the real engine (in process, the bench harness) on a *training* workload
and fits the step cost model on its steps (`planning/fidelity.run_fidelity_online`);
then, for each *held-out* workload (another trace, another load), runs the
real engine again and simulates the same workload with the fitted costs and
with the calibrated profile given (`--profile`, measured on a synthetic grid
of batch shapes, so held out from every run). Errors are sim / real - 1 on
JCT, TTFT and TPOT at p50 and p99, sessions/h and makespan. JCT includes the
replayed tool waits, equal on both sides; TTFT and TPOT do not.

    .venv/bin/python bench/sim_fidelity.py --profile bench/profiles/llama-small-2core.json \\
        --out bench/results/sim-fidelity-20261206.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sessionserve.cli_bench import _machine  # noqa: E402
from sessionserve.modelgen.make_model import ensure_model  # noqa: E402
from sessionserve.planning.fidelity import FIDELITY_KEYS, compare_runs, run_fidelity_online  # noqa: E402
from sessionserve.sim.profile import load_profile  # noqa: E402
from sessionserve.planning.runs import run_sim  # noqa: E402
from sessionserve.workload.loader import load_trace  # noqa: E402
from sessionserve.workload.replay import LoadSpec  # noqa: E402
from sessionserve.workload.sweep import run_inproc  # noqa: E402

# (name, trace, agents): the first is fitted on, the others are held out.
WORKLOADS = (("train: weka, 4 agents", "weka_claude_code", 4),
             ("held out: mooncake, 4 agents", "mooncake_conversation", 4),
             ("held out: weka, 8 agents", "weka_claude_code", 8))


def errors(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per figure, the sim / real - 1 farthest from 0 over the policies."""
    out: dict[str, float | None] = {}
    for key in FIDELITY_KEYS:
        errs = [r["rel_error"] for r in rows if r["figure"] == key and r["rel_error"] is not None]
        out[key] = max(errs, key=abs) if errs else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", required=True, help="calibrated profile (JSON) for the model and machine")
    p.add_argument("--model-size", default="small", choices=("tiny", "small"))
    p.add_argument("--policies", default="discard,predictive")
    p.add_argument("--num-sessions", type=int, default=12)
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--max-context", type=int, default=1500)
    p.add_argument("--max-wait-s", type=float, default=1.0)
    p.add_argument("--device-kv-bytes", type=int, default=64 << 20)
    p.add_argument("--host-kv-bytes", type=int, default=256 << 20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="results JSON")
    a = p.parse_args()
    model_dir = ensure_model("llama", a.model_size)
    base = load_profile(a.profile)
    policies = [x for x in a.policies.split(",") if x]
    kwargs = dict(kv_cache_bytes=a.device_kv_bytes, host_kv_bytes=a.host_kv_bytes, num_threads=a.threads)

    def trace_of(name: str) -> Any:
        return load_trace(name, token_scale=128.0, time_scale=10.0, max_sessions=a.num_sessions,
                          max_steps=a.max_steps, min_steps=a.max_steps, max_context_tokens=a.max_context,
                          max_wait_s=a.max_wait_s, seed=a.seed)

    t0 = time.monotonic()
    label, trace_name, agents = WORKLOADS[0]
    loads = [LoadSpec("closed", concurrency=agents)]
    _real, _sim, fitted_rows, fitted = run_fidelity_online(trace_of(trace_name), policies, loads, model_dir, kwargs,
                                                           base, seed=a.seed)
    results: list[dict[str, Any]] = [{"workload": label, "fitted_on_it": fitted_rows}]
    print(f"{label}: fitted step = {fitted.step}", file=sys.stderr, flush=True)
    for label, trace_name, agents in WORKLOADS[1:]:
        trace, loads = trace_of(trace_name), [LoadSpec("closed", concurrency=agents)]
        real = run_inproc(trace, policies, loads, model_dir, kwargs, seed=a.seed)
        rows = {"fitted_elsewhere": compare_runs(real, run_sim(trace, policies, loads, fitted, kwargs, seed=a.seed)),
                "calibrated_profile": compare_runs(real, run_sim(trace, policies, loads, base, kwargs, seed=a.seed))}
        results.append({"workload": label, **rows})
        for how, r in rows.items():
            worst = errors(r)
            print(f"{label} ({how}): " + ", ".join(f"{k} {100 * v:+.1f}%" if v is not None else f"{k} -"
                                                   for k, v in worst.items()), flush=True)
    meta = {"command": " ".join([".venv/bin/python", "bench/sim_fidelity.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": _machine(), "wall_s": round(time.monotonic() - t0),
            "settings": {**vars(a), **kwargs}, "profile": base.label, "fitted_step": fitted.to_dict()["step"]}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({**meta, "workloads": results}, indent=1, default=str) + "\n")
    print(f"results: {a.out}")


if __name__ == "__main__":
    main()
