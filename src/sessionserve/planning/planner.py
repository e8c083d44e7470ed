"""The capacity planner: the cheapest replicas x host tier x residency policy meeting a p99 step-latency SLO.

Model: `users` concurrent agents (closed loop: each runs trace sessions back
to back) spread evenly over `r` identical replicas by a session-affine
router, so one replica serves ceil(users / r) agents and replicas do not
interact; we simulate one replica per candidate. For each (policy, host tier)
the replica count climbs a ladder (x1.5) until the SLO is met; every probe is
a row of the candidate table. Cost is replica-hours (plus host memory, if
priced); cost per 1k sessions = cost per hour / sessions per hour x 1000.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import random
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sessionserve.config import Config
from sessionserve.planning.driver import SimReplay
from sessionserve.sim.engine import SimEngine
from sessionserve.sim.profile import CostProfile
from sessionserve.workload.metrics import percentile
from sessionserve.workload.prompts import PromptBuilder
from sessionserve.workload.replay import LoadSpec
from sessionserve.workload.trace import AgentSession, TraceSet

GiB = 1 << 30
LADDER_FACTOR = 1.5


@dataclass(frozen=True)
class PlanQuestion:
    users: int
    slo_step_p99_s: float
    policies: tuple[str, ...] = ("discard", "keep", "least-waste", "predictive")
    host_gib: tuple[float, ...] = (0.0, 256.0)
    replicas: tuple[int, ...] | None = None  # None: the ladder
    device_kv_bytes: int | None = None  # None: the profile's device memory minus weights
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    admission: str = "auto"  # session admission (SchedulerConfig.admission), as the replicas would run
    sessions_per_user: float = 1.5
    host_gib_cost: float = 0.0  # replica-hours per GiB-hour of host tier
    max_sim_users: int = 64  # most agents per replica considered: the ladder starts at users / this
    max_probes: int = 14
    min_sessions: int = 32  # sessions per probe at least (agents run several back to back): a sample, not a few
    seed: int = 0


@dataclass(frozen=True)
class Candidate:
    policy: str
    host_gib: float
    replicas: int
    users_per_replica: int
    simulated_users: int
    step_p50_s: float | None  # resumed steps (see `probe`)
    step_p99_s: float | None  # resumed steps: the SLO's figure
    first_step_p99_s: float | None  # sessions' first steps (cold prefill of the whole prompt)
    jct_p99_s: float | None
    sessions_per_hour: float  # all replicas
    cost_per_hour: float  # replica-hours per hour
    cost_per_1k_sessions: float | None
    meets_slo: bool
    num_failed: int
    sim_wall_s: float
    simulated_s: float


class FastPromptBuilder(PromptBuilder):
    """Same shared-prefix structure as `PromptBuilder`; private ids are a run of consecutive ids from a
    key-hashed offset (list slicing, no per-token draws: coding prompts are 10^5 tokens).

    NOTE: the prefix cache only needs private tokens to differ between sessions; two keys collide with
    probability 1 / (vocab_size - 200).
    """

    def _ids(self, key: str, n: int) -> list[int]:
        lo, hi = 100, self.vocab_size - 100
        base = getattr(self, "_base", None)
        if base is None:
            base = self._base = list(range(lo, hi))
        start = zlib.crc32(f"{self.seed}:{key}".encode()) % len(base)
        out = base[start:start + n]
        while len(out) < n:
            out += base[:n - len(out)]
        return out


def replica_sessions(trace: TraceSet, num_sessions: int, seed: int) -> list[AgentSession]:
    """`num_sessions` sessions drawn from the trace (with replacement, fresh ids), in a seeded order."""
    rng = random.Random(f"plan:{seed}")
    picks = [rng.choice(trace.sessions) for _ in range(num_sessions)]
    return [AgentSession(f"{s.session_id}~{i}", s.steps, None, s.source, s.meta) for i, s in enumerate(picks)]


def probe(trace: TraceSet, profile: CostProfile, q: PlanQuestion, policy: str, host_gib: float,
          replicas: int) -> Candidate:
    """Simulate one replica of the candidate; scale to `replicas`."""
    import time

    users_per_replica = math.ceil(q.users / replicas)
    sim_users = users_per_replica
    kv_bytes = q.device_kv_bytes or profile.default_device_kv_bytes()
    if kv_bytes is None:
        raise ValueError(f"profile {profile.label} has no device memory size: give --device-kv-bytes")
    config = Config.from_kwargs(residency_policy=policy, kv_cache_bytes=kv_bytes, host_kv_bytes=int(host_gib * GiB),
                                disk_kv_bytes=0, max_num_seqs=q.max_num_seqs,
                                max_num_batched_tokens=q.max_num_batched_tokens, admission=q.admission,
                                max_sessions=max(10_000, 4 * sim_users), session_idle_ttl_s=1e9)
    engine = SimEngine(config, profile)
    sessions = replica_sessions(trace, max(q.min_sessions, math.ceil(sim_users * q.sessions_per_user)), q.seed)
    rep = SimReplay(engine, sessions, LoadSpec("closed", sim_users), q.seed)
    rep.builder = FastPromptBuilder(profile.model.vocab_size, q.seed)
    t0 = time.perf_counter()
    result = rep.run()
    wall = time.perf_counter() - t0
    # NOTE: the SLO is on resumed steps. A session's first step prefills its whole prompt (tens of thousands of
    # tokens in coding traces): its latency is that prefill, which no replica count shortens; it is reported apart.
    steps = [r.result.latency_s for r in result.steps if r.step_index > 0]
    first = [r.result.latency_s for r in result.steps if r.step_index == 0]
    done = [s for s in result.sessions if s.end_s is not None]
    failed = len(result.sessions) - len(done)
    per_replica_per_h = 3600 * len(done) / result.makespan_s if result.makespan_s > 0 else 0.0
    total_per_h = per_replica_per_h * replicas
    p99 = percentile(steps, 0.99)
    cost = replicas * (1.0 + host_gib * q.host_gib_cost)
    return Candidate(policy, host_gib, replicas, users_per_replica, sim_users, percentile(steps, 0.5), p99,
                     percentile(first, 0.99),
                     percentile([s.jct_s for s in done if s.jct_s is not None], 0.99), total_per_h, cost,
                     1000 * cost / total_per_h if total_per_h > 0 else None,
                     p99 is not None and p99 <= q.slo_step_p99_s and failed == 0, failed, wall, result.makespan_s)


def ladder(q: PlanQuestion) -> list[int]:
    if q.replicas is not None:
        return sorted(set(q.replicas))
    start = max(1, math.ceil(q.users / q.max_sim_users))
    rungs, r = [], start
    while len(rungs) < q.max_probes and r <= q.users:
        rungs.append(r)
        r = max(r + 1, math.ceil(r * LADDER_FACTOR))
    return rungs


@dataclass(frozen=True)
class PlanResult:
    question: PlanQuestion
    profile: CostProfile
    trace_name: str
    candidates: tuple[Candidate, ...]

    @property
    def best(self) -> Candidate | None:
        ok = [c for c in self.candidates if c.meets_slo]
        return min(ok, key=lambda c: (c.cost_per_hour, c.step_p99_s or 0.0)) if ok else None


def plan(trace: TraceSet, profile: CostProfile, q: PlanQuestion, jobs: int = 1) -> PlanResult:
    """Every (policy, host tier): climb the replica ladder until the SLO is met (or the ladder ends).

    The ladders are independent: with `jobs` > 1 they are climbed in that many worker processes (the
    same candidates, in the same order, as one process gives)."""
    series = [(policy, host_gib) for host_gib in q.host_gib for policy in q.policies
              # without a host tier the moving policies reduce to keep/drop: skip duplicates
              if not (host_gib == 0 and policy not in ("discard", "keep", "ttl") and "keep" in q.policies)]
    if jobs > 1 and len(series) > 1:
        # fork where there is one: the workers start without importing anything again
        ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
        with ProcessPoolExecutor(min(jobs, len(series)), mp_context=ctx) as pool:
            futures = [pool.submit(_climb, trace, profile, q, policy, h) for policy, h in series]
            ladders = [f.result() for f in futures]
    else:
        ladders = [_climb(trace, profile, q, policy, h) for policy, h in series]
    return PlanResult(q, profile, trace.name, tuple(c for cs in ladders for c in cs))


def _climb(trace: TraceSet, profile: CostProfile, q: PlanQuestion, policy: str, host_gib: float) -> list[Candidate]:
    out: list[Candidate] = []
    for r in ladder(q):
        c = probe(trace, profile, q, policy, host_gib, r)
        out.append(c)
        if c.meets_slo and q.replicas is None:
            break
    return out


def _f(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:,.{digits}f}"


def render_plan(result: PlanResult, meta: dict[str, Any]) -> str:
    q, p, best = result.question, result.profile, result.best
    lines = [f"# Capacity plan: {q.users:,} concurrent agents on {result.trace_name}, p99 step latency <= "
             f"{q.slo_step_p99_s:g} s (resumed steps)", "",
             f"Command: `{meta.get('command', '')}`  ", f"Date: {meta.get('date', '')}; planner wall time "
             f"{meta.get('wall_s', '?')} s", "",
             f"- Profile: **{p.label}**" + (" — DERIVED from published specs (roofline), not measured" if
                                            p.kind == "derived" else " — measured on " + str(p.hardware.get("cpu"))),
             f"- Model: {p.model.name}; KV {p.model.kv_bytes_per_token:,} bytes/token",
             f"- Replica: device KV {(q.device_kv_bytes or p.default_device_kv_bytes() or 0) / GiB:,.1f} GiB, "
             f"max_num_seqs {q.max_num_seqs}, max_num_batched_tokens {q.max_num_batched_tokens}",
             "- Model of the fleet: agents spread evenly over identical replicas (session affinity); one replica "
             "simulated per candidate; cost in replica-hours.", ""]
    if best is None:
        lines += ["**No candidate met the SLO.** Widen --replicas or relax the SLO.", ""]
    else:
        lines += [f"**Answer: {best.replicas:,} replicas, policy `{best.policy}`, host tier {best.host_gib:g} GiB "
                  f"per replica** — step latency p99 {_f(best.step_p99_s)} s, {best.sessions_per_hour:,.0f} "
                  f"sessions/h, {_f(best.cost_per_1k_sessions, 3)} replica-hours per 1k sessions.", ""]
    lines += ["Step latency = a resumed step's request to its last token (queueing, KV restore or recompute, prefill "
              "of the new input, decode). First steps (cold prefill of the whole prompt) are shown apart: no "
              "replica count shortens them.", "",
              "| policy | host GiB | replicas | agents/replica | step p50 s | step p99 s | first step p99 s | "
              "JCT p99 s | sessions/h | cost/h | cost per 1k sessions | meets SLO | sim s | wall s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in result.candidates:
        mark = "**yes**" if c is best else ("yes" if c.meets_slo else "no")
        lines.append(f"| {c.policy} | {c.host_gib:g} | {c.replicas:,} | {c.users_per_replica:,} "
                     f"| {_f(c.step_p50_s)} | {_f(c.step_p99_s)} | {_f(c.first_step_p99_s)} | {_f(c.jct_p99_s, 1)} | "
                     f"{c.sessions_per_hour:,.0f} | {c.cost_per_hour:,.0f} | {_f(c.cost_per_1k_sessions, 3)} | "
                     f"{mark} | {c.simulated_s:,.0f} | {c.sim_wall_s:.1f} |")
    lines += ["", "![goodput vs replicas](plan_goodput.png)", "![cost per 1k sessions](plan_cost.png)", ""]
    return "\n".join(lines) + "\n"


def write_plan(out_dir: str | Path, result: PlanResult, meta: dict[str, Any]) -> Path:
    """plan.md, plan.json, plan_goodput.png, plan_cost.png into `out_dir`; returns plan.md's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {"version": 1, **meta, "question": asdict(result.question), "profile": result.profile.to_dict(),
            "trace": result.trace_name, "candidates": [asdict(c) for c in result.candidates],
            "best": None if result.best is None else asdict(result.best)}
    (out / "plan.json").write_text(json.dumps(data, indent=1) + "\n")
    report = out / "plan.md"
    report.write_text(render_plan(result, meta))
    _plots(out, result)
    return report


