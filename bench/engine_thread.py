"""Decode steps on the engine thread while the thread that loaded the model keeps its OpenMP pool, or not.

    .venv/bin/python bench/engine_thread.py [--context 3000] [--rounds 6] [--steps 25]

The server loads a model on one thread (the main one) and steps it on another (the bridge's engine
thread). GNU OpenMP keeps a worker pool for each thread that ran a parallel region; with more pool threads
than CPUs, every pool's workers sleep after each region instead of spinning, so each operator of a step
waits for a futex wake (`sessionserve.obs.cpu_roles`). This loads the embedded `small` model on the main
thread, sends one sequence of `--context` random tokens, and steps it on a second thread in rounds that
alternate: "kept", the main thread having just run a parallel region (its pool exists, as after loading),
and "let go", after `release_compute_threads()` on the main thread (what the bridge does). Per round: the
median step in ms and the process's voluntary context switches per step (every thread, from /proc). The
step is one sequence's decode, as at one agent; the KV grows by `--steps` tokens per round.
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sessionserve.config import Config
from sessionserve.llm_engine import LLMEngine
from sessionserve.modelgen.make_model import ensure_model
from sessionserve.obs.cpu_roles import release_compute_threads
from sessionserve.types.sampling_params import SamplingParams


def voluntary_switches() -> int:
    """Voluntary context switches of every thread of this process so far."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except (FileNotFoundError, StopIteration):
            continue
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=6, help="rounds of each arm, alternating")
    p.add_argument("--steps", type=int, default=25, help="timed steps per round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()

    engine = LLMEngine(Config.from_kwargs(kv_cache_bytes=256 << 20, num_threads=args.threads, dtype=args.dtype),
                       ensure_model("llama", "small"))
    rng = random.Random(0)
    prompt = [rng.randrange(100, 16000) for _ in range(args.context)]
    engine.add_request(prompt, SamplingParams(max_tokens=10 * args.rounds * args.steps + 100, temperature=0,
                                              ignore_eos=True))
    jobs: queue.Queue[int] = queue.Queue()
    done: queue.Queue[tuple[float, int]] = queue.Queue()

    def stepper() -> None:  # the engine thread
        while (n := jobs.get()) > 0:
            switches, times = voluntary_switches(), []
            for _ in range(n):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            done.put((1e3 * statistics.median(times), voluntary_switches() - switches))

    threading.Thread(target=stepper, name="engine", daemon=True).start()
    jobs.put(10)  # the prefill and a few decodes, untimed
    done.get()
    spare = torch.ones(1 << 20)
    rows: dict[str, list[tuple[float, int]]] = {"kept": [], "let go": []}
    for r in range(2 * args.rounds):
        arm = "kept" if r % 2 == 0 else "let go"
        spare.mul_(1.0)  # a parallel region on the main thread: its pool exists again
        if arm == "let go":
            release_compute_threads()
        jobs.put(args.steps)
        rows[arm].append(done.get())
    jobs.put(0)

    print(f"{torch.get_num_threads()} threads, {args.dtype}, one sequence after {args.context} tokens, "
          f"{args.steps} steps per round, arms alternating\n")
    print("| round | kept: step ms | kept: switches / step | let go: step ms | let go: switches / step "
          "| let go / kept |")
    print("|---|---|---|---|---|---|")
    for i, ((k_ms, k_sw), (g_ms, g_sw)) in enumerate(zip(rows["kept"], rows["let go"]), 1):
        print(f"| {i} | {k_ms:.1f} | {k_sw / args.steps:.0f} | {g_ms:.1f} | {g_sw / args.steps:.0f} | "
              f"{g_ms / k_ms:.2f} |")
    ratios = sorted(g / k for (k, _), (g, _) in zip(rows["kept"], rows["let go"]))
    print(f"\nlet go / kept per round: min {ratios[0]:.2f}, median {statistics.median(ratios):.2f}, "
          f"max {ratios[-1]:.2f}")


if __name__ == "__main__":
    main()
