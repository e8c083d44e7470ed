"""Shared fixtures: tiny models of each architecture, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from sessionserve.modelgen import make_model as mm


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def tiny_models(model_cache: Path) -> dict[str, Path]:
    """arch -> folder of a tiny random-weight model (llama, qwen2, qwen3)."""
    return {arch: mm.ensure_model(arch, "tiny", model_cache) for arch in mm.ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]
