"""Engine step time while agent tools saturate their pool: shared cores vs separate CPU roles.

The engine decodes a steady batch in its own thread while an agent runtime
(`ToolExecutor`) keeps its tool pool full of CPU-bound tools (each a process,
as shells, test runs and builds are). Measured: the engine's step time with
the tools idle and with them saturating their pool, and each role's busy
fraction, in two layouts on the same machine:

- shared: the engine's compute threads and the tools run on any core;
- roles: the engine thread (and its compute threads) pinned to `--engine-cpus`,
  the tool pool (and the processes it starts) to `--tool-cpus`.

Each layout runs in its own process (torch's thread count is per process).

    .venv/bin/python bench/cpu_roles.py                  # both layouts, llama-small, batch 8
    .venv/bin/python bench/cpu_roles.py --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SPIN = "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < {s}:\n    pass\n"


def run_layout(a: argparse.Namespace) -> dict[str, Any]:
    """One layout in this process: step times idle, then under tool load."""
    import torch

    from sessionserve import LLMEngine, SamplingParams
    from sessionserve.agent.executor import PlannedCall, ToolExecutor
    from sessionserve.agent.retry import RetryBudget
    from sessionserve.agent.tools import ToolRegistry
    from sessionserve.config import Config
    from sessionserve.modelgen.make_model import ensure_model
    from sessionserve.obs.cpu_roles import ENGINE, RoleMeter, parse_cpus, pin_current_thread

    roles = a.layout == "roles"
    engine_cpus = parse_cpus(a.engine_cpus) if roles else None
    tool_cpus = parse_cpus(a.tool_cpus) if roles else None
    threads = len(engine_cpus) if engine_cpus else a.threads
    model = Path(a.model) if a.model else ensure_model("llama", "small")
    eng = LLMEngine(Config.from_kwargs(kv_cache_bytes=512 << 20, num_threads=threads, max_num_seqs=64), model)
    torch.set_num_threads(threads)

    registry = ToolRegistry()

    @registry.tool(description="a CPU-bound command (a test run, a build)")
    def run_command(seconds: float) -> str:
        subprocess.run([sys.executable, "-c", SPIN.format(s=seconds)], check=True)
        return "ok"

    tools = ToolExecutor(registry, budget=RetryBudget(), max_workers=a.tool_threads,
                         num_warm_threads=a.tool_threads, cpus=tool_cpus)
    engine_meter = RoleMeter(ENGINE, 1)
    phase = {"name": "warm-up"}
    steps: dict[str, list[float]] = {"warm-up": [], "idle": [], "loaded": []}
    stop = threading.Event()
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)

    def engine_loop() -> None:
        pin_current_thread(engine_cpus)
        torch.set_num_threads(threads)
        n = 0
        while not stop.is_set():
            while len(eng.core.scheduler.running) + len(eng.core.scheduler.waiting) < a.batch:
                eng.add_request([100 + (n * 7 + i) % 9000 for i in range(a.prompt_len)], params)
                n += 1
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            engine_meter.record(dt)
            steps[phase["name"]].append(dt)

    async def tool_load(duration_s: float) -> None:
        end = time.monotonic() + duration_s
        i = 0
        while time.monotonic() < end:
            calls = [PlannedCall(f"c{i}-{j}", "run_command", {"seconds": a.tool_seconds})
                     for j in range(a.tool_threads)]
            i += 1
            await tools.run_plan(calls)

    thread = threading.Thread(target=engine_loop, name="engine")
    thread.start()
    try:
        time.sleep(a.warmup_s)
        phase["name"] = "idle"
        time.sleep(a.phase_s)
        busy_idle = engine_meter.busy_fraction()
        phase["name"] = "loaded"
        asyncio.run(tool_load(a.phase_s))
        busy_loaded = {"engine": engine_meter.busy_fraction(), "tools": tools.meter.busy_fraction()}
    finally:
        stop.set()
        thread.join()
        tools.close()
        eng.close()

    def summary(xs: list[float]) -> dict[str, float]:
        xs = sorted(xs)
        return {"n": len(xs), "p50_ms": 1e3 * statistics.median(xs), "p90_ms": 1e3 * xs[int(0.9 * (len(xs) - 1))],
                "mean_ms": 1e3 * statistics.fmean(xs)}

    idle, loaded = summary(steps["idle"]), summary(steps["loaded"])
    return {"layout": a.layout, "engine_threads": threads, "engine_cpus": sorted(engine_cpus or []),
            "tool_cpus": sorted(tool_cpus or []), "idle": idle, "loaded": loaded,
            "p50_loaded_over_idle": loaded["p50_ms"] / idle["p50_ms"],
            "busy_fraction_idle": {"engine": busy_idle}, "busy_fraction_loaded": busy_loaded,
            "tool_calls": tools.meter.num_tasks, "tool_cpu_s": tools.meter.cpu_s}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layouts", default="shared,roles")
    p.add_argument("--layout", help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help="HF model folder (default: the embedded llama-small)")
    p.add_argument("--threads", type=int, default=2, help="engine compute threads in the shared layout")
    p.add_argument("--engine-cpus", default="0")
    p.add_argument("--tool-cpus", default="1")
    p.add_argument("--tool-threads", type=int, default=2, help="the tool pool's size (kept full)")
    p.add_argument("--tool-seconds", type=float, default=0.5, help="CPU seconds per tool call")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--phase-s", type=float, default=15.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "cpu_roles.json"))
    a = p.parse_args(argv)
    if a.layout:  # worker
        print(json.dumps(run_layout(a)))
        return
    results = []
    for r in range(a.repeats):
        for layout in a.layouts.split(","):
            cmd = [sys.executable, __file__, "--layout", layout, *(argv if argv is not None else sys.argv[1:])]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=dict(os.environ)).stdout
            res = json.loads(out.strip().splitlines()[-1]) | {"round": r}
            results.append(res)
            print(f"[{layout} #{r}] step p50 idle {res['idle']['p50_ms']:.1f} ms, with tools "
                  f"{res['loaded']['p50_ms']:.1f} ms ({res['p50_loaded_over_idle']:.2f}x); busy: engine "
                  f"{res['busy_fraction_loaded']['engine']:.0%}, tools {res['busy_fraction_loaded']['tools']:.0%} "
                  f"({res['tool_calls']} calls)", file=sys.stderr, flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": " ".join(["bench/cpu_roles.py", *(argv or sys.argv[1:])]),
                                       "date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": results}, indent=1))


if __name__ == "__main__":
    main()
