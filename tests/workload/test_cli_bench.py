"""`sessionserve bench` / `demo` flags, and one short demo run end to end on the tiny model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from sessionserve import cli_bench
from sessionserve.modelgen import make_model as mm
from sessionserve.workload.loader import default_traces_dir


def test_demo_defaults_and_load_parsing() -> None:
    parser = argparse.ArgumentParser()
    cli_bench.add_demo_arguments(parser)
    args = parser.parse_args([])
    assert args.policies == "discard,predictive" and args.num_sessions == 8 and args.model_size == "small"
    # device KV short of one agent's context (llama-small fp32: 24 KiB a token), a host tier beside it
    assert args.device_kv_bytes // (24 << 10) < args.max_context and args.host_kv_bytes > 4 * args.device_kv_bytes
    loads = cli_bench._loads(parser.parse_args(["--loads", "8,2"]))
    assert [load.concurrency for load in loads] == [2, 8]
    open_loads = cli_bench._loads(parser.parse_args(["--mode", "open", "--loads", "trace,0.5"]))
    assert [load.rate_per_s for load in open_loads] == [None, 0.5]


@pytest.mark.skipif(not (default_traces_dir() / "weka_claude_code").is_dir(), reason="shared traces not present")
def test_short_demo_writes_a_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = mm.ensure_model("llama", "tiny", tmp_path / "models")
    out = tmp_path / "demo"
    cli_bench.main(["demo", "--model", str(model), "--num-sessions", "2", "--max-steps", "2", "--loads", "1,2",
                    "--max-context", "600", "--max-wait-s", "0.05", "--device-kv-bytes", str(4 << 20),
                    "--quiet", "--out", str(out)])
    printed = capsys.readouterr().out
    assert f"report: {out / 'report.md'}" in printed and "predictive vs discard:" in printed
    results = json.loads((out / "results.json").read_text())
    assert set(results["policies"]) == {"discard", "predictive"}
    assert results["trace"]["token_scale"] == 128 and results["command"].startswith("sessionserve")
    assert all(s["num_failed"] == 0 for s in results["policies"].values())
