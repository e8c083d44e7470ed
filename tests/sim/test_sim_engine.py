"""The simulator drives the engine's own scheduler and policies; deterministic; fast; reports like the bench."""

from __future__ import annotations

import ast
import json
import time
from pathlib import Path

import pytest

import sessionserve.sim as sim_pkg
from sessionserve.config import Config
from sessionserve.core import residency
from sessionserve.core.engine import EngineCore
from sessionserve.core.scheduler import Scheduler
from sessionserve.core.session_manager import SessionManager
from sessionserve.planning import driver
from sessionserve.sim.derived import builtin_profile
from sessionserve.planning.driver import simulate
from sessionserve.sim.engine import SimEngine
from sessionserve.planning.runs import run_sim
from sessionserve.types.kv_mover import Tier
from sessionserve.workload.metrics import summarize
from sessionserve.workload.plots import PLOT_FILES
from sessionserve.workload.replay import LoadSpec
from sessionserve.workload.report import write_report
from sessionserve.workload.results import build_results
from sessionserve.workload.trace import AgentSession, Step, ToolCall, TraceSet

PROFILE = builtin_profile("h100-llama3-8b")
ENGINE = dict(kv_cache_bytes=2 << 30, host_kv_bytes=64 << 30, max_num_seqs=64, max_num_batched_tokens=4096)


def agent_trace(num_sessions: int = 12, num_steps: int = 6, wait_s: float = 5.0, output_tokens: int = 80
                ) -> TraceSet:
    def session(i: int) -> AgentSession:
        steps = [Step(2000 if k == 0 else 300 + 10 * i, output_tokens, (ToolCall("Bash" if k % 2 else "Read", wait_s * (1 + k % 3)),),
                      "tool", (0,) if k == 0 else (), 1024 if k == 0 else 0) for k in range(num_steps - 1)]
        steps.append(Step(200, 40, (), "end"))
        return AgentSession(f"s{i}", tuple(steps))

    return TraceSet("synthetic", tuple(session(i) for i in range(num_sessions)), provenance=("made in the test",))


def make_engine(policy: str, **kw: int) -> SimEngine:
    return SimEngine(Config.from_kwargs(residency_policy=policy, **{**ENGINE, **kw}), PROFILE)


def test_sim_engine_is_assembled_from_the_engines_own_objects() -> None:
    eng = make_engine("predictive")
    assert type(eng.core) is EngineCore and type(eng.core.scheduler) is Scheduler
    assert type(eng.sessions) is SessionManager and eng.core.sessions is eng.sessions
    assert type(eng.sessions.policy) is residency.POLICIES["predictive"]
    assert eng.core.scheduler.kv is eng.kv and eng.sessions.kv is eng.kv


def test_simulation_runs_the_real_schedule_and_decide_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"schedule": 0, "decide": 0}
    real_schedule, real_decide = Scheduler.schedule, residency.PredictivePolicy.decide

    def schedule(self: Scheduler, *args, **kwargs):
        calls["schedule"] += 1
        return real_schedule(self, *args, **kwargs)

    def decide(self: residency.PredictivePolicy, view: residency.ResidencyView):
        calls["decide"] += 1
        return real_decide(self, view)

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    monkeypatch.setattr(residency.PredictivePolicy, "decide", decide)
    result = simulate(make_engine("predictive"), agent_trace(3, 3).sessions, LoadSpec("closed", 3))
    assert len(result.steps) == 9
    assert calls["schedule"] > 9 and calls["decide"] > 9


