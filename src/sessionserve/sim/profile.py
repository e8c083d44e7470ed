"""Cost profiles: what one engine step and one KV copy cost on some hardware, for some model.

A profile is versioned JSON. `kind` says where its numbers come from:
"calibrated" (measured on a machine by `sessionserve calibrate`, with the fit
error) or "derived" (a roofline from an accelerator's published specs; for
planning beyond this machine, never a measurement).

Step time of a plan (see `cost_model.step_seconds`):

    step_s = overhead_s + per_seq_s * S
             + max(per_token_s * T + per_attn_s * A,        # compute
                   floor_s + per_kv_token_s * C)            # memory traffic

S = chunks in the step, T = tokens computed, A = attention pairs (each
computed token times the context it attends to), C = KV tokens read (each
chunk's context length). A calibrated CPU profile fits the compute terms and
leaves the memory terms at zero; a derived profile sets both from the specs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

PROFILE_VERSION = 1
GB = 1e9


@dataclass(frozen=True)
class StepCost:
    """Coefficients of the step-time model (seconds, per unit named in the suffix)."""

    overhead_s: float  # per step: scheduling, launch, sampling setup
    per_seq_s: float  # per chunk in the step (per-sequence work: metadata, sampling)
    per_token_s: float  # per computed token (weights x token: the matmuls)
    per_attn_s: float  # per (query token, context token) pair
    floor_s: float = 0.0  # memory: reading the weights once per step
    per_kv_token_s: float = 0.0  # memory: reading one token's KV (all layers)

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class ModelShape:
    """What the cost model and the KV accounting need to know about a model."""

    name: str
    num_params: int
    kv_bytes_per_token: int  # K and V, all layers, at the KV dtype
    vocab_size: int
    max_model_len: int
    weight_bytes: int = 0  # resident weights (device memory not available for KV)
    kv_dtype_bytes: int = 2  # bytes of one KV element (2: bf16/fp16, 4: fp32): sizes an int8 host tier
    head_dim: int = 128


@dataclass(frozen=True)
class CostProfile:
    """One hardware + model pair. `copy_*`: sustained bytes/s of one KV move, one way."""

    name: str
    kind: str  # "calibrated" | "derived"
    hardware: dict[str, Any]
    model: ModelShape
    step: StepCost
    host_copy_bytes_per_s: float
    disk_copy_bytes_per_s: float
    device_memory_bytes: int | None = None  # None: not known (CPU); the KV budget is given per run
    move_latency_s: float = 0.0  # fixed cost of one KV move (hand-off to the mover, bookkeeping), any size
    cost_per_hour: float | None = None  # price of one replica-hour, for the planner (stated source in notes)
    fit: dict[str, Any] = field(default_factory=dict)  # calibrated: samples, error; derived: assumptions
    notes: str = ""
    created: str = ""
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        if self.kind not in ("calibrated", "derived"):
            raise ValueError(f"kind must be calibrated|derived, got {self.kind!r}")
        if self.host_copy_bytes_per_s <= 0 or self.disk_copy_bytes_per_s <= 0:
            raise ValueError("copy bandwidths must be positive")

    @property
    def label(self) -> str:
        return f"{self.name} ({self.kind})"

    def default_device_kv_bytes(self, utilization: float = 0.9) -> int | None:
        """KV budget on the device: a share of its memory minus the weights; None when memory is unknown."""
        if self.device_memory_bytes is None:
            return None
        return max(0, int(utilization * self.device_memory_bytes) - self.model.weight_bytes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostProfile:
        version = data.get("version")
        if version != PROFILE_VERSION:
            raise ValueError(f"profile version {version!r} is not supported (expected {PROFILE_VERSION})")
        data = dict(data)
        data["model"] = ModelShape(**data["model"])
        data["step"] = StepCost(**data["step"])
        return cls(**data)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return p

    def with_(self, **changes: Any) -> CostProfile:
        return replace(self, **changes)


def load_profile(name_or_path: str | Path) -> CostProfile:
    """A built-in profile by name (`derived.builtin_names()`) or a JSON file written by `calibrate`."""
    from sessionserve.sim.derived import builtin_names, builtin_profile

    if str(name_or_path) in builtin_names():
        return builtin_profile(str(name_or_path))
    p = Path(name_or_path)
    if not p.is_file():
        raise ValueError(f"no profile {str(name_or_path)!r}: not a file, and not one of {', '.join(builtin_names())}")
    return CostProfile.from_dict(json.loads(p.read_text()))
