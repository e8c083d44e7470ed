"""The fused RMSNorm/RoPE/SiLU ops and pre-packed linears against the eager expressions they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sessionserve.model import fused_ops, paged_kernel
from sessionserve.model.layers import RotaryEmbedding
from sessionserve.model.layers import SiluGateUp
from sessionserve.model.packed_linear import PackedLinear, PackedSiluGateUp, pack_linears, packing_supported

pytestmark = pytest.mark.skipif(not paged_kernel.available(), reason="C++ extension unavailable")

DTYPES = [(torch.float32, 1e-6), (torch.bfloat16, 0.0)]


def _eager_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_with_residual_add_matches_eager(dtype: torch.dtype, tol: float, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 96, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, 96, generator=g).to(dtype)
    w = torch.rand(96, generator=g).to(dtype) + 0.5
    expected_x = x + delta
    expected = _eager_rms(expected_x, w, 1e-6)
    got = fused_ops.rms_norm(x, w, 1e-6, delta)
    torch.testing.assert_close(x, expected_x, atol=0, rtol=0)  # residual updated in place, same rounding
    # bf16: one rounding step may differ where fp32 summation order differs; at most one bf16 ulp.
    atol = tol if dtype == torch.float32 else 0.0
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, n", [(1, 64), (5, 200), (300, 3072)])  # 200: a tail past the 16-lane vectors
def test_silu_and_mul_matches_eager(dtype: torch.dtype, rows: int, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    gate_up = (torch.randn(rows, 2 * n, generator=g) * 4).to(dtype)
    special = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-3, -200.0])  # signs, saturation, the exp clamp
    gate_up[0, :6] = special  # in the vector loop
    gate_up[-1, n - 6:n] = special  # in the scalar tail where there is one (n = 200)
    gate_up[-1, n - 8] = float("inf")
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate).mul(up)
    got = torch.ops.sessionserve_kernels.silu_and_mul(gate_up)
    torch.testing.assert_close(fused_ops.silu_and_mul(gate_up), got if dtype == torch.float32 else expected,
                               rtol=0, atol=0)  # the wrapper: the kernel in fp32, eager in bf16
    # fp32: the polynomial exp is within a few ulp; bf16: the rounded silu may land one ulp off at a tie.
    rtol, atol = (1e-6, 1e-6) if dtype == torch.float32 else (2 ** -7, 1e-30)
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)
    if dtype == torch.bfloat16:
        assert (got != expected).float().mean() < 0.01  # nearly all exactly eager's
    rows_apart = torch.zeros(rows, 3 * n, dtype=dtype)
    rows_apart[:, :2 * n] = gate_up
    got_apart = torch.ops.sessionserve_kernels.silu_and_mul(rows_apart[:, :2 * n])  # row stride 3n: the kernel
    torch.testing.assert_close(got_apart, got, rtol=0, atol=0)
    wide = torch.zeros(rows, 4 * n, dtype=dtype)
    wide[:, ::2] = gate_up
    strided = wide[:, ::2]  # same values, columns two apart: the eager path
    sg, su = strided.chunk(2, dim=-1)  # the wrapper's eager path
    torch.testing.assert_close(fused_ops.silu_and_mul(strided), F.silu(sg).mul_(su), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_on_strided_views_matches_eager(dtype: torch.dtype) -> None:
    rope = RotaryEmbedding(head_dim=64, max_positions=512, theta=10000.0, scaling=None)
    g = torch.Generator().manual_seed(2)
    T, H, Hkv, D = 9, 6, 2, 64
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    positions = torch.randint(0, 512, (T,), generator=g)
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
    v_before = qkv[:, (H + Hkv) * D:].clone()

    def eager(x: torch.Tensor) -> torch.Tensor:
        c = rope.cos[positions].unsqueeze(1).to(dtype)
        s = rope.sin[positions].unsqueeze(1).to(dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    eq, ek = eager(q.clone()), eager(k.clone())
    rope(positions, q, k)
    torch.testing.assert_close(q, eq, atol=1e-6, rtol=0)
    torch.testing.assert_close(k, ek, atol=1e-6, rtol=0)
    assert torch.equal(qkv[:, (H + Hkv) * D:], v_before)  # v untouched


@pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.float32), reason="no oneDNN")
@pytest.mark.parametrize("rows", [1, 2, 3, 32, 515])
def test_packed_linear_matches_f_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(96, 80, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(80, 96, generator=g))
        lin.bias.copy_(torch.randn(80, generator=g))
    x = torch.randn(rows, 96, generator=g)
    expected = F.linear(x, lin.weight, lin.bias)
    with torch.inference_mode():
        got = PackedLinear(lin)(x)
    assert got.shape == (rows, 80) and got.is_contiguous()  # a few rows run padded, and come back as many
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.float32), reason="no oneDNN")
@pytest.mark.parametrize("rows", [1, 2, 32, 515])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_silu_gate_up_matches_eager(rows: int, dtype: torch.dtype) -> None:
    if not packing_supported(torch.device("cpu"), dtype):
        pytest.skip(f"no oneDNN {dtype}")
    g = torch.Generator().manual_seed(rows)
    module = SiluGateUp(96, 40)
    with torch.no_grad():
        module.weight.copy_(torch.randn(80, 96, generator=g) * 0.2)
    x = torch.randn(rows, 96, generator=g)
    gate, up = F.linear(x, module.weight).chunk(2, dim=-1)
    expected = F.silu(gate) * up
    with torch.inference_mode():
        torch.testing.assert_close(module(x), expected, atol=1e-5, rtol=1e-5)
        got = PackedSiluGateUp(module.to(dtype))(x.to(dtype))
    assert got.shape == (rows, 40) and got.dtype == dtype
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (0.1, 0.02)  # bf16: products of rounded GEMM outputs
    torch.testing.assert_close(got.float(), expected, atol=atol, rtol=rtol)


@pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.float32), reason="no oneDNN")
def test_pack_linears_replaces_every_linear_and_keeps_tied_embedding() -> None:
    model = nn.Module()
    model.embed = nn.Embedding(50, 16)
    model.inner = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16, bias=False))
    model.head = nn.Linear(16, 50, bias=False)
    model.head.weight = model.embed.weight
    model.mlp = SiluGateUp(16, 8)
    nn.init.normal_(model.mlp.weight)
    ids = torch.tensor([3, 7, 49])
    with torch.inference_mode():
        expected = model.head(model.inner(model.embed(ids)))
        expected_mlp = model.mlp(model.embed(ids))
        assert pack_linears(model) == 4
        assert not any(type(m) in (nn.Linear, SiluGateUp) for m in model.modules())
        torch.testing.assert_close(model.head(model.inner(model.embed(ids))), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.mlp(model.embed(ids)), expected_mlp, atol=1e-5, rtol=1e-5)
    assert model.embed.weight.shape == (50, 16)


def _dense_paged_reference(q, k_cache, v_cache, tables, seq_idx, pos, scale):
    T, H, D = q.shape
    Hkv, BS = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(T, H, D)
    for t in range(T):
        ctx = int(pos[t]) + 1
        blocks = tables[int(seq_idx[t])].long()
        k = k_cache[blocks].float().permute(1, 0, 2, 3).reshape(Hkv, -1, D)[:, :ctx]
        v = v_cache[blocks].float().permute(1, 0, 2, 3).reshape(Hkv, -1, D)[:, :ctx]
        qt = q[t].float().view(Hkv, H // Hkv, D)
        out[t] = (torch.softmax(qt @ k.transpose(1, 2) * scale, -1) @ v).reshape(H, D)
    return out


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim,group,block", [(64, 3, 16), (32, 1, 8), (128, 4, 32), (80, 2, 64), (64, 16, 16),
                                                    (64, 7, 16), (256, 2, 64)])  # 7: a group of 4 and one of 3
def test_paged_attention_matches_dense_softmax(dtype, atol, head_dim, group, block) -> None:
    """Scattered blocks, partial last blocks, GQA groups, block sizes other than the vector width."""
    g = torch.Generator().manual_seed(head_dim * group + block)
    Hkv, S, max_ctx = 2, 5, 150
    mb = -(-max_ctx // block)
    k_cache = (torch.randn(S * mb + 3, Hkv, block, head_dim, generator=g) * 2).to(dtype)
    v_cache = torch.randn(S * mb + 3, Hkv, block, head_dim, generator=g).to(dtype)
    tables = torch.randperm(S * mb + 3, generator=g)[:S * mb].view(S, mb).to(torch.int32)
    # decode-like queries at assorted lengths plus several queries of one sequence (a prefill chunk)
    seq_idx = torch.tensor([0, 1, 2, 3, 4, 4, 4], dtype=torch.int32)
    pos = torch.tensor([0, block - 1, block, 149, 77, 78, 79], dtype=torch.int32)
    q = (torch.randn(len(pos), Hkv * group, head_dim, generator=g) * 3).to(dtype)
    scale = head_dim ** -0.5
    got = paged_kernel.paged_attention(q, k_cache, v_cache, tables, seq_idx, pos, scale)
    expected = _dense_paged_reference(q, k_cache, v_cache, tables, seq_idx, pos, scale)
    torch.testing.assert_close(got.float(), expected, atol=atol, rtol=0)


def test_paged_attention_shape_limits() -> None:
    assert paged_kernel.supports(12, 4, 64) and paged_kernel.supports(32, 8, 128)
    assert not paged_kernel.supports(12, 4, 40) and not paged_kernel.supports(64, 2, 64)
    q = torch.zeros(1, 2, 40)
    cache = torch.zeros(2, 1, 16, 40)
    with pytest.raises(RuntimeError, match="shape out of kernel limits"):
        paged_kernel.paged_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                     torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 1.0)