def test_no_scheduler_or_policy_logic_is_copied_under_sim() -> None:
    import sessionserve.planning as planning_pkg

    forbidden = {"schedule", "decide", "_preempt", "begin_turn", "end_turn", "find_cached_prefix", "allocate"}
    for path in [*Path(sim_pkg.__file__).parent.glob("*.py"), *Path(planning_pkg.__file__).parent.glob("*.py")]:
        tree = ast.parse(path.read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        assert not defined & forbidden, (path.name, defined & forbidden)
        assert not any(name.endswith(("Scheduler", "Policy")) for name in defined), path.name


def test_deterministic_and_policies_differ_under_memory_pressure() -> None:
    trace = agent_trace()
    # 12 sessions of ~2.5k tokens: 1 GiB of device KV (8k tokens) holds three at a time.
    runs = [simulate(make_engine(p, kv_cache_bytes=1 << 30), trace.sessions, LoadSpec("closed", 12), seed=3)
            for p in ("discard", "predictive", "predictive")]
    a, b, c = (summarize(r) for r in runs)
    assert b == c and [s.end_s for s in runs[1].sessions] == [s.end_s for s in runs[2].sessions]
    assert a["num_completed"] == b["num_completed"] == 12
    assert a["recompute_tokens"] > 0 and b["recompute_tokens"] < a["recompute_tokens"]
    assert b["peak_host_kv_bytes"] > 0 and a["peak_host_kv_bytes"] == 0
    # A closed-loop session's JCT is its waits plus its steps: never less than its waits.
    assert all(s.jct_s >= s.total_wait_s for s in runs[1].sessions)


def test_host_prefix_cache_brings_evicted_prefixes_back_on_the_clock() -> None:
    trace = agent_trace()
    # `discard` drops each parked session's KV into the prefix cache, where the others' prefills evict it.
    runs = [simulate(make_engine("discard", kv_cache_bytes=1 << 30, **kw), trace.sessions, LoadSpec("closed", 12),
                     seed=3) for kw in ({}, {"host_prefix_cache_bytes": 8 << 30}, {"host_prefix_cache_bytes": 8 << 30})]
    plain, cached, again = (summarize(r) for r in runs)
    assert cached == again  # deterministic
    assert cached["num_completed"] == plain["num_completed"] == 12
    assert cached["recompute_tokens"] < plain["recompute_tokens"] / 2, (cached["recompute_tokens"],
                                                                         plain["recompute_tokens"])


def test_simulated_hours_in_seconds() -> None:
    trace = agent_trace(num_sessions=20, num_steps=12, wait_s=180.0, output_tokens=20)  # ~1 h of waits each
    t0 = time.perf_counter()
    result = simulate(make_engine("predictive"), trace.sessions, LoadSpec("closed", 20))
    wall = time.perf_counter() - t0
    assert result.makespan_s > 3600 and len(result.steps) == 240
    assert wall < 10, wall  # NOTE: ~2 s on a 2-core machine; the bound leaves room for a loaded one


def test_a_session_too_big_for_the_device_stops_at_the_cache_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(driver, "STALL_S", 20.0)
    # 304 tokens of KV fit (19 blocks of 16); the step would grow to 350 while decoding. The engine
    # stops it where the cache ends ("length"), as the real engine does, instead of spinning.
    eng = make_engine("discard", kv_cache_bytes=19 * 16 * PROFILE.model.kv_bytes_per_token)
    trace = (AgentSession("big", (Step(250, 100, (), "end"),)),)
    result = simulate(eng, trace, LoadSpec("closed", 1))
    assert result.sessions[0].end_s is not None and result.sessions[0].error is None
    assert len(result.steps[0].result.output_token_ids) == 19 * 16 - 250


def test_replayed_agents_outlast_the_idle_ttl_and_an_expired_session_fails_cleanly() -> None:
    # Waits of 15-45 min, past the engine's default idle TTL (10 min): the replay's engine keeps the sessions.
    trace = agent_trace(num_sessions=3, num_steps=4, wait_s=900.0, output_tokens=8)
    runs = run_sim(trace, ["predictive"], [LoadSpec("closed", 3)], PROFILE, ENGINE)
    assert [s.error for s in runs["predictive"][0].sessions] == [None] * 3
    # A TTL asked for explicitly is kept: the sessions expire during their first wait and fail, nothing else.
    runs = run_sim(trace, ["predictive"], [LoadSpec("closed", 3)], PROFILE, {**ENGINE, "session_idle_ttl_s": 60.0})
    result = runs["predictive"][0]
    assert all("expired while idle" in (s.error or "") for s in result.sessions)
    assert result.extra["leaked_blocks"] == 0


def test_run_sim_writes_the_bench_report(tmp_path: Path) -> None:
    trace = agent_trace(6, 3)
    runs = run_sim(trace, ["discard", "keep"], [LoadSpec("closed", 2), LoadSpec("closed", 6)], PROFILE, ENGINE)
    assert all(r.extra["leaked_blocks"] == 0 for rs in runs.values() for r in rs)
    results = build_results(trace, runs, meta={"command": "test", "backend": "SIMULATED", "settings": {"mode": "closed"}})
    write_report(tmp_path, results, runs)
    data = json.loads((tmp_path / "results.json").read_text())
    assert set(data["policies"]) == {"discard", "keep"} and data["policies"]["keep"]["jct_p50_s"] > 5.0
    for name in PLOT_FILES:
        assert (tmp_path / name).stat().st_size > 1000


@pytest.mark.parametrize("policy", ["predictive", "ttl", "least-waste"])
def test_a_tick_skips_the_policy_only_when_it_would_do_nothing(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ticks with the same inputs before the policy's next decision time skip `decide`: at every such
    tick of a whole replay (memory pressure, host moves, prefetches), `decide` would have returned
    no action."""
    real_tick = SessionManager.tick
    counts = {"ticks": 0, "skipped": 0}

    def checked_tick(self: SessionManager, now_s: float, num_wanted_blocks: int) -> None:
        counts["ticks"] += 1
        decided: list[float] = []
        self.policy = _Spy(self.policy, decided)
        try:
            real_tick(self, now_s, num_wanted_blocks)
        finally:
            self.policy = self.policy.inner
        if not decided:
            counts["skipped"] += 1
            assert self.policy.decide(self.view(now_s, num_wanted_blocks)) == ()

    monkeypatch.setattr(SessionManager, "tick", checked_tick)
    trace = agent_trace(num_sessions=12, num_steps=6, wait_s=3.0)
    # A device pool that holds ~3 sessions: pressure, offloads and prefetches all happen.
    result = simulate(make_engine(policy, kv_cache_bytes=1 << 30), trace.sessions, LoadSpec("closed", 8))
    assert summarize(result)["num_completed"] == 12
    assert counts["skipped"] > 0 and counts["skipped"] < counts["ticks"]


class _Spy:
    """A policy that records each `decide` call and forwards everything to the real one."""

    def __init__(self, inner: object, calls: list) -> None:
        self.inner, self.calls = inner, calls

    def decide(self, view: residency.ResidencyView) -> tuple[residency.ResidencyAction, ...]:
        self.calls.append(view.now_s)
        return self.inner.decide(view)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_subagents_run_on_the_virtual_clock_as_in_the_replay() -> None:
    from sessionserve.workload.trace import SubAgent

    def child(name: str, wait_s: float) -> AgentSession:
        return AgentSession(name, (Step(3000, 40, (ToolCall("Grep", wait_s),), "tool", (99,), 2048),
                                   Step(200, 20, (), "end")))

    parent = AgentSession("p", (Step(1500, 60, (ToolCall("Task", 2.0),), "tool"), Step(300, 30, (), "end")),
                          subagents=(SubAgent(0, child("p.sub1", 10.0), 10.0), SubAgent(0, child("p.sub2", 30.0), 30.0),
                                     SubAgent(0, child("p.bg", 100.0), 100.0, blocking=False)))
    result = simulate(make_engine("predictive"), [parent], LoadSpec("closed", 1))
    assert [r.session_id for r in result.sessions] == ["p"]
    assert sorted(r.session_id for r in result.subagents) == ["p.bg", "p.sub1", "p.sub2"]
    assert all(r.end_s is not None for r in (*result.sessions, *result.subagents))
    start = {(r.session_id, r.step_index): r.start_s for r in result.steps}
    ends = {r.session_id: r.end_s for r in result.subagents}
    # The parent's second step: after the slower blocking sub-agent, plus its own 2 s; not after the background one.
    assert start[("p", 1)] >= ends["p.sub2"] + 2.0 - 1e-9
    assert start[("p", 1)] < ends["p.bg"]
    # Siblings started together: the template (2,048 tokens) is prefilled once.
    firsts = sorted(r.result.num_cached_tokens for r in result.steps if r.session_id != "p" and r.step_index == 0)
    assert firsts[0] == 0 and firsts[1:] == [2048, 2048]
    assert summarize(result)["num_subagents"] == 3


def test_parked_entries_follow_the_predictor_within_the_tolerance(monkeypatch: pytest.MonkeyPatch) -> None:
    """The residency view re-predicts a parked session only when the predictor's median or tail for it
    moved past PREDICTION_TOLERANCE: at every view of a replay, every entry is that close to what the
    predictor says now, and entries do get refreshed while sessions wait (the predictor learns)."""
    from sessionserve.core.parked_entries import PREDICTION_TOLERANCE

    real_view = SessionManager.view
    counts = {"entries": 0, "refreshed": 0}

    def checked_view(self: SessionManager, now_s: float, num_wanted_blocks: int) -> residency.ResidencyView:
        before = {e.session_id: e for e in self._entries.parked}
        view = real_view(self, now_s, num_wanted_blocks)
        for e in view.parked:
            s = self.sessions[e.session_id]
            now = self.predictor.predict(s.waiting_tools, s.wait_hint_s)
            for a, b in ((e.predicted.p50_s, now.p50_s), (e.predicted.p90_s, now.p90_s)):
                assert abs(a - b) <= PREDICTION_TOLERANCE * a * 1.0001
            old = before.get(e.session_id)
            counts["entries"] += 1
            if old is not None and old is not e and old._replace(predicted=e.predicted) == e:
                counts["refreshed"] += 1
        return view

    monkeypatch.setattr(SessionManager, "view", checked_view)
    result = simulate(make_engine("predictive"), agent_trace(num_sessions=12, num_steps=6).sessions,
                      LoadSpec("closed", 12))
    assert summarize(result)["num_completed"] == 12
    assert counts["refreshed"] > 0 and counts["entries"] > 100


@pytest.mark.parametrize("profile", ["h100-llama3-8b", "llama-small-2core"])
def test_int8_host_tier_holds_as_many_blocks_as_the_real_one(profile: str) -> None:
    """The simulator sizes an int8 host tier as the real host tier does, for the profile's KV dtype."""
    import torch

    from sessionserve.cache.host_tier import HostTier
    from sessionserve.cache.kv_layout import KVLayout
    from sessionserve.sim.profile import load_profile

    p = builtin_profile(profile) if profile.startswith("h100") else load_profile(
        str(Path(__file__).parents[2] / "bench" / "profiles" / f"{profile}.json"))
    m = p.model
    dtype = {2: torch.bfloat16, 4: torch.float32}[m.kv_dtype_bytes]
    num_kv_heads = m.kv_bytes_per_token // (2 * m.kv_dtype_bytes * m.head_dim)  # times the layers
    layout = KVLayout(1, num_kv_heads, 16, m.head_dim, dtype)  # one "layer" of all layers' heads: same bytes
    assert layout.block_bytes == m.kv_bytes_per_token * 16
    budget = 64 << 20
    real = HostTier(layout, budget, quantize_int8=True)
    eng = SimEngine(Config.from_kwargs(kv_cache_bytes=1 << 30, host_kv_bytes=budget, host_kv_int8=True), p)
    assert eng.mover.capacity[Tier.HOST] == real.num_blocks
    plain = SimEngine(Config.from_kwargs(kv_cache_bytes=1 << 30, host_kv_bytes=budget), p)
    ratio = eng.mover.capacity[Tier.HOST] / plain.mover.capacity[Tier.HOST]
    assert 1.9 < ratio < 2.0 if m.kv_dtype_bytes == 2 else 3.7 < ratio < 4.0  # not 4x for bf16
