"""The tiny Llama only (the shared `tiny_llama` fixture builds every architecture)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sessionserve.modelgen import make_model as mm


@pytest.fixture(scope="session")
def tiny_llama_only(model_cache: Path) -> Path:
    return mm.ensure_model("llama", "tiny", model_cache)
