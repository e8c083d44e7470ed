"""Topological waves and critical paths of tool-call DAGs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessionserve.agent.graph import critical_path_s, topological_waves


def test_waves_follow_dependencies_and_input_order() -> None:
    deps = {"a": [], "b": [], "c": ["a"], "d": ["a", "b"], "e": ["d"]}
    assert topological_waves(deps) == [["a", "b"], ["c", "d"], ["e"]]


def test_independent_nodes_form_one_wave() -> None:
    assert topological_waves({str(i): [] for i in range(16)}) == [[str(i) for i in range(16)]]


@pytest.mark.parametrize("deps", [{"a": ["b"], "b": ["a"]}, {"a": ["a"]}, {"a": [], "b": ["c"], "c": ["b"]}])
def test_cycles_are_rejected(deps: dict[str, list[str]]) -> None:
    with pytest.raises(ValueError, match="cycle"):
        topological_waves(deps)


def test_unknown_dependency_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown"):
        topological_waves({"a": ["zz"]})


def test_critical_path_is_the_longest_chain() -> None:
    deps = {"a": [], "b": [], "c": ["a"], "d": ["b", "c"]}
    assert critical_path_s(deps, {"a": 1.0, "b": 2.5, "c": 1.0, "d": 0.5}) == 3.0
    assert critical_path_s({"a": [], "b": []}, {"a": 0.2, "b": 0.3}) == 0.3
    assert critical_path_s({}, {}) == 0.0


@given(st.lists(st.lists(st.integers(0, 30), max_size=4), min_size=1, max_size=30))
def test_random_dags_every_node_after_its_dependencies(raw: list[list[int]]) -> None:
    # Node i may only depend on nodes < i: always acyclic.
    deps = {str(i): sorted({str(j) for j in ds if j < i}) for i, ds in enumerate(raw)}
    wave_of = {n: w for w, wave in enumerate(topological_waves(deps)) for n in wave}
    assert set(wave_of) == set(deps)
    assert all(wave_of[d] < wave_of[n] for n, ds in deps.items() for d in ds)