def _plots(out: Path, result: PlanResult) -> None:
    from sessionserve.workload.plots import _plt

    plt = _plt()
    series: dict[str, list[Candidate]] = {}
    for c in result.candidates:
        series.setdefault(f"{c.policy}, host {c.host_gib:g} GiB", []).append(c)
    q = result.question
    title = f"{q.users:,} agents, {result.trace_name}, {result.profile.label}"
    for name, ylabel, key in (("plan_goodput.png", "sessions/hour meeting the SLO (all replicas)", "goodput"),
                              ("plan_cost.png", "replica-hours per 1k sessions", "cost")):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for label, cs in series.items():
            cs = sorted(cs, key=lambda c: c.replicas)
            xs = [c.replicas for c in cs]
            if key == "goodput":
                ys = [c.sessions_per_hour if c.meets_slo else 0.0 for c in cs]
                line, = ax.plot(xs, [c.sessions_per_hour for c in cs], marker="o", linestyle=":", alpha=0.5)
                ax.plot(xs, ys, marker="x", color=line.get_color(), label=label)
            else:
                ys = [c.cost_per_1k_sessions or float("nan") for c in cs]
                ax.plot(xs, ys, marker="o", label=label)
                ax.plot([c.replicas for c in cs if c.meets_slo], [c.cost_per_1k_sessions for c in cs if c.meets_slo],
                        linestyle="none", marker="*", markersize=12, color=ax.lines[-1].get_color())
        ax.set(xlabel="replicas", ylabel=ylabel, title=("goodput (x: meets SLO; dotted: throughput)" if
                                                        key == "goodput" else "cost (stars: meet SLO)"))
        ax.legend(fontsize=7)
        fig.suptitle(title, fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
