"""Cost model, profiles (JSON round trip, versions), derived roofline profiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sessionserve.planning.calibrate import fit_step_cost
from sessionserve.sim.cost_model import shape_of, step_seconds
from sessionserve.sim.derived import builtin_names, builtin_profile
from sessionserve.sim.profile import CostProfile, StepCost, load_profile


def test_shape_counts_tokens_pairs_and_context() -> None:
    # A 4-token prefill from 0 and a decode at position 10.
    s = shape_of([(0, 4), (10, 1)])
    assert s.num_seqs == 2 and s.num_tokens == 5
    assert s.num_attn_pairs == (1 + 2 + 3 + 4) + 11
    assert s.num_kv_tokens == 4 + 11


def test_step_time_is_overhead_plus_max_of_compute_and_memory() -> None:
    cost = StepCost(overhead_s=1.0, per_seq_s=0.5, per_token_s=0.1, per_attn_s=0.0, floor_s=2.0, per_kv_token_s=0.01)
    small = shape_of([(100, 1)])  # decode: memory bound (2 + 1.01 > 0.1)
    assert step_seconds(small, cost) == pytest.approx(1.0 + 0.5 + 2.0 + 0.01 * 101)
    big = shape_of([(0, 100)])  # prefill: compute bound (10 > 2 + 1)
    assert step_seconds(big, cost) == pytest.approx(1.0 + 0.5 + 10.0)
    assert step_seconds(shape_of([]), cost) == 0.0


def test_fit_recovers_known_coefficients() -> None:
    truth = StepCost(overhead_s=2e-3, per_seq_s=5e-5, per_token_s=3e-5, per_attn_s=2e-8)
    shapes = [shape_of([(ctx, 1)] * b) for b in (1, 4, 16) for ctx in (10, 300, 900)]
    shapes += [shape_of([(0, n)]) for n in (16, 128, 512, 1024)]
    secs = [step_seconds(s, truth) for s in shapes]
    cost, fit = fit_step_cost(shapes, secs)
    assert fit["rel_error_p90"] < 1e-6
    assert cost.per_token_s == pytest.approx(truth.per_token_s, rel=1e-4)
    assert cost.overhead_s == pytest.approx(truth.overhead_s, rel=1e-4)


def test_profile_round_trips_through_json_and_checks_version(tmp_path: Path) -> None:
    p = builtin_profile("h100-llama3-8b")
    path = p.save(tmp_path / "p.json")
    assert load_profile(path) == p
    data = json.loads(path.read_text())
    data["version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="version"):
        load_profile(path)


def test_derived_profiles_are_labelled_and_follow_the_specs() -> None:
    assert set(builtin_names()) >= {"h100-llama3-8b", "a100-llama3-8b", "h200-llama3-8b"}
    a100, h100, h200 = (builtin_profile(f"{n}-llama3-8b") for n in ("a100", "h100", "h200"))
    for p in (a100, h100, h200):
        assert p.kind == "derived" and "DERIVED" in p.notes and p.fit["method"].startswith("roofline")
    decode = shape_of([(2000, 1)] * 32)
    # Decode is memory bound: H200's HBM (4.8 TB/s) beats H100's (3.35) beats A100's (2.0).
    assert step_seconds(decode, h200.step) < step_seconds(decode, h100.step) < step_seconds(decode, a100.step)
    # Weights read once per step: 16 GB at 80% of 3.35 TB/s is about 6 ms.
    assert h100.step.floor_s == pytest.approx(16.06e9 / (0.8 * 3.35e12), rel=1e-3)
    assert h200.default_device_kv_bytes() > h100.default_device_kv_bytes() > 0
    with pytest.raises(ValueError):
        builtin_profile("tpu-llama3-8b")


def test_profile_rejects_unknown_kind() -> None:
    p = builtin_profile("h100-llama3-8b")
    with pytest.raises(ValueError):
        CostProfile(**{**p.__dict__, "kind": "guessed"})
