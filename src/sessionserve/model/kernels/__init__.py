"""The C++ sources of the CPU kernels, compiled together on first use by `model.paged_kernel`."""

from __future__ import annotations

from pathlib import Path


def kernel_source(name: str) -> str:
    """The text of `kernels/<name>`."""
    return (Path(__file__).parent / name).read_text(encoding="utf-8")
