"""`--model` values of `sessionserve serve`: one folder, or several NAME=PATH engines."""

from __future__ import annotations

import pytest

from sessionserve.cli import model_specs


def test_one_model_is_a_folder_or_the_embedded_default() -> None:
    assert model_specs(None) == [(None, None)]
    assert model_specs(["/models/qwen"]) == [(None, "/models/qwen")]
    assert model_specs(["big=/models/qwen"]) == [("big", "/models/qwen")]
    # A path with '=' in a folder name is still a path.
    assert model_specs(["/data/run=3/model"]) == [(None, "/data/run=3/model")]


def test_several_models_need_distinct_names() -> None:
    assert model_specs(["large=/a", "small=/b"]) == [("large", "/a"), ("small", "/b")]
    with pytest.raises(SystemExit, match="NAME=PATH"):
        model_specs(["/a", "small=/b"])
    with pytest.raises(SystemExit, match="differ"):
        model_specs(["m=/a", "m=/b"])
