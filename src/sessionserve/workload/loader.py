"""`load_trace`: a trace by name (from ../shared/traces) or any file/folder in a supported format.

Formats are recognised by content, not by file name:
- `agent_jsonl`: our own versioned JSONL (trace_io.py), already scaled as its header says;
- `weka`: WEKA `requests.csv`, or upstream kv-cache-tester `trace_*.json` files;
- `mooncake`: JSONL rows with `timestamp`, `input_length`, `output_length`, `hash_ids`;
- `azure`: CSV with `TIMESTAMP`, `ContextTokens`, `GeneratedTokens`;
- `tracelab`: JSONL rounds with `session_id`, `round_index`, `tools`.
A folder of several files of one format loads them all, in name order.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from sessionserve.workload.azure import azure_trace
from sessionserve.workload.mooncake import mooncake_trace
from sessionserve.workload.trace import AgentSession, TraceSet
from sessionserve.workload.trace_io import is_agent_jsonl, read_jsonl
from sessionserve.workload.tracelab import tracelab_trace
from sessionserve.workload.weka import weka_trace

TRACE_NAMES = ("weka_claude_code", "mooncake_conversation", "azure_llm_2023", "tracelab_example")


def default_traces_dir() -> Path:
    """../shared/traces beside the repository (src/sessionserve/workload -> repo root -> its parent)."""
    return Path(__file__).resolve().parents[3].parent / "shared" / "traces"


def detect_format(path: Path) -> str | None:
    """The format of one file, by its first line; None if unsupported."""
    if is_agent_jsonl(path):
        return "agent_jsonl"
    try:
        with path.open(newline="") as f:
            first = f.readline()
    except (OSError, UnicodeDecodeError):
        return None
    if path.suffix == ".csv":
        header = set(next(csv.reader([first]), []))
        if {"session_id", "in_tokens", "out_tokens"} <= header:
            return "weka"
        if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= header:
            return "azure"
        return None
    if path.suffix == ".json":
        return "weka" if first.lstrip().startswith("{") and _is_weka_json(path) else None
    try:
        row = json.loads(first)
    except ValueError:
        return None
    if not isinstance(row, dict):
        return None
    if {"timestamp", "input_length", "output_length", "hash_ids"} <= row.keys():
        return "mooncake"
    if {"session_id", "round_index", "input_tokens_total"} <= row.keys():
        return "tracelab"
    return None


def _is_weka_json(path: Path) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("requests"), list) and "block_size" in data


def resolve(name_or_path: str | Path, traces_dir: str | Path | None = None) -> tuple[str, list[Path]]:
    """(format, files or folder to load) for a trace name or a path. Raises ValueError if unsupported."""
    p = Path(name_or_path)
    if not p.exists() and str(name_or_path) in TRACE_NAMES:
        p = Path(traces_dir) if traces_dir is not None else default_traces_dir()
        p = p / str(name_or_path)
    if not p.exists():
        raise ValueError(f"no trace {str(name_or_path)!r}: not a path, and not one of {', '.join(TRACE_NAMES)} "
                         f"under {traces_dir or default_traces_dir()}")
    if p.is_file():
        fmt = detect_format(p)
        if fmt is None:
            raise ValueError(f"{p}: not a supported trace format")
        return fmt, [p]
    if (p / "requests.csv").is_file():
        return "weka", [p / "requests.csv"]
    found: dict[str, list[Path]] = {}
    for file in sorted(f for f in p.iterdir() if f.is_file() and f.suffix in (".jsonl", ".json", ".csv")):
        fmt = detect_format(file)
        if fmt is not None:
            found.setdefault(fmt, []).append(file)
    if not found:
        raw = p / "raw"
        if raw.is_dir():
            return resolve(raw)
        raise ValueError(f"{p}: no trace files in a supported format")
    if len(found) > 1:
        raise ValueError(f"{p}: files of several formats ({', '.join(sorted(found))}); pass one file")
    fmt, files = next(iter(found.items()))
    # Upstream WEKA traces are one session per file: the weka loader reads the folder at once.
    return fmt, ([p] if fmt == "weka" else files)


_LOADERS: dict[str, Callable[..., TraceSet]] = {
    "weka": weka_trace, "mooncake": mooncake_trace, "azure": azure_trace, "tracelab": tracelab_trace,
}


def load_trace(name_or_path: str | Path, *, traces_dir: str | Path | None = None, token_scale: float = 1.0,
               time_scale: float = 1.0, max_sessions: int | None = None, max_steps: int | None = None,
               min_steps: int = 2, max_context_tokens: int | None = None, max_wait_s: float | None = None,
               seed: int = 0, **options: Any) -> TraceSet:
    """Load a trace as agent sessions, scaled by token_scale / time_scale (ratios kept).

    Each step's token counts are divided by `token_scale` and every duration
    by `time_scale`; the result states both and its provenance. `seed` fixes
    whatever a loader synthesises. `options` go to the format's loader (e.g.
    `wait_source="trace"` for mooncake).
    """
    fmt, files = resolve(name_or_path, traces_dir)
    if fmt == "agent_jsonl":
        parts = [read_jsonl(f) for f in files]
        trace = TraceSet(parts[0].name, tuple(s for t in parts for s in t.sessions), parts[0].token_scale,
                         parts[0].time_scale, parts[0].provenance)
        trace = trace.scaled(token_scale, time_scale)
        sessions = [s for s in trace.sessions if len(s.steps) >= min_steps]
        trace = TraceSet(trace.name, tuple(sessions[:max_sessions]), trace.token_scale, trace.time_scale,
                         trace.provenance)
        return trace.truncated(max_steps) if max_steps is not None else trace
    kwargs = dict(token_scale=token_scale, time_scale=time_scale, max_sessions=max_sessions, max_steps=max_steps,
                  min_steps=min_steps, max_context_tokens=max_context_tokens, max_wait_s=max_wait_s, seed=seed,
                  **options)
    parts = [_LOADERS[fmt](f, **kwargs) for f in files]
    if len(parts) == 1:
        return parts[0]
    sessions: list[AgentSession] = []
    for f, part in zip(files, parts):
        sessions += [replace(s, session_id=f"{f.stem}/{s.session_id}") for s in part.sessions]
    prov = parts[0].provenance + (f"Merged {len(files)} files: {', '.join(f.name for f in files)}.",)
    return TraceSet(files[0].parent.name, tuple(sessions[:max_sessions]), token_scale, time_scale, prov)
