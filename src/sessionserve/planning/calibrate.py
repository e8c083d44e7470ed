"""Calibration: measure the real engine on this machine, fit the step-cost model, write a profile.

Steps: run the real `LLMEngine` (the same config the bench uses) over a grid
of batch shapes — prefill lengths, decode batch sizes, context lengths — and
time every `step()` (scheduler, session tick and forward pass together), with
a recorder around the executor that notes each step's shape. Add the
in-process loop's per-step hop (`InprocBackend` runs each step through a
thread pool). Fit `overhead + per_seq*S + per_token*T + per_attn*A` by
non-negative least squares on relative error. Time KV copies to the host
and disk tiers with the mover's own gather/scatter and tier code.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sessionserve.obs.machine import cpu_model_name
from sessionserve.sim.cost_model import StepShape, plan_shape, step_seconds
from sessionserve.sim.profile import CostProfile, ModelShape, StepCost

if TYPE_CHECKING:
    from sessionserve.types.executor import Executor, ExecutorOutput
    from sessionserve.types.scheduler_output import SchedulerOutput

FEATURES = ("overhead_s", "per_seq_s", "per_token_s", "per_attn_s")


@dataclass(frozen=True)
class Grid:
    """Workloads run to completion, each a batch of equal requests: (num_seqs, prompt_len, max_tokens)."""

    batches: tuple[tuple[int, int, int], ...]
    repeats: int = 2

    @classmethod
    def quick(cls) -> Grid:
        return cls(tuple(itertools.product((1, 4, 16), (32, 256), (6,))) + ((1, 900, 2), (2, 600, 4)), repeats=1)

    @classmethod
    def full(cls) -> Grid:
        return cls(tuple(itertools.product((1, 2, 4, 8, 16, 32), (32, 128, 512, 1024), (12,)))
                   + ((1, 1400, 2), (4, 1400, 4)), repeats=2)


class _Recorder:
    """Wraps the real executor; remembers the shape of the last step it ran."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.last: StepShape | None = None

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput:
        self.last = plan_shape(plan)
        return self.inner.execute(plan)


class StepRecorder:
    """Records (shape, seconds) of the steps with work of a live `LLMEngine` (e.g. during a bench replay).

    `attach` wraps the engine's executor and its `step` method in place; the engine behaves as before. The
    seconds of a step are start to the next step's start, for a step followed at once by another step with
    work: everything the serving loop spends per step (scheduling, the loop's hop, the threads' share of
    the CPU), which is what the simulator's clock must advance by. Fitting these samples calibrates on the
    very run being compared ("online" calibration).
    """

    def __init__(self) -> None:
        self.shapes: list[StepShape] = []
        self.seconds: list[float] = []

    def attach(self, engine: Any) -> None:
        rec = _Recorder(engine.core.executor)
        engine.core.executor = rec
        inner_step = engine.step
        prev: list[Any] = [None]  # (shape, start) of the previous step with work

        def step() -> Any:
            rec.last = None
            t0 = time.perf_counter()
            out = inner_step()
            if rec.last is None:
                prev[0] = None
                return out
            if prev[0] is not None:
                self.shapes.append(prev[0][0])
                self.seconds.append(t0 - prev[0][1])
            prev[0] = (rec.last, t0)
            return out

        engine.step = step


def features(shape: StepShape) -> list[float]:
    return [1.0, float(shape.num_seqs), float(shape.num_tokens), float(shape.num_attn_pairs)]


