"""CPU paged-attention kernel (C++, built on first use) with a pure-torch fallback.

The same extension carries the fused element-wise ops of `fused_ops.py`.

Decode attention is memory-bound: every step reads each running sequence's
whole context. Gathering the context into a contiguous tensor first (what a
torch-only path must do) reads and writes it once more. This kernel streams
keys and values straight out of the block pool with an online softmax, and the
query heads that share a KV head (GQA) share each read. It is written on
16-float vectors (scores, exp and the weighted sum of values), so head sizes
must be a multiple of 16 (`supports`); other shapes use the gather path. Work
is split over (token, KV head) pairs on torch's OpenMP thread pool. On AVX2,
float32 and bfloat16 take a path in intrinsics whose per-head sums stay in
registers for the whole block (2-4x the generic vector code's speed on
llama-small's decode shapes: `bench/attention_kernels.py`, its decode tables);
bfloat16 on AVX512-BF16 has its own.

The C++ is in `model/kernels/*.cpp`. The extension is compiled with the system compiler into a cache folder keyed
by the source and the torch version; if that fails (no compiler, no ninja),
`available()` is False and attention uses the gather path.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

import torch

from sessionserve.model.kernels import kernel_source

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict[str, bool] = {}


# One extension from these files (model/kernels/): this module's attention, fused_ops.py's element-wise ops,
# tile_attention.py's bf16 prefill tiles.
KERNEL_FILES = ("paged_attention.cpp", "fused_ops.cpp", "tile_attention.cpp")


def _sources() -> list[str]:
    return [kernel_source(name) for name in KERNEL_FILES]


# Compiler flags, best first. OpenMP is what makes `at::parallel_for` in the
# kernels run on torch's thread pool; without it they run on one thread.
_FLAG_SETS = (
    (["-O3", "-march=native", "-fopenmp"], ["-fopenmp"]),
    (["-O3", "-march=native", "-fopenmp-simd"], []),
)


def _build_dir(flags: list[str]) -> Path:
    key = hashlib.sha256(("".join(_sources()) + " ".join(flags) + torch.__version__).encode()).hexdigest()[:16]
    path = Path.home() / ".cache" / "sessionserve" / "kernels" / key
    path.mkdir(parents=True, exist_ok=True)
    return path


def available() -> bool:
    """Build (once per process, cached on disk) and report whether the kernel loaded."""
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
        return _state["ok"]


def _load() -> bool:
    from torch.utils.cpp_extension import load_inline

    errors = []
    for cflags, ldflags in _FLAG_SETS:
        try:
            load_inline(
                name="sessionserve_kernels",
                cpp_sources=_sources(),
                extra_cflags=cflags,
                extra_ldflags=ldflags,
                build_directory=str(_build_dir(cflags + ldflags)),
                is_python_module=False,
                verbose=False,
            )
            ops = torch.ops.sessionserve_kernels
            if all(hasattr(ops, name) for name in ("paged_attention", "rms_norm", "rope_", "silu_and_mul",
                                                       "tile_attention_")):
                return True
        except Exception as exc:  # noqa: BLE001 - any build failure means: next flags, then the fallback
            errors.append(f"{' '.join(cflags)}: {exc}")
    logger.warning("paged attention kernel unavailable, using the gather path: %s", "; ".join(errors))
    return False


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel handles this attention shape (else: the gather path)."""
    return num_heads // num_kv_heads <= 16 and head_dim <= 256 and head_dim % 16 == 0


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_idx: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
    """(T, H, D) attention of each query over its sequence's keys [0, pos]. Reads the caches only."""
    return torch.ops.sessionserve_kernels.paged_attention(
        q.contiguous(), k_cache, v_cache, block_tables, seq_idx, pos, scale)
