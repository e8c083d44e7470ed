"""`sessionserve calibrate | simulate | plan` end to end, on small inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from sessionserve.cli import main
from sessionserve.sim.profile import load_profile
from sessionserve.workload.trace_io import write_jsonl
from tests.sim.test_sim_engine import agent_trace


def test_calibrate_writes_a_versioned_profile_with_the_hardware(tiny_llama_only: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    main(["calibrate", "--model", str(tiny_llama_only), "--grid", "quick", "--device-kv-bytes", str(4 << 20),
          "--threads", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["version"] == 1 and data["kind"] == "calibrated"
    assert data["hardware"]["num_cpus"] >= 1 and "cpu" in data["hardware"]
    assert data["step"]["per_token_s"] > 0 and data["host_copy_bytes_per_s"] > 0
    assert load_profile(out).model.vocab_size == 16_384
    assert "fit error median" in capsys.readouterr().out


def test_simulate_writes_the_bench_report_labelled_simulated(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_jsonl(agent_trace(8, 4), trace)
    out = tmp_path / "rep"
    main(["simulate", "--trace", str(trace), "--profile", "h100-llama3-8b", "--policies", "discard,predictive",
          "--loads", "2,8", "--num-sessions", "8", "--max-steps", "4", "--min-steps", "2", "--token-scale", "1",
          "--time-scale", "1", "--device-kv-bytes", str(1 << 30), "--max-context", "100000", "--out", str(out),
          "--quiet"])
    results = json.loads((out / "results.json").read_text())
    assert "SIMULATED" in results["backend"] and "derived" in results["backend"]
    assert set(results["policies"]) == {"discard", "predictive"}
    assert results["policies"]["predictive"]["loads"][-1]["num_completed"] == 8
    assert "| predictive |" in (out / "report.md").read_text()


def test_plan_answers_with_a_table_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    write_jsonl(agent_trace(16, 5, wait_s=2.0), trace)
    out = tmp_path / "plan"
    main(["plan", "--trace", str(trace), "--users", "400", "--slo-p99", "1.0", "--profile", "h100-llama3-8b",
          "--policies", "discard,predictive", "--host-gib", "64", "--max-steps", "5", "--num-sessions", "16",
          "--max-sim-users", "40", "--out", str(out)])
    data = json.loads((out / "plan.json").read_text())
    cands = data["candidates"]
    assert {c["policy"] for c in cands} == {"discard", "predictive"}
    assert all(c["users_per_replica"] * c["replicas"] >= 400 for c in cands)
    best = data["best"]
    assert best is not None and best["meets_slo"] and best["step_p99_s"] <= 1.0
    assert best["replicas"] == min(c["replicas"] for c in cands if c["meets_slo"])
    # The ladder climbs: fewer replicas missed the SLO for the winning series.
    assert all(not c["meets_slo"] for c in cands if c["policy"] == best["policy"] and c["replicas"] < best["replicas"])
    text = capsys.readouterr().out
    assert "Answer:" in text and "DERIVED" in text
    assert (out / "plan_goodput.png").stat().st_size > 1000 and (out / "plan_cost.png").stat().st_size > 1000


def test_the_simulator_and_planner_do_not_load_torch() -> None:
    """Planning runs thousands of simulated replicas, often in worker processes: importing the engine's
    torch (~1 s each) is not part of it."""
    code = ("import sys, sessionserve.planning.planner, sessionserve.planning.driver, sessionserve.workload.loader; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    out = subprocess.run([sys.executable, "-c", "import sessionserve; print(sessionserve.SamplingParams.__name__)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "SamplingParams"


def test_plan_in_worker_processes_answers_as_one_process() -> None:
    from sessionserve.planning.planner import PlanQuestion, plan

    trace = agent_trace(8, 4, wait_s=2.0)
    q = PlanQuestion(users=100, slo_step_p99_s=1.0, policies=("discard", "predictive"), host_gib=(64.0,),
                     max_sim_users=40, min_sessions=8)
    profile = load_profile("h100-llama3-8b")
    one, two = plan(trace, profile, q, jobs=1), plan(trace, profile, q, jobs=2)
    assert len(one.candidates) >= 2
    assert [replace(c, sim_wall_s=0.0) for c in one.candidates] == [replace(c, sim_wall_s=0.0) for c in two.candidates]
