"""bench/throughput.py's per-round ratios (the pure part of the harness)."""

from __future__ import annotations

from bench.throughput import ratios_markdown, round_ratios, summarize

CASES = [{"name": "prefill", "batch": 2, "input_len": 4, "output_len": 2}]


def _engine(tok_s: list[float]) -> dict:
    case = {"gen_tok_s": tok_s, "total_tok_s": tok_s, "wall_s": [1.0] * len(tok_s), "full_length": True,
            "num_cached_tokens": [0], "outputs_run0": [[1, 2], [3, 4]]}
    return {"cases": {"prefill": case}}


def test_round_ratios_take_each_rounds_medians_then_min_and_median() -> None:
    rounds = [{"ours": _engine([10.0, 12.0, 11.0]), "vllm": _engine([10.0, 10.0, 10.0])},
              {"ours": _engine([9.0]), "vllm": _engine([10.0])},
              {"ours": _engine([13.0]), "hf": _engine([5.0])}]  # vllm failed in round 3
    ratios = round_ratios([summarize(r, CASES) for r in rounds], CASES)
    assert ratios["prefill"]["vllm"] == {"rounds": [1.1, 0.9], "min": 0.9, "median": 1.0}
    assert ratios["prefill"]["hf"] == {"rounds": [2.6], "min": 2.6, "median": 2.6}
    assert list(ratios["prefill"]) == ["hf", "vllm"]
    table = ratios_markdown(ratios, CASES, 3)
    assert "| prefill | vllm | 1.10x | 0.90x |  | 0.90x | **1.00x** |" in table
