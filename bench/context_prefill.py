"""An agent's next turn through the engine: new tokens prefilled over a cached context, two attention paths.

    .venv/bin/python bench/context_prefill.py [--dtype float32] [--new 512] [--contexts 0,512,1024,2048]

Every turn after an agent's first is a context prefill: the tool result (or
the user's message) is computed over the session's cached history. Per
context length: the context is prefilled once (cached), then the timed run
sends context + `--new` fresh tokens as one request (one step, one chunk)
and measures it to its first token. Each attention path on its own engine,
side by side: `gather` (the default: context chunks of
`attention.SPLIT_MIN_ROWS` rows or more take the split flash attention where
the runner uses it, else from `attention.gather_min_rows` rows a gather of
their context; the label is the historical one) and `paged` (every context
chunk streams the context once per row through the paged kernel). Median of
`--repeats` runs, distinct tokens each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sessionserve import LLMEngine, SamplingParams
from sessionserve.config import Config
from sessionserve.modelgen.make_model import ensure_model


def first_token_s(eng: LLMEngine, ids: list[int]) -> float:
    rid = eng.add_request(ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    while not any(o.request_id == rid and o.finished for o in eng.step()):
        pass
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-size", default="small", choices=("tiny", "small"))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new", type=int, default=512, help="new tokens per turn")
    p.add_argument("--contexts", default="0,512,1024,2048", help="cached context lengths")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    model = ensure_model("llama", a.model_size)
    contexts = [int(x) for x in a.contexts.split(",")]
    gen = torch.Generator().manual_seed(0)
    results: dict[str, dict[int, list[float]]] = {}
    for path in ("gather", "paged"):
        eng = LLMEngine(Config.from_kwargs(kv_cache_bytes=512 << 20, num_threads=a.threads, dtype=a.dtype,
                                           max_num_batched_tokens=max(512, a.new), max_num_seqs=8), model)
        if path == "paged":
            eng.runner.gather_min_rows = 1 << 30
            eng.runner.flash_attention = False  # else chunks of SPLIT_MIN_ROWS+ rows take the split calls
        first_token_s(eng, torch.randint(100, 16000, (a.new,), generator=gen).tolist())  # warm-up
        results[path] = {}
        for ctx in contexts:
            times = []
            for _ in range(a.repeats):
                ids = torch.randint(100, 16000, (ctx + a.new,), generator=gen).tolist()
                if ctx:
                    first_token_s(eng, ids[:ctx])
                times.append(first_token_s(eng, ids))
            results[path][ctx] = times
        eng.close()
    print(f"llama-{a.model_size}, {a.dtype}, {a.threads} threads, {a.new} new tokens per turn, "
          f"median (min) of {a.repeats}")
    print("| cached context | paged kernel ms | gather ms | paged / gather |\n|---|---|---|---|")
    for ctx in contexts:
        pm, gm = (statistics.median(results[k][ctx]) * 1e3 for k in ("paged", "gather"))
        pmin, gmin = (min(results[k][ctx]) * 1e3 for k in ("paged", "gather"))
        print(f"| {ctx} | {pm:.0f} ({pmin:.0f}) | {gm:.0f} ({gmin:.0f}) | {pm / gm:.2f}x |")


if __name__ == "__main__":
    main()
