"""Built-in profiles DERIVED from published accelerator specs with a roofline model (not measurements).

For planning beyond this machine. Each profile is one accelerator running one
model on one device (no tensor parallelism). The numbers come from the
vendors' datasheets (dense BF16 FLOP/s without sparsity, HBM bandwidth, host
link) times stated efficiencies; `fit` records every assumption, and `kind`
is "derived" so reports say so. Calibrate on the real hardware
(`sessionserve calibrate`) before trusting a plan to better than ~2x.
"""

from __future__ import annotations

from typing import NamedTuple

from sessionserve.sim.profile import GB, CostProfile, ModelShape, StepCost


class Accelerator(NamedTuple):
    name: str
    bf16_flops: float  # dense, no sparsity, FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: int
    host_link_bytes_per_s: float  # one direction
    source: str


ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (
    Accelerator("a100", 312e12, 2.039e12, 80 * 10**9, 32e9, "NVIDIA A100 80GB SXM datasheet; PCIe Gen4 x16"),
    Accelerator("h100", 989e12, 3.35e12, 80 * 10**9, 64e9, "NVIDIA H100 SXM5 datasheet; PCIe Gen5 x16"),
    Accelerator("h200", 989e12, 4.8e12, 141 * 10**9, 64e9, "NVIDIA H200 SXM datasheet; PCIe Gen5 x16"),
    Accelerator("gh200", 989e12, 4.0e12, 96 * 10**9, 450e9,
                "NVIDIA GH200 datasheet (96 GB HBM3); NVLink-C2C 900 GB/s total, 450 GB/s per direction"),
    Accelerator("l40s", 362e12, 864e9, 48 * 10**9, 32e9, "NVIDIA L40S datasheet; PCIe Gen4 x16"),
    Accelerator("mi300x", 1307e12, 5.3e12, 192 * 10**9, 64e9, "AMD Instinct MI300X datasheet; PCIe Gen5 x16"),
)}

# Llama 3.1 8B (config.json of meta-llama/Llama-3.1-8B): 32 layers, 32 query heads, 8 KV heads, head dim 128.
LLAMA3_8B = ModelShape(name="llama-3.1-8b (bf16)", num_params=8_030_000_000,
                       kv_bytes_per_token=2 * 32 * 8 * 128 * 2, vocab_size=128_256, max_model_len=131_072,
                       weight_bytes=2 * 8_030_000_000, kv_dtype_bytes=2, head_dim=128)
LLAMA3_8B_ATTN_FLOPS_PER_PAIR = 4 * 32 * 32 * 128  # QK^T and PV: 2 x 2 x head_dim per head per layer

# Stated efficiencies (typical of a tuned serving engine; assumptions, not measurements).
MATMUL_EFFICIENCY = 0.5  # share of peak dense FLOP/s reached by the linear layers
ATTN_EFFICIENCY = 0.4
HBM_EFFICIENCY = 0.8
LINK_EFFICIENCY = 0.75
NVME_BYTES_PER_S = 6e9  # one local PCIe Gen4 NVMe drive, sequential
STEP_OVERHEAD_S = 0.002  # scheduling + launch per step with CUDA graphs
PER_SEQ_S = 10e-6


def derive(acc: Accelerator, model: ModelShape = LLAMA3_8B,
           attn_flops_per_pair: int = LLAMA3_8B_ATTN_FLOPS_PER_PAIR) -> CostProfile:
    """The roofline profile of `model` on `acc` (one device)."""
    flops = acc.bf16_flops
    step = StepCost(
        overhead_s=STEP_OVERHEAD_S, per_seq_s=PER_SEQ_S,
        per_token_s=2 * model.num_params / (MATMUL_EFFICIENCY * flops),
        per_attn_s=attn_flops_per_pair / (ATTN_EFFICIENCY * flops),
        floor_s=model.weight_bytes / (HBM_EFFICIENCY * acc.hbm_bytes_per_s),
        per_kv_token_s=model.kv_bytes_per_token / (HBM_EFFICIENCY * acc.hbm_bytes_per_s))
    return CostProfile(
        name=f"{acc.name}-llama3-8b", kind="derived",
        hardware={"accelerator": acc.name, "bf16_flops": acc.bf16_flops, "hbm_bytes_per_s": acc.hbm_bytes_per_s,
                  "memory_bytes": acc.memory_bytes, "host_link_bytes_per_s": acc.host_link_bytes_per_s,
                  "source": acc.source},
        model=model, step=step,
        host_copy_bytes_per_s=LINK_EFFICIENCY * acc.host_link_bytes_per_s, disk_copy_bytes_per_s=NVME_BYTES_PER_S,
        device_memory_bytes=acc.memory_bytes,
        fit={"method": "roofline from published specs", "matmul_efficiency": MATMUL_EFFICIENCY,
             "attn_efficiency": ATTN_EFFICIENCY, "hbm_efficiency": HBM_EFFICIENCY,
             "link_efficiency": LINK_EFFICIENCY, "nvme_bytes_per_s": NVME_BYTES_PER_S,
             "step_overhead_s": STEP_OVERHEAD_S, "per_seq_s": PER_SEQ_S},
        notes=f"DERIVED, not measured: {model.name} on one {acc.name} ({acc.source}). Roofline with the stated "
              f"efficiencies; KV budget = 90% of {acc.memory_bytes / GB:.0f} GB minus {model.weight_bytes / GB:.1f} "
              "GB of weights.")


def builtin_names() -> tuple[str, ...]:
    return tuple(f"{name}-llama3-8b" for name in ACCELERATORS)


def builtin_profile(name: str) -> CostProfile:
    acc = name.removesuffix("-llama3-8b")
    if acc not in ACCELERATORS or not name.endswith("-llama3-8b"):
        raise ValueError(f"no built-in profile {name!r}; choose from {', '.join(builtin_names())}")
    return derive(ACCELERATORS[acc])
