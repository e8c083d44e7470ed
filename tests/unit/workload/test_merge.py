"""Merging bench runs into one sweep: pooled loads, goodput over all of them, refusal of different experiments."""

from __future__ import annotations

import json

import pytest

from sessionserve.cli import main
from sessionserve.workload.merge import MergeError, merge_results
from sessionserve.workload.report import render_markdown, write_report
from sessionserve.workload.results import build_results
from sessionserve.workload.trace import AgentSession, Step, TraceSet
from tests.unit.workload.test_metrics import run

TRACE = TraceSet("t", (AgentSession("s", (Step(1, 1, (), "end"),)),), 128.0, 10.0, ("from a test",))
SETTINGS = {"mode": "closed", "kv_cache_bytes": 1 << 20}


def results(runs: dict, *, loads: str, slo: float | None = 10.0, settings: dict | None = None,
            command: str = "sessionserve bench", date: str = "2026-12-02 10:00:00") -> dict:
    meta = {"command": command, "date": date, "model": "m", "machine": "cpu", "backend": "in-process engine",
            "settings": {**(settings or SETTINGS), "loads": loads}}
    return json.loads(json.dumps(build_results(TRACE, runs, meta=meta, slo_jct_s=slo)))  # as read from disk


def light_and_heavy() -> tuple[dict, dict]:
    # Light loads: both policies meet the 10 s SLO. Heavy load: only predictive does, and completes more.
    light = results({"discard": [run([4.0] * 2, 100, 2), run([8.0] * 4, 200, 4)],
                     "predictive": [run([2.0] * 2, 0, 2), run([3.0] * 4, 0, 4)]}, loads="2,4", command="light",
                    date="2026-12-02 10:00:00")
    heavy = results({"discard": [run([20.0] * 16, 900, 16)], "predictive": [run([6.0] * 16, 0, 16)]},
                    loads="16", command="heavy", date="2026-12-02 11:00:00")
    return light, heavy


def test_merge_pools_loads_and_takes_goodput_over_all_of_them() -> None:
    light, heavy = light_and_heavy()
    assert light["policies"]["predictive"]["vs_baseline"]["sessions_per_hour_at_slo"] == pytest.approx(
        (3600 * 4 / 3) / (3600 * 4 / 8))
    merged = merge_results([heavy, light], command="sessionserve merge-reports a b")  # order of the runs: any
    pred, disc = merged["policies"]["predictive"], merged["policies"]["discard"]
    assert [p["load_level"] for p in pred["loads"]] == [2, 4, 16]
    assert [p["run"] for p in pred["loads"]] == [2, 2, 1]
    assert pred["sessions_per_hour_at_slo"] == pytest.approx(3600 * 16 / 6)  # from the heavy run
    assert disc["sessions_per_hour_at_slo"] == pytest.approx(3600 * 4 / 8)  # its heavy load misses the SLO
    assert pred["vs_baseline"]["sessions_per_hour_at_slo"] == pytest.approx((16 / 6) / (4 / 8))
    assert pred["reference_load"] == "16 agents" and merged["reference_load"] == "16 agents"
    assert pred["vs_baseline"]["jct_p99_s"] == pytest.approx(6 / 20)  # headline at the heaviest load
    assert merged["date"] == "2026-12-02 10:00:00 .. 2026-12-02 11:00:00"
    assert merged["settings"]["loads"] == "16 + 2,4" and merged["settings"]["kv_cache_bytes"] == 1 << 20
    assert [m["command"] for m in merged["merged_from"]] == ["heavy", "light"]
    assert merged["trace"]["provenance"] == ["from a test"]
    md = render_markdown(merged)
    assert "Merged from:" in md and "`heavy`" in md and "`light`" in md and "| predictive | 16 agents | 1 |" in md


def test_a_repeated_load_keeps_both_points() -> None:
    light, _ = light_and_heavy()
    merged = merge_results([light, light], command="m")
    assert [(p["load_level"], p["run"]) for p in merged["policies"]["discard"]["loads"]] == [
        (2, 1), (2, 2), (4, 1), (4, 2)]


