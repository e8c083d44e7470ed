"""Linear layers with weights pre-packed for oneDNN, for inference on CPU.

`F.linear` on CPU calls MKL's sgemm, which re-lays out the weight on every
call and, on many x86 parts (AMD in particular), runs far from peak for the
small M of a decode batch. oneDNN can reorder a weight once into the blocked
layout its kernels read, then reuse it for every call: on a 2-core AVX-512
part this measured 2x `F.linear` at M=32 and 1.2x at M=2048 in float32, and
1.5x at M=32 in bfloat16 (bench/RESULTS.md). Same arithmetic (fp32
accumulation), so results match `F.linear` to rounding.

`pack_linears(model)` swaps every `nn.Linear` of a loaded model for a
`PackedLinear` and drops the unpacked copy of its weight (a shared weight,
e.g. an LM head tied to the embeddings, keeps its other users), and every
`SiluGateUp` for a `PackedSiluGateUp`: the gate GEMM with oneDNN's SiLU
post-op, the up GEMM with a multiply by it, so the (T, 2I) product and the
pass of silu_and_mul over it disappear (M = 2048, 768 -> 2 x 3072, 2
threads: 93-95 ms vs 105-108 in float32).

A GEMM of fewer than `MIN_GEMM_ROWS` rows (a decode step of one to three
sequences) gets zero rows appended up to that many where that reads the
weight faster: on AVX-512 parts oneDNN's kernels for 1-3 rows read it slower
than its 4-row one, and with so few rows reading the weight is the whole
cost (bench/linear_rows.py, the small model's linears on one AVX-512 EPYC
core, float32, M = 1/2/3/4: 31-34/38-39/27/24 ms as is, 24-26 ms padded;
bfloat16 17/20/15-16/14 ms as is, 15-19 ms padded). On an AVX2 EPYC the
1-2 row kernels are the faster ones (float32, 2 threads: 19.6-20.5 ms as
is, 23.7-24.1 padded; 1 thread: 28.9-30.3 vs 40.6-40.8), so there the
minimum is one row.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from sessionserve.model.layers import SiluGateUp

logger = logging.getLogger(__name__)

_PACKABLE = (torch.float32, torch.bfloat16)
MIN_GEMM_ROWS = 4 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 1


def _at_least_min_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` (rows, in), with zero rows appended up to MIN_GEMM_ROWS; the caller keeps the first rows of the result."""
    if x.dim() != 2 or x.shape[0] >= MIN_GEMM_ROWS:
        return x
    return F.pad(x, (0, 0, 0, MIN_GEMM_ROWS - x.shape[0]))


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch build can pre-pack weights of `dtype` on `device` (CPU with oneDNN only)."""
    if device.type != "cpu" or dtype not in _PACKABLE or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return (hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and "binary" in torch.ops.mkldnn._linear_pointwise.overloads())


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout. Inference only (no autograd)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            weight = linear.weight.detach().contiguous()
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(_at_least_min_rows(x), self.packed_weight, self.bias, "none", [], "")
        return y[:x.shape[0]]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedSiluGateUp(nn.Module):
    """`SiluGateUp` as two pre-packed GEMMs: g = silu(x Wg^T) (post-op), then (x Wu^T) * g (binary post-op)."""

    def __init__(self, module: SiluGateUp) -> None:
        super().__init__()
        with torch.no_grad():
            gate, up = module.weight.detach().chunk(2, dim=0)
            self.packed_gate = torch.ops.mkldnn._reorder_linear_weight(gate.contiguous(), None)
            self.packed_up = torch.ops.mkldnn._reorder_linear_weight(up.contiguous(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _at_least_min_rows(x)
        gate = torch.ops.mkldnn._linear_pointwise(rows, self.packed_gate, None, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(rows, gate, self.packed_up, None, "mul")[:x.shape[0]]


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` in `model` by a `PackedLinear` and every `SiluGateUp` by a
    `PackedSiluGateUp`, in place; return how many modules were packed."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child))
                count += 1
            elif type(child) is SiluGateUp:
                setattr(parent, name, PackedSiluGateUp(child))
                count += 1
    return count
