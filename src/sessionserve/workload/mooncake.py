"""Loader for Mooncake's FAST'25 traces (`conversation_trace.jsonl`: timestamp ms, lengths, 512-token block hashes).

The trace has real arrivals and real prefix structure but no session ids and
no tool waits. Sessions are rebuilt from block-hash prefix chains: a request's
parent is the last earlier request holding its deepest shared block, when at
least `MIN_SHARED_BLOCKS` blocks are shared (the heuristic of
shared/traces/mooncake_conversation/README.md). A parent's first child
continues its session; later children (branches) start new sessions whose
first prompt repeats the shared blocks, so the prefix sharing survives as
cross-session sharing. Waits come from TraceLab's tool-latency distribution
(the trace's gaps are human chat time), unless `wait_source="trace"`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from sessionserve.workload.synth import TRACELAB_TOOL_LATENCY_S, tool_wait_s
from sessionserve.workload.trace import AgentSession, Step, ToolCall, TraceSet

MOONCAKE_BLOCK_TOKENS = 512
MIN_SHARED_BLOCKS = 2
BREAK_KEEP_FRACTION = 0.9  # as in weka.py: a child keeping < 90% of its parent's blocks cut the context
TICK_S = 3.0  # timestamps are quantized to ~3 s ticks


def read_requests(path: str | Path) -> list[dict]:
    """Rows of a Mooncake JSONL trace (timestamp, input_length, output_length, hash_ids), in file order."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def chain_parents(requests: list[dict]) -> list[int | None]:
    """For each request, the index of its parent request (or None), by the deepest shared block-hash prefix."""
    holder: dict[int, int] = {}  # block id -> last request index holding it
    parents: list[int | None] = []
    for i, r in enumerate(requests):
        depth = 0
        hashes = r["hash_ids"]
        while depth < len(hashes) and hashes[depth] in holder:
            depth += 1
        parents.append(holder[hashes[depth - 1]] if depth >= MIN_SHARED_BLOCKS else None)
        for h in hashes:
            holder[h] = i
    return parents


def group_sessions(requests: list[dict]) -> list[list[int]]:
    """Linear chains of request indices: a request continues its parent's session if it is the first child."""
    parents = chain_parents(requests)
    session_of: dict[int, int] = {}
    has_child: set[int] = set()
    chains: list[list[int]] = []
    for i, parent in enumerate(parents):
        if parent is not None and parent not in has_child:
            has_child.add(parent)
            session_of[i] = session_of[parent]
            chains[session_of[i]].append(i)
        else:
            session_of[i] = len(chains)
            chains.append([i])
    return chains


