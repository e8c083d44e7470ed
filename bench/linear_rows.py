"""A decode step's linears by number of rows: oneDNN's pre-packed GEMMs as they are vs padded to 4 rows.

    .venv/bin/python bench/linear_rows.py [--threads 1] [--repeats 7]

Every linear of the embedded `small` model (12 layers: qkv, o, gate/up, down;
the LM head), random weights, packed once as the engine packs them
(`PackedLinear`); one call of each per step, the step timed for M rows. With
so few rows a step reads ~460 MB of float32 weights (half in bfloat16), so
time is weight traffic: a kernel that reads the weight slower shows here.
"as is" calls oneDNN with M rows; "padded" is what the engine does
(`packed_linear.MIN_GEMM_ROWS`: fewer rows run as 4, zeros below). Median of
`--repeats` steps after one warm-up; results of both paths are checked equal
to rounding.
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
from sessionserve.model.make_model import model_config
from sessionserve.model.packed_linear import MIN_GEMM_ROWS, PackedLinear, packing_supported


def model_linears(dtype: torch.dtype) -> list[PackedLinear]:
    cfg = model_config("llama", "small", eos_token_id=0, pad_token_id=0)
    h, inter, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"]
    head = h // cfg["num_attention_heads"]
    shapes = [(h, h + 2 * kv * head), (h, h), (h, 2 * inter), (inter, h)] * cfg["num_hidden_layers"]
    shapes.append((h, cfg["vocab_size"]))
    g = torch.Generator().manual_seed(0)
    out = []
    for n_in, n_out in shapes:
        lin = nn.Linear(n_in, n_out, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n_out, n_in, generator=g) * n_in ** -0.5)
        out.append(PackedLinear(lin.to(dtype)))
    return out


def as_is(lin: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, lin.packed_weight, lin.bias, "none", [], "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rows", default="1,2,3,4,5,8,16")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"threads {args.threads}, median of {args.repeats}; padded = fewer than {MIN_GEMM_ROWS} rows run as "
          f"{MIN_GEMM_ROWS}\n")
    print("| dtype | weights MB | rows | as is ms | padded ms | as is / padded |")
    print("|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        if not packing_supported(torch.device("cpu"), dtype):
            print(f"| {dtype} | no oneDNN packing here |  |  |  |  |")
            continue
        linears = model_linears(dtype)
        mb = sum(lin.in_features * lin.out_features for lin in linears) * torch.finfo(dtype).bits / 8 / 1e6
        g = torch.Generator().manual_seed(1)
        with torch.inference_mode():
            for m in rows:
                xs = [torch.randn(m, lin.in_features, generator=g).to(dtype) for lin in linears]
                for lin, x in zip(linears, xs):
                    torch.testing.assert_close(lin(x), as_is(lin, x), atol=1e-3, rtol=1e-2)
                t_as_is = timed_ms(lambda: [as_is(lin, x) for lin, x in zip(linears, xs)], args.repeats)
                t_padded = timed_ms(lambda: [lin(x) for lin, x in zip(linears, xs)], args.repeats)
                print(f"| {str(dtype).removeprefix('torch.')} | {mb:.0f} | {m} | {t_as_is:.1f} | {t_padded:.1f} | "
                      f"{t_as_is / t_padded:.2f}x |")


if __name__ == "__main__":
    main()