def test_runs_of_different_experiments_are_refused() -> None:
    light, heavy = light_and_heavy()
    other = results({"discard": [run([20.0] * 16, 900, 16)]}, loads="16",
                    settings={**SETTINGS, "kv_cache_bytes": 2 << 20})
    with pytest.raises(MergeError, match="settings"):
        merge_results([light, other], command="m")
    other_slo = results({"discard": [run([20.0] * 16, 900, 16)]}, loads="16", slo=30.0)
    with pytest.raises(MergeError, match="SLO"):
        merge_results([light, other_slo], command="m")
    merged = merge_results([light, other_slo], command="m", slo_jct_s=30.0)  # one SLO for all, given
    assert merged["slo_rule"] == "given when merging"
    assert merged["policies"]["discard"]["sessions_per_hour_at_slo"] == pytest.approx(3600 * 16 / 20)
    with pytest.raises(MergeError, match="trace"):
        merge_results([light, {**heavy, "trace": {**heavy["trace"], "name": "u"}}], command="m")
    with pytest.raises(MergeError, match="not the results.json"):
        merge_results([light, {"version": 1}], command="m")
    with pytest.raises(MergeError, match="no runs"):
        merge_results([], command="m")


def test_merge_reports_command_writes_the_report_and_goodput_plot(tmp_path, capsys) -> None:
    light, heavy = light_and_heavy()
    for name, res in (("light", light), ("heavy", heavy)):
        write_report(tmp_path / name, res, None)
    main(["merge-reports", str(tmp_path / "light"), str(tmp_path / "heavy" / "results.json"),
          "--out", str(tmp_path / "merged")])
    out = capsys.readouterr().out
    assert "report:" in out and "predictive" in out
    assert sorted(p.name for p in (tmp_path / "merged").iterdir()) == ["goodput.png", "report.md", "results.json"]
    merged = json.loads((tmp_path / "merged" / "results.json").read_text())
    assert merged["policies"]["predictive"]["sessions_per_hour_at_slo"] == pytest.approx(3600 * 16 / 6)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SystemExit, match="cannot read"):
        main(["merge-reports", str(tmp_path / "light"), str(tmp_path / "bad.json"), "--out", str(tmp_path / "x")])
    other = results({"discard": [run([20.0] * 16, 900, 16)]}, loads="16", settings={**SETTINGS, "mode": "open"})
    write_report(tmp_path / "other", other, None)
    with pytest.raises(SystemExit, match="cannot merge: run 2 differs from run 1 in settings"):
        main(["merge-reports", str(tmp_path / "light"), str(tmp_path / "other"), "--out", str(tmp_path / "x")])


def test_what_a_run_measured_about_its_servers_stays_with_the_run() -> None:
    def with_servers(res: dict, commands: dict, recompute: dict) -> dict:
        res["settings"].update(server_commands=commands, server_startup_s={k: 3.0 for k in commands},
                               server_recompute_tokens=recompute, server_counters={})
        return res

    light, heavy = light_and_heavy()
    light = with_servers(light, {"discard": "serve --a", "predictive": "serve --b"}, {"predictive": 0.0})
    heavy = with_servers(heavy, {"predictive": "serve --b", "peer": "peer --c"}, {"predictive": 900.0})
    merged = merge_results([light, heavy], command="m")
    assert merged["settings"]["server_commands"] == {"discard": "serve --a", "predictive": "serve --b",
                                                     "peer": "peer --c"}
    assert [m["server_recompute_tokens"] for m in merged["merged_from"]] == [{"predictive": 0.0},
                                                                            {"predictive": 900.0}]
    assert "server_recompute_tokens" not in merged["settings"]
    other = with_servers(light_and_heavy()[1], {"predictive": "serve --b --other"}, {})
    with pytest.raises(MergeError, match="server 'predictive' differently"):
        merge_results([light, other], command="m")
