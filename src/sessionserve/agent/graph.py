"""Dependencies between tool calls as a DAG, run in topological waves; and its critical path.

A wave is every call whose dependencies all finished in earlier waves; the
calls of one wave run concurrently. Node order inside a wave follows the
input order, so a plan runs the same way every time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def topological_waves(deps: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Group nodes into waves. `deps[n]` are the nodes n waits for.

    Raises ValueError on a dependency that is not a node, or on a cycle (the
    message names the nodes left on it).
    """
    pending = {n: set(d) for n, d in deps.items()}
    for n, d in pending.items():
        unknown = d - pending.keys()
        if unknown:
            raise ValueError(f"{n!r} depends on unknown {sorted(unknown)}")
        if n in d:
            raise ValueError(f"dependency cycle: {n!r} depends on itself")
    waves: list[list[str]] = []
    done: set[str] = set()
    while pending:
        wave = [n for n, d in pending.items() if d <= done]
        if not wave:
            raise ValueError(f"dependency cycle among {sorted(pending)}")
        waves.append(wave)
        done.update(wave)
        for n in wave:
            del pending[n]
    return waves


def critical_path_s(deps: Mapping[str, Iterable[str]], durations_s: Mapping[str, float]) -> float:
    """Length of the longest chain of durations through the DAG: the least wall time any schedule needs."""
    finish_s: dict[str, float] = {}
    for wave in topological_waves(deps):
        for n in wave:
            start_s = max((finish_s[d] for d in deps[n]), default=0.0)
            finish_s[n] = start_s + durations_s.get(n, 0.0)
    return max(finish_s.values(), default=0.0)
