"""Loader for Azure's LLM inference traces (CSV: TIMESTAMP, ContextTokens, GeneratedTokens).

Only arrivals and lengths are real. Sessions are synthesised: requests are
taken in arrival order, each session takes the next n of them with n drawn
from the WEKA steps-per-session distribution, and a step appends the
request's ContextTokens as new input (Azure's p50 prompt, 1,020 tokens, is
close to WEKA's p50 new tokens per step, 713). The session arrives at its
first request's timestamp. Tool waits come from TraceLab's distribution.
"""

from __future__ import annotations

import csv
import random
from datetime import datetime
from pathlib import Path

from sessionserve.workload.synth import TRACELAB_TOOL_LATENCY_S, WEKA_STEPS_PER_SESSION, num_steps, tool_wait_s
from sessionserve.workload.trace import AgentSession, Step, ToolCall, TraceSet


def read_requests(path: str | Path) -> list[tuple[float, int, int]]:
    """(arrival_s relative to the first row, context tokens, generated tokens) per row, in file order."""
    rows: list[tuple[float, int, int]] = []
    t0: datetime | None = None
    with Path(path).open(newline="") as f:
        for row in csv.DictReader(f):
            # NOTE: 7 fractional digits (100 ns) do not parse with %f; microseconds are enough here.
            stamp, _, frac = row["TIMESTAMP"].partition(".")
            t = datetime.strptime(f"{stamp}.{frac[:6] or '0'}", "%Y-%m-%d %H:%M:%S.%f")
            t0 = t0 or t
            rows.append(((t - t0).total_seconds(), int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    return rows


def azure_trace(path: str | Path, *, token_scale: float = 1.0, time_scale: float = 1.0,
                max_steps: int | None = None, max_sessions: int | None = None, min_steps: int = 2,
                max_context_tokens: int | None = None, max_wait_s: float | None = None, seed: int = 0,
                **_: object) -> TraceSet:
    """Agent sessions synthesised around Azure's real arrivals and lengths; `provenance` says how."""
    p = Path(path)
    requests = read_requests(p)
    rng = random.Random(f"azure:{seed}")
    sessions: list[AgentSession] = []
    pos = 0
    while pos < len(requests) and (max_sessions is None or len(sessions) < max_sessions):
        n = num_steps(rng, max_steps)
        chunk = requests[pos:pos + n]
        pos += n
        waits = [tool_wait_s(rng, time_scale, max_wait_s) for _ in chunk]
        steps: list[Step] = []
        context = 0
        for k, (_, ctx, gen) in enumerate(chunk):
            new, out = max(1, round(ctx / token_scale)), max(1, round(gen / token_scale))
            if max_context_tokens is not None and context + new + out > max_context_tokens:
                break
            context += new + out
            steps.append(Step(new, out, (ToolCall("tool", waits[k]),), "tool"))
        if len(steps) < min_steps:
            continue
        last = steps[-1]
        steps[-1] = Step(last.new_input_tokens, last.output_tokens, (), "end")
        sessions.append(AgentSession(f"az{pos - n}", tuple(steps), chunk[0][0] / time_scale, "azure_llm_2023",
                                     {"first_request": pos - n}))
    prov = (
        "Arrivals and lengths are real: Azure LLM inference trace 2023, conversation service "
        "(github.com/Azure/AzurePublicDataset data/AzureLLMInferenceTrace_conv.csv, CC-BY 4.0; Patel et al., "
        "Splitwise, ISCA 2024).",
        f"Sessions are synthesised (the trace has none): consecutive requests in arrival order, session length "
        f"drawn from {WEKA_STEPS_PER_SESSION.describe()}, capped at max_steps; seed {seed}.",
        "Each step appends its request's ContextTokens as new input (Azure's prompt p50 1,020 tokens is close to "
        "WEKA's p50 new tokens per agent step, 713); no prefix is shared across sessions (none is known).",
        "A session arrives at its first request's timestamp (divided by the time scale); later requests' "
        "timestamps are not used, since a session's next step follows its tool wait.",
        f"Tool waits are synthesised: one call per step from {TRACELAB_TOOL_LATENCY_S.describe()}.",
    )
    return TraceSet(p.parent.name if p.is_file() else p.name, tuple(sessions), token_scale, time_scale, prov)
