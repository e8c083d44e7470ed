"""A decode step's linears by number of rows: oneDNN's pre-packed GEMMs as they are vs padded to 4 rows.

    .venv/bin/python bench/linear_rows.py [--threads 1] [--repeats 7]

The embedded `small` model loaded and packed as the engine does it
(`DecoderModel`, `load_weights`, `pack_linears`): every layer's fused q|k|v,
o, gate|up (`PackedSiluGateUp`) and down, then the LM head, one call of each
per step, the step timed for M rows. With so few rows a step reads ~460 MB
of float32 weights (half in bfloat16), so time is weight traffic: a kernel
that reads the weight slower shows here. "padded" runs fewer rows as 4
(zeros below), what the engine does on AVX-512 parts (`packed_linear.MIN_GEMM_ROWS`;
one row elsewhere); "as is" is the same modules with that minimum set to 1. Median of `--repeats` steps
after one warm-up; both paths' results are checked equal to rounding.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from bench.timing import timed_ms
from sessionserve.model import packed_linear
from sessionserve.model.decoder import DecoderModel
from sessionserve.model.hf_config import load_arch
from sessionserve.model.loader import load_weights
from sessionserve.model.layers import SiluGateUp
from sessionserve.modelgen.make_model import ensure_model
from sessionserve.model.packed_linear import pack_linears, packing_supported


PADDED_ROWS = 4  # what packed_linear.MIN_GEMM_ROWS is on AVX-512 parts


def model_linears(model_dir: Path, dtype: torch.dtype) -> tuple[list[tuple[nn.Module, int]], int]:
    """The packed linears of the model at `model_dir` in `dtype`, in call order, each with its input width;
    and the bytes of their weights."""
    model = DecoderModel(load_arch(model_dir), 64)
    load_weights(model, model_dir)
    model = model.to(dtype).eval()
    weights = {name: m.weight for name, m in model.named_modules() if type(m) in (nn.Linear, SiluGateUp)}
    pack_linears(model)
    linears = [(model.get_submodule(name), w.shape[1]) for name, w in weights.items()]
    return linears, sum(w.numel() * w.element_size() for w in weights.values())


def step(linears: list[tuple[nn.Module, int]], xs: list[torch.Tensor], min_rows: int) -> list[torch.Tensor]:
    """One call of every linear, with GEMMs of fewer than `min_rows` rows padded to that many."""
    saved, packed_linear.MIN_GEMM_ROWS = packed_linear.MIN_GEMM_ROWS, min_rows
    try:
        return [lin(x) for (lin, _), x in zip(linears, xs)]
    finally:
        packed_linear.MIN_GEMM_ROWS = saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rows", default="1,2,3,4,5,8,16")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    padded_rows = PADDED_ROWS
    print(f"threads {args.threads}, median of {args.repeats}; padded = fewer than {padded_rows} rows run as "
          f"{padded_rows}\n")
    print("| dtype | weights MB | rows | as is ms | padded ms | as is / padded |")
    print("|---|---|---|---|---|---|")
    model_dir = ensure_model("llama", "small")
    for dtype in (torch.float32, torch.bfloat16):
        if not packing_supported(torch.device("cpu"), dtype):
            print(f"| {dtype} | no oneDNN packing here |  |  |  |  |")
            continue
        linears, nbytes = model_linears(model_dir, dtype)
        g = torch.Generator().manual_seed(1)
        with torch.inference_mode():
            for m in rows:
                xs = [torch.randn(m, width, generator=g).to(dtype) for _, width in linears]
                for got, want in zip(step(linears, xs, padded_rows), step(linears, xs, 1)):
                    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-2)
                t_as_is = timed_ms(lambda: step(linears, xs, 1), args.repeats)
                t_padded = timed_ms(lambda: step(linears, xs, padded_rows), args.repeats)
                print(f"| {str(dtype).removeprefix('torch.')} | {nbytes / 1e6:.0f} | {m} | {t_as_is:.1f} | "
                      f"{t_padded:.1f} | {t_as_is / t_padded:.2f}x |")

if __name__ == "__main__":
    main()
