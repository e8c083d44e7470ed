"""Speculative decoding: decode speed with and without drafting, side by side on one model pair.

For each batch size and workload, runs the same prompts (greedy, fixed output
length) through engines that differ only in how tokens are proposed:

- ``none``: the target model alone;
- ``draft``: the draft model proposes, the target verifies (same tokenizer);
- ``ngram``: prompt lookup in the sequence's own context, no second model;
- ``draft-fixed``, ``ngram-fixed``: the same with the adaptive draft length
  off (always `--num-speculative-tokens` proposals): the acceptance rate at
  every batch size, and what drafting costs where the adaptive policy would
  not draft.

Methods alternate within each repeat, so load on a shared machine hits all of
them alike. Reports generated tokens per second over the whole batch (prefill
included, as bench/throughput.py does), the acceptance rate (accepted /
proposed tokens), tokens per verification step, and the speedup over
``none`` from medians; checks that every method's output equals ``none``'s
token for token.

Workloads (prompts are Python standard-library sources, what the trained pair
saw in training, so agreement between the two models is realistic):

- ``code``: continue an excerpt of a source file;
- ``copy``: a tool result (a source excerpt) followed by the start of its
  re-emission, as when an agent rewrites a file it just read: a model that
  copies continues the excerpt, which prompt lookup can propose.

    .venv/bin/python bench/spec_decode.py                     # trained pair (sessionserve make-model --train --pair)
    .venv/bin/python bench/spec_decode.py --batches 1 --repeats 1 --output-len 32   # smoke run
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sessionserve import LLM, SamplingParams
from sessionserve.modelgen.tokenizer_train import default_cache_dir
from sessionserve.obs.machine import cpu_model_name

MODELS = default_cache_dir()


def source_excerpts(tokenizer: Any, count: int, length: int, offset: int = 7) -> list[list[int]]:
    """`count` excerpts of `length` tokens, each from a different stdlib file (deterministic choice)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    out: list[list[int]] = []
    for path in files[offset::max(1, len(files) // (count * 2))]:
        text = path.read_text(encoding="utf-8", errors="replace")
        start = text.find("\ndef ")
        if start < 0:
            continue
        ids = tokenizer.encode(text[start + 1:])
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == count:
            break
    if len(out) < count:
        raise SystemExit(f"found only {len(out)} stdlib files with {length} tokens after a def")
    return out


def make_prompts(tokenizer: Any, workload: str, batch: int, prompt_len: int) -> list[list[int]]:
    excerpts = source_excerpts(tokenizer, batch, prompt_len)
    if workload == "code":
        return excerpts
    marker = tokenizer.encode("\n# the same file, rewritten:\n")
    return [e + marker + e[:16] for e in excerpts]


def run(llm: LLM, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    core = llm.engine.core
    p0, a0, s0 = core.num_spec_proposed, core.num_spec_accepted, core.num_spec_steps
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    proposed, accepted, steps = core.num_spec_proposed - p0, core.num_spec_accepted - a0, core.num_spec_steps - s0
    return {"wall_s": wall, "tok_per_s": len(prompts) * output_len / wall,
            "proposed": proposed, "accepted": accepted,
            "acceptance": accepted / proposed if proposed else None,
            "tokens_per_verify_step": (accepted + steps) / steps if steps else None,
            "ids": [o.token_ids for o in outs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=str(MODELS / "trained-target"))
    p.add_argument("--draft", default=str(MODELS / "trained-draft"))
    p.add_argument("--methods", default="none,draft,ngram,draft-fixed,ngram-fixed")
    p.add_argument("--workloads", default="code,copy")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--draft-dtype", default=None, help="the draft model's dtype (default: the target's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "spec_decode.json"))
    a = p.parse_args()
    methods = a.methods.split(",")
    if methods[0] != "none":
        raise SystemExit("--methods must start with none (the baseline)")
    batches = [int(b) for b in a.batches.split(",")]
    common = dict(num_threads=a.threads, dtype="float32", max_num_seqs=max(batches), kv_cache_bytes=1 << 30,
                  max_num_batched_tokens=4096)
    spec = {"none": {}, "ngram": dict(speculative_method="ngram"),
            "draft": dict(speculative_method="draft", draft_model=a.draft, draft_dtype=a.draft_dtype)}
    spec.update({f"{m}-fixed": dict(spec[m], spec_adaptive=False) for m in ("ngram", "draft")})
    engines = {m: LLM(a.target, num_speculative_tokens=a.num_speculative_tokens, **common, **spec[m])
               for m in methods}
    tokenizer = engines["none"].engine.tokenizer
    started = _dt.datetime.now(_dt.timezone.utc)
    results: dict[str, Any] = {}
    for workload in a.workloads.split(","):
        for batch in batches:
            prompts = make_prompts(tokenizer, workload, batch, a.prompt_len)
            for llm in engines.values():  # warm-up: kernels, allocator, thread pools
                llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
            for _ in range(a.repeats):
                for m in methods:
                    runs[m].append(run(engines[m], prompts, a.output_len))
            base_ids = runs["none"][0]["ids"]
            key = f"{workload}/b{batch}"
            results[key] = {}
            base_med = statistics.median(r["tok_per_s"] for r in runs["none"])
            for m in methods:
                rates = [r["tok_per_s"] for r in runs[m]]
                same = all(r["ids"] == base_ids for r in runs[m])
                acc = [r["acceptance"] for r in runs[m] if r["acceptance"] is not None]
                tpv = [r["tokens_per_verify_step"] for r in runs[m] if r["tokens_per_verify_step"] is not None]
                results[key][m] = {
                    "tok_per_s_min": min(rates), "tok_per_s_median": statistics.median(rates),
                    "speedup_median": statistics.median(rates) / base_med,
                    "acceptance": statistics.median(acc) if acc else None,
                    "tokens_per_verify_step": statistics.median(tpv) if tpv else None,
                    "identical_to_target": same}
                print(f"{key:10s} {m:6s} {statistics.median(rates):8.1f} tok/s (min {min(rates):.1f}) "
                      f"x{results[key][m]['speedup_median']:.2f} acceptance "
                      f"{results[key][m]['acceptance'] if acc else '-'} identical={same}", flush=True)
    finished = _dt.datetime.now(_dt.timezone.utc)
    report = {"settings": vars(a), "machine": {"cpu": cpu_model_name(), "python": platform.python_version()},
              "started": started.isoformat(), "finished": finished.isoformat(), "results": results}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(markdown(results, methods))


def markdown(results: dict[str, Any], methods: list[str]) -> str:
    lines = ["| workload / batch | " + " | ".join(f"{m} tok/s (min / median)" for m in methods)
             + " | " + " | ".join(f"{m} speedup, acceptance, tokens/step" for m in methods[1:]) + " |",
             "|" + "---|" * (1 + 2 * len(methods) - 1)]
    for key, per in results.items():
        cells = [f"{per[m]['tok_per_s_min']:.1f} / {per[m]['tok_per_s_median']:.1f}" for m in methods]
        for m in methods[1:]:
            r = per[m]
            acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
            tps = f"{r['tokens_per_verify_step']:.2f}" if r["tokens_per_verify_step"] is not None else "-"
            same = "" if r["identical_to_target"] else " (OUTPUT DIFFERS)"
            cells.append(f"{r['speedup_median']:.2f}x, {acc}, {tps}{same}")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