def _common_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def mooncake_trace(path: str | Path, *, token_scale: float = 1.0, time_scale: float = 1.0,
                   max_steps: int | None = None, max_sessions: int | None = None, min_steps: int = 2,
                   max_context_tokens: int | None = None, max_wait_s: float | None = None, seed: int = 0,
                   wait_source: str = "tracelab", **_: object) -> TraceSet:
    """Agent sessions rebuilt from a Mooncake trace, with the choices made stated in `provenance`."""
    if wait_source not in ("tracelab", "trace"):
        raise ValueError(f"wait_source must be tracelab|trace, got {wait_source!r}")
    p = Path(path)
    requests = read_requests(p)
    chains = group_sessions(requests)
    rng = random.Random(f"mooncake:{seed}")
    block_tokens = max(1, round(MOONCAKE_BLOCK_TOKENS / token_scale))
    sessions: list[AgentSession] = []
    for chain in chains:
        # NOTE: draw the jitter and waits for every chain, kept or not, so one session's draws do not depend on
        # which other sessions the filters keep.
        jitter_s = rng.uniform(0.0, TICK_S)
        waits = [tool_wait_s(rng, time_scale, max_wait_s) for _ in chain]
        steps: list[Step] = []
        context = 0
        for k, idx in enumerate(chain):
            r = requests[idx]
            hashes = r["hash_ids"]
            in_scaled = max(1, round(r["input_length"] / token_scale))
            out_scaled = max(1, round(r["output_length"] / token_scale))
            kept: int | None = None
            if k == 0:
                new, blocks = in_scaled, tuple(hashes)
            else:
                prev = requests[chain[k - 1]]
                shared = _common_blocks(prev["hash_ids"], hashes)
                # NOTE: the parent's last block is partial, and its hash changes once the child extends it.
                if shared < BREAK_KEEP_FRACTION * max(1, len(prev["hash_ids"]) - 1):
                    kept = min(context, shared * block_tokens)
                    new, blocks = max(1, in_scaled - shared * block_tokens), tuple(hashes[shared:])
                else:
                    grown = r["input_length"] - prev["input_length"] - prev["output_length"]
                    new, blocks = max(1, round(grown / token_scale)), ()
            base = context if kept is None else kept
            if max_context_tokens is not None and base + new + out_scaled > max_context_tokens:
                break
            context = base + new + out_scaled
            is_last = k + 1 == len(chain) or (max_steps is not None and len(steps) + 1 >= max_steps)
            if is_last:
                steps.append(Step(new, out_scaled, (), "end", blocks, block_tokens if blocks else 0, kept))
                break
            if wait_source == "trace":
                gap_s = (requests[chain[k + 1]]["timestamp"] - r["timestamp"]) / 1000 / time_scale
                call = ToolCall("user", gap_s if max_wait_s is None else min(gap_s, max_wait_s))
                steps.append(Step(new, out_scaled, (call,), "human", blocks, block_tokens if blocks else 0, kept))
            else:
                steps.append(Step(new, out_scaled, (ToolCall("tool", waits[k]),), "tool", blocks,
                                  block_tokens if blocks else 0, kept))
        if len(steps) < min_steps:
            continue
        if steps[-1].wait_kind != "end":
            last = steps[-1]
            steps[-1] = Step(last.new_input_tokens, last.output_tokens, (), "end", last.prefix_block_ids,
                             last.prefix_block_tokens, last.context_kept_tokens)
        arrival_s = (requests[chain[0]]["timestamp"] / 1000 + jitter_s) / time_scale
        sessions.append(AgentSession(f"mc{chain[0]}", tuple(steps), arrival_s, "mooncake_conversation",
                                     {"requests": chain[:len(steps)]}))
        if max_sessions is not None and len(sessions) >= max_sessions:
            break
    if sessions:  # arrivals relative to the first kept session
        t0 = min(s.arrival_s or 0.0 for s in sessions)
        sessions = [AgentSession(s.session_id, s.steps, (s.arrival_s or 0.0) - t0, s.source, s.meta)
                    for s in sessions]
    wait_text = (f"Tool waits are synthesised (the trace has none; its gaps are human chat time): one call per step "
                 f"drawn from {TRACELAB_TOOL_LATENCY_S.describe()}, seed {seed}." if wait_source == "tracelab" else
                 "Waits are the trace's gaps between a request and its child (human chat time plus the previous "
                 "response's service time, which the trace cannot separate).")
    prov = (
        "Lengths, arrivals and prefix structure are real: Mooncake FAST'25 conversation trace (Kimi production; "
        "github.com/kvcache-ai/Mooncake FAST25-release/traces, commit 3cca71d, Apache-2.0; Qin et al., FAST 2025).",
        f"Sessions are not in the trace: rebuilt as chains of requests sharing >= {MIN_SHARED_BLOCKS} leading "
        "512-token blocks with an earlier request (parent = last earlier holder of the deepest shared block); "
        "a parent's later children start new sessions that share its blocks.",
        f"Block hashes become token contents: equal hash id -> identical {block_tokens} token ids (512 / token "
        "scale), so shared prefixes in the trace are shared prefixes in the prompts (block 0 is shared by all).",
        f"Session arrivals: the first request's timestamp plus uniform jitter within its ~{TICK_S:g} s tick "
        "(the trace is quantized), divided by the time scale.",
        wait_text,
    )
    return TraceSet(p.parent.name if p.is_file() else p.name, tuple(sessions), token_scale, time_scale, prov)