def fit_step_cost(shapes: Sequence[StepShape], seconds: Sequence[float]) -> tuple[StepCost, dict[str, float]]:
    """Non-negative least squares on relative error (every subset of the 4 terms; keep the best feasible).

    Returns the coefficients and the fit's error figures (relative, per step).
    """
    x = np.array([features(s) for s in shapes])
    y = np.array(seconds)
    w = 1.0 / y
    best: tuple[float, np.ndarray] | None = None
    for k in range(1, 5):
        for cols in itertools.combinations(range(4), k):
            coef, *_ = np.linalg.lstsq(x[:, cols] * w[:, None], y * w, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(4)
            full[list(cols)] = coef
            err = float(np.sum(((x @ full) - y) ** 2 * w ** 2))
            if best is None or err < best[0]:
                best = (err, full)
    assert best is not None
    cost = StepCost(*(float(v) for v in best[1]))
    rel = np.abs(np.array([step_seconds(s, cost) for s in shapes]) - y) / y
    return cost, {"num_steps": len(y), "rel_error_median": float(np.median(rel)),
                  "rel_error_p90": float(np.quantile(rel, 0.9)), "rel_error_mean": float(rel.mean())}


def measure_steps(engine: Any, grid: Grid) -> tuple[list[StepShape], list[float]]:
    """Run each batch of the grid on `engine` (an `LLMEngine`); (shape, seconds) of every step with work."""
    from sessionserve.types.sampling_params import SamplingParams

    rec = _Recorder(engine.core.executor)
    engine.core.executor = rec
    shapes: list[StepShape] = []
    seconds: list[float] = []
    vocab = engine.runner.arch.vocab_size
    n = 0
    for _ in range(grid.repeats):
        for num_seqs, prompt_len, max_tokens in grid.batches:
            for i in range(num_seqs):
                n += 1
                ids = [100 + (n * 7919 + j * 31) % (vocab - 200) for j in range(prompt_len)]  # no shared prefixes
                engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
            while engine.has_unfinished():
                rec.last = None
                t0 = time.perf_counter()
                engine.step()
                dt = time.perf_counter() - t0
                if rec.last is not None:
                    shapes.append(rec.last)
                    seconds.append(dt)
    engine.core.executor = rec.inner
    return shapes, seconds


def measure_loop_hop_s(num: int = 300) -> float:
    """Mean cost of one step's hop through the in-process backend's thread pool and asyncio loop."""
    async def run() -> float:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as pool:
            await loop.run_in_executor(pool, lambda: None)
            t0 = time.perf_counter()
            for _ in range(num):
                await loop.run_in_executor(pool, lambda: None)
            return (time.perf_counter() - t0) / num
    return asyncio.run(run())


def measure_copies(kv_caches: Any, num_blocks: int = 64, repeats: int = 3) -> dict[str, float]:
    """Bytes/s of offload+restore to the host tier and the disk tier, with the mover's code paths."""
    from sessionserve.cache.disk_tier import DiskTier
    from sessionserve.cache.host_tier import HostTier
    from sessionserve.cache.kv_layout import KVLayout, gather_blocks, scatter_blocks

    layout = KVLayout.from_kv_caches(kv_caches)
    blocks = list(range(min(num_blocks, kv_caches[0][0].shape[0])))
    nbytes = len(blocks) * layout.block_bytes
    out: dict[str, float] = {}
    host = HostTier(layout, 2 * nbytes)
    with tempfile.TemporaryDirectory(prefix="sessionserve-calib-") as spool:
        disk = DiskTier(layout, spool, 4 * nbytes)
        for name in ("host", "disk"):
            total = 0.0
            for _ in range(repeats):
                t0 = time.perf_counter()
                data = gather_blocks(kv_caches, blocks)
                if name == "host":
                    ids = host.try_allocate(len(blocks))
                    assert ids is not None
                    host.write(ids, data)
                    back = host.read(ids)
                    host.free(ids)
                else:
                    handle = disk.try_reserve(len(blocks))
                    assert handle is not None
                    disk.write(handle, data)
                    back = disk.read(handle)
                    disk.free(handle)
                scatter_blocks(kv_caches, blocks, back)
                total += time.perf_counter() - t0
            out[name] = 2 * nbytes * repeats / total  # two one-way moves per round trip
        disk.close()
    return out


def measure_move_latency_s(kv_caches: Any, num: int = 20) -> float:
    """Mean time from handing a one-block offload or restore to `ThreadMover` to its completion in `poll()`."""
    from sessionserve.cache.host_tier import HostTier
    from sessionserve.cache.kv_layout import KVLayout
    from sessionserve.cache.mover import ThreadMover
    from sessionserve.types.kv_mover import Tier

    layout = KVLayout.from_kv_caches(kv_caches)
    mover = ThreadMover(kv_caches, HostTier(layout, 4 * layout.block_bytes), None)
    total = 0.0
    try:
        for i in range(num):
            for kind in ("offload", "restore"):
                t0 = time.perf_counter()
                if kind == "offload":
                    mover.offload(f"s{i}", [0], Tier.HOST)
                else:
                    mover.restore(f"s{i}", [0])
                while not mover.poll():
                    mover.wait(0.001)
                total += time.perf_counter() - t0
    finally:
        mover.close()
    return total / (2 * num)


def hardware_description() -> dict[str, Any]:
    import torch

    cpu = cpu_model_name()
    desc: dict[str, Any] = {"cpu": cpu, "num_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "system": f"{platform.system()} {platform.release()}",
                            "python": platform.python_version(), "torch": torch.__version__}
    try:
        desc["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        desc.update(accelerator=props.name, accelerator_memory_bytes=props.total_memory)
    return desc


def calibrate(model_dir: str | Path, engine_kwargs: dict[str, Any], grid: Grid | None = None,
              name: str | None = None) -> CostProfile:
    """Measure the real engine built from `engine_kwargs` (as `sessionserve bench` builds it) and fit a profile."""
    from sessionserve.config import Config
    from sessionserve.llm_engine import LLMEngine

    grid = grid or Grid.full()
    config = Config.from_kwargs(**{**engine_kwargs, "host_kv_bytes": 0, "disk_kv_bytes": 0})
    engine = LLMEngine(config, model_dir)
    try:
        warm = Grid(((2, 64, 4),), repeats=1)
        measure_steps(engine, warm)
        shapes, seconds = measure_steps(engine, grid)
        copies = measure_copies(engine.runner.kv_caches)
        move_latency_s = measure_move_latency_s(engine.runner.kv_caches)
        arch, runner = engine.runner.arch, engine.runner
        dtype_bytes = runner.block_bytes // (runner.block_size * arch.kv_bytes_per_token(1))
        model = ModelShape(name=Path(model_dir).name, num_params=arch.num_params(),
                           kv_bytes_per_token=arch.kv_bytes_per_token(dtype_bytes), vocab_size=arch.vocab_size,
                           max_model_len=runner.max_model_len, weight_bytes=arch.num_params() * dtype_bytes,
                           kv_dtype_bytes=dtype_bytes, head_dim=arch.head_dim)
        device = str(runner.device)
    finally:
        engine.close()
    hop_s = measure_loop_hop_s()
    cost, fit = fit_step_cost(shapes, seconds)
    cost = StepCost(cost.overhead_s + hop_s, cost.per_seq_s, cost.per_token_s, cost.per_attn_s)
    fit.update(loop_hop_s=hop_s, grid=[list(b) for b in grid.batches], repeats=grid.repeats,
               engine={k: v for k, v in engine_kwargs.items() if v is not None})
    hw = hardware_description()
    hw["device"] = device
    return CostProfile(
        name=name or f"{Path(model_dir).name}@{platform.node() or 'this-machine'}", kind="calibrated",
        hardware=hw, model=model, step=cost, host_copy_bytes_per_s=copies["host"],
        disk_copy_bytes_per_s=copies["disk"], move_latency_s=move_latency_s, fit=fit,
        notes="Measured by sessionserve calibrate: engine steps over a grid of batch shapes (scheduler and "
              "forward together) plus the in-process loop hop; KV copies with the mover's gather/scatter.",
        created=time.strftime("%Y-%m-%d %H:%M:%S"))
