"""A tool loop over HTTP chat completions, before vs after returning turns splice onto the model's own tokens.

    git -C /work/main worktree add /tmp/ss-before 910a5ee              # the server before 587b8c8
    .venv/bin/python bench/continuation.py --before-src /tmp/ss-before/src
    .venv/bin/python bench/continuation.py --before-src /tmp/ss-before/src --after-src /tmp/ss-after/src \
        --sessions 4 --steps 24 --repeats 3 --model llama-tiny          # the run in bench/RESULTS.md

What it measures: before 587b8c8 a returning chat-completions turn was
rendered whole and tokenized again, and the session was cut back to the
longest common prefix of its tokens and that prompt. The model's own previous
reply does not survive the round trip (re-tokenized text, and tool-call
arguments that the client's JSON library wrote again), so part of the session
was computed again every turn. Since 587b8c8 the server splices only the new
messages onto the tokens it holds (src/sessionserve/server/turn/continuation.py).

What runs: two `sessionserve serve` processes on loopback, each from its own
source tree (`PYTHONPATH=<src>`: --before-src, --after-src), same model and
engine flags (`--host-kv-bytes 0` on both; the old default was a 2 GiB host
tier). They run one after the other, never together, and their order
alternates across repeats; each starts afresh per repeat. The before server
must answer POST /v1/responses with 404 (it predates it), the after server
must not. Against each, the official `openai` client replays the same
sessions one at a time, streamed with include_usage and `X-Session-ID`:

- Sessions: the first --sessions sessions of the WEKA Claude Code trace
  (`load_weka`, tokens / --token-scale) with --steps steps and no context
  compaction in them. Turn 1 is a system message of step 1's input size plus
  a one-line task. Turn k > 1 appends the assistant message returned at
  turn k-1 (its tool call) and a tool result of step k's new-input tokens
  (random vocabulary words, counted with the model's tokenizer); after a step
  the trace ends with `end_turn`, the tool result is one line and a user
  message carries the rest.
- Replies: tool_choice "required" on one tool `run(verb: enum, arg: string
  <= 16 chars)`, parallel_tool_calls off, temperature 0, so the random-weight
  model finishes a call in tens of tokens (real replies are ~200; the before
  server's loss grows with them). Variant `sorted` sends the arguments back as
  `json.dumps(json.loads(args), sort_keys=True, indent=1)` (key order and
  spacing differ from what the model wrote, as some frameworks send them);
  `exact` sends them back as received.
- Every request carries logit_bias -100 on `<|endoftext|>`. The embedded
  model's generation_config lists it as a second EOS beside the template's
  `<|im_end|>`, and with random weights a forced call often ends on it; a
  trained chat model closes its turn with `<|im_end|>`. The after server
  splices only onto a reply that ends the way its template closes one, and
  renders the whole prompt otherwise (its `prefix` count), so without the
  bias the comparison would measure the model's pick of EOS.
  --allow-endoftext runs without it.
- Turn text is salted per (session, variant, repeat), so no turn reuses
  another's KV through the prefix cache.

Per turn, from `usage`: prompt, cached and completion tokens. Recomputed
tokens of turn k+1 = (prompt_k + completion_k - 1) - cached_{k+1} when
positive (the reply's last token is always computed with the next turn); new
item tokens = prompt_{k+1} - (prompt_k + completion_k). Times: the engine's
TTFT (first token - arrival at the engine, the `sessionserve_time_to_first_
token_seconds` histogram's sum before and after the request: the same code in
both trees), the client's time to the first chunk carrying content or a tool
call, and the client's end-to-end time. NOTE: the before server sends a tool
call only once it is complete, so its first-chunk time holds the whole
decode; compare prefill work with the engine TTFT.

Output: Markdown tables on stdout and in <out>/continuation.md, every turn in
<out>/turns.json, server logs in <out>/.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sessionserve.workload.server_process import server_process  # noqa: E402
from sessionserve.workload.trace import AgentSession  # noqa: E402
from sessionserve.workload.weka import load_weka  # noqa: E402

OUT_DIR = ROOT / "bench" / "out" / "continuation"
TRACE_DIR = ROOT.parent / "shared" / "traces" / "weka_claude_code"
SERVED_MODEL_NAME = "bench"
VARIANTS = ("sorted", "exact")
TOOL = {"type": "function", "function": {
    "name": "run", "description": "Run one workspace action and return its output.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["verb", "arg"],
                   # NOTE: not in key order, so sort_keys changes the order the model wrote
                   "properties": {"verb": {"type": "string", "enum": ["read", "grep", "edit", "test", "list"]},
                                  "arg": {"type": "string", "maxLength": 16}}}}}
HUMAN_TOOL_RESULT = "done"  # the tool result before a user message (a step after `end_turn`)


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One chat-completions request of a replayed session, as the client saw it."""

    server: str  # before / after
    variant: str  # sorted / exact
    repeat: int
    session_id: str
    turn: int  # 1-based
    num_prompt_tokens: int
    num_cached_tokens: int
    num_completion_tokens: int
    num_recomputed_tokens: int | None  # None on turn 1
    num_new_item_tokens: int | None  # None on turn 1
    ttft_s: float | None  # the engine's, from /metrics
    first_chunk_s: float | None  # client: first chunk with content or a tool call
    e2e_s: float  # client
    has_tool_call: bool
    args_resent_changed: bool  # the arguments sent back differ from the text received


# --------------------------------------------------------------------------- turn text

class FillerText:
    """Deterministic text of a given length in the model's tokens: random single-token vocabulary words."""

    def __init__(self, tokenizer_json: Path) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(tokenizer_json))
        words = sorted(t[1:] for t in self.tok.get_vocab() if re.fullmatch(r"Ġ[a-z]{3,10}", t))
        self.words = [w for w in words if len(self.tok.encode(" " + w, add_special_tokens=False).ids) == 1]

    def num_tokens(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def text(self, key: str, num_tokens: int) -> str:
        rng = random.Random(key)
        words = [rng.choice(self.words) for _ in range(max(1, num_tokens))]
        while len(words) > 1 and self.num_tokens(" ".join(words)) > num_tokens:
            words.pop()
        return " ".join(words)


def pick_sessions(trace_dir: Path, num_sessions: int, num_steps: int, token_scale: float,
                  max_context_tokens: int) -> list[AgentSession]:
    """The first sessions in trace order with `num_steps` steps, none of them a context compaction."""
    sessions = load_weka(trace_dir, token_scale=token_scale, max_steps=num_steps, min_steps=num_steps,
                         max_context_tokens=max_context_tokens)
    kept = [s for s in sessions if all(step.context_kept_tokens is None for step in s.steps)]
    if len(kept) < num_sessions:
        raise SystemExit(f"only {len(kept)} sessions have {num_steps} steps within {max_context_tokens} tokens")
    return kept[:num_sessions]


# --------------------------------------------------------------------------- servers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_commit(src: Path) -> str:
    """The commit a source tree is at, with `+dirty` when its src/ differs from it."""
    head = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "?"
    dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--", "."], capture_output=True,
                           text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


@contextlib.contextmanager
def serve(name: str, src: Path, a: argparse.Namespace) -> Iterator[str]:
    """`sessionserve serve` imported from `src` on a free loopback port; yields its base URL (no /v1)."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "sessionserve.cli", "serve", "--model", str(a.model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", SERVED_MODEL_NAME, "--host-kv-bytes", "0",
           "--kv-cache-bytes", str(a.kv_cache_bytes), "--max-num-seqs", "8", "--max-num-batched-tokens",
           str(a.max_num_batched_tokens), "--threads", str(a.threads), "--residency-policy", "predictive"]
    env = {**os.environ, "PYTHONPATH": str(src)}
    with server_process(cmd, port, a.out / f"{name}.log", env=env, start_timeout_s=300, name=name):
        url = f"http://127.0.0.1:{port}"
        status = httpx.post(f"{url}/v1/responses", json={"model": SERVED_MODEL_NAME, "input": "hi",
                                                         "max_output_tokens": 1}, timeout=60).status_code
        if (status == 404) != (name == "before"):
            raise SystemExit(f"{name} server from {src}: POST /v1/responses answered {status}; the before tree "
                             "must predate it (404) and the after tree must have it")
        yield url


class ServerMetrics:
    """What the server's /metrics says: each request's TTFT as the engine measured it (the change of the TTFT
    histogram's sum; requests must run one at a time), and how turns continued their sessions (after only)."""

    _TTFT = re.compile(r"^sessionserve_time_to_first_token_seconds_(sum|count)\{[^}]*\} (\S+)$", re.M)
    _WAYS = re.compile(r'^sessionserve_session_continuations_total\{[^}]*how="(\w+)"[^}]*\} (\S+)$', re.M)

    def __init__(self, url: str) -> None:
        import httpx

        self.http = httpx.Client(base_url=url, timeout=30)

    def ttft_totals(self) -> tuple[float, float]:
        """(sum, count) over every model of the server."""
        totals = {"sum": 0.0, "count": 0.0}
        for kind, value in self._TTFT.findall(self.http.get("/metrics").text):
            totals[kind] += float(value)
        return totals["sum"], totals["count"]

    def ttft_since(self, before: tuple[float, float], wait_s: float = 5.0) -> float | None:
        """The TTFT of the one request finished since `before` was read; None if it is not recorded in time."""
        deadline = time.monotonic() + wait_s
        while True:
            total, count = self.ttft_totals()
            if count == before[1] + 1:
                return total - before[0]
            if count > before[1] + 1 or time.monotonic() > deadline:
                return None
            time.sleep(0.02)

    def continuations(self) -> dict[str, int]:
        """Chat turns by how they continued their session (exact splice, prefix, new); {} before 587b8c8."""
        out: dict[str, int] = {}
        for way, value in self._WAYS.findall(self.http.get("/metrics").text):
            out[way] = out.get(way, 0) + int(float(value))
        return out


# --------------------------------------------------------------------------- the tool loop

def one_turn(client: Any, messages: list[dict[str, Any]], sid: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed forced-tool-call request: usage, the tool call (or None), the client's times."""
    t0 = time.monotonic()
    first_s, usage, call, text = None, None, {"id": "", "name": "", "arguments": ""}, []
    stream = client.chat.completions.create(
        model=SERVED_MODEL_NAME, messages=messages, tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_headers={"X-Session-ID": sid},
        **body)
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            if first_s is None and (delta.content or delta.tool_calls):
                first_s = time.monotonic() - t0
            text.append(delta.content or "")
            for tc in delta.tool_calls or ():
                call["id"] = tc.id or call["id"]
                if tc.function is not None:
                    call["name"] += tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
    e2e_s = time.monotonic() - t0
    cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
    return {"prompt": usage.prompt_tokens, "cached": cached, "completion": usage.completion_tokens,
            "call": call if call["name"] else None, "content": "".join(text) or None,
            "first_chunk_s": first_s, "e2e_s": e2e_s}


def new_items(session: AgentSession, k: int, call_id: str, key: str, filler: FillerText) -> list[dict[str, Any]]:
    """The messages step k (> 0) adds after the assistant's tool call: its tool result, and after an
    `end_turn` step a user message, together of the step's new-input size."""
    n = session.steps[k].new_input_tokens
    if session.steps[k - 1].wait_kind == "human":
        return [{"role": "tool", "tool_call_id": call_id, "content": HUMAN_TOOL_RESULT},
                {"role": "user", "content": filler.text(f"{key}:user:{k}", n)}]
    return [{"role": "tool", "tool_call_id": call_id, "content": filler.text(f"{key}:tool:{k}", n)}]


def run_session(client: Any, metrics: ServerMetrics, session: AgentSession, server: str, variant: str, repeat: int,
                filler: FillerText, body: dict[str, Any]) -> list[TurnRecord]:
    """Replay one session's steps as a tool loop; stops early if a reply carries no tool call."""
    key = f"{session.session_id}:{variant}:{repeat}"
    sid = f"{session.session_id}-{variant}-{repeat}"
    first = session.steps[0].new_input_tokens
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": f"Session {key}. " + filler.text(f"{key}:system", max(1, first - 24))},
        {"role": "user", "content": "Fix the failing test, one tool call at a time."}]
    records: list[TurnRecord] = []
    prev: dict[str, Any] | None = None
    for k in range(len(session.steps)):
        before = metrics.ttft_totals()
        r = one_turn(client, messages, sid, body)
        recomputed = new_item_tokens = None
        if prev is not None:
            recomputed = max(0, prev["prompt"] + prev["completion"] - 1 - r["cached"])
            new_item_tokens = r["prompt"] - (prev["prompt"] + prev["completion"])
        call = r["call"]
        resent = call["arguments"] if call else ""
        if call and variant == "sorted":
            resent = json.dumps(json.loads(call["arguments"]), sort_keys=True, indent=1)
        records.append(TurnRecord(server, variant, repeat, session.session_id, k + 1, r["prompt"], r["cached"],
                                  r["completion"], recomputed, new_item_tokens, metrics.ttft_since(before),
                                  r["first_chunk_s"], r["e2e_s"], call is not None,
                                  bool(call) and resent != call["arguments"]))
        if call is None or k + 1 == len(session.steps):
            break
        messages.append({"role": "assistant", "content": r["content"], "tool_calls": [
            {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": resent}}]})
        messages += new_items(session, k + 1, call["id"], key, filler)
        prev = r
    metrics.http.delete(f"/v1/sessions/{sid}")
    return records


def run_server(name: str, src: Path, sessions: list[AgentSession], repeat: int, a: argparse.Namespace,
               filler: FillerText) -> tuple[list[TurnRecord], dict[str, dict[str, int]]]:
    """Start server `name`, warm it up, replay every session in both variants, stop it. Returns the turns and,
    per variant, the server's count of turns by how they continued their session (after only)."""
    import openai

    body: dict[str, Any] = {"max_tokens": a.max_tokens}
    if not a.allow_endoftext:  # NOTE: see the module docstring
        body["logit_bias"] = {str(filler.tok.token_to_id("<|endoftext|>")): -100}
    with serve(name, src, a) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
        metrics = ServerMetrics(url)
        warm = [{"role": "user", "content": filler.text("warm-up", 600)}]
        for _ in range(2):  # grammar compilation and first-call costs stay out of the timed turns
            one_turn(client, warm, f"warm-up-{repeat}", body)
        metrics.http.delete(f"/v1/sessions/warm-up-{repeat}")
        records: list[TurnRecord] = []
        ways: dict[str, dict[str, int]] = {}
        for variant in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
            start = metrics.continuations()
            for session in sessions:
                records += run_session(client, metrics, session, name, variant, repeat, filler, body)
                print(f"[{name}] repeat {repeat} {variant} {session.session_id}: {len(records)} turns so far",
                      file=sys.stderr, flush=True)
            ways[variant] = {k: v - start.get(k, 0) for k, v in metrics.continuations().items()
                             if v - start.get(k, 0)}
        return records, ways


# --------------------------------------------------------------------------- report

def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _mean_median(values: list[float], digits: int = 1, scale: float = 1.0) -> str:
    if not values:
        return "-"
    return f"{_fmt(statistics.mean(values) * scale, digits)} / {_fmt(statistics.median(values) * scale, digits)}"


def per_turn_table(records: list[TurnRecord], variant: str, num_steps: int) -> str:
    """Per turn index, pooled over sessions and repeats: recomputed tokens and times, before vs after."""
    rows = ["| turn | n | prompt tokens before / after (mean) | recomputed before (mean / median) "
            "| recomputed after (mean / median) | engine TTFT ms before (mean / median) "
            "| engine TTFT ms after (mean / median) | first chunk ms before (median) | first chunk ms after (median) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for turn in range(1, num_steps + 1):
        side = {s: [r for r in records if r.variant == variant and r.turn == turn and r.server == s]
                for s in ("before", "after")}
        if not side["before"] and not side["after"]:
            continue
        cells = [f"{turn}", f"{len(side['before'])} / {len(side['after'])}",
                 " / ".join(_fmt(statistics.mean(r.num_prompt_tokens for r in side[s]), 0) if side[s] else "-"
                            for s in ("before", "after"))]
        for s in ("before", "after"):
            cells.append(_mean_median([r.num_recomputed_tokens for r in side[s]
                                       if r.num_recomputed_tokens is not None]))
        for s in ("before", "after"):
            cells.append(_mean_median([r.ttft_s for r in side[s] if r.ttft_s is not None], 1, 1000))
        for s in ("before", "after"):
            firsts = [r.first_chunk_s for r in side[s] if r.first_chunk_s is not None]
            cells.append(_fmt(statistics.median(firsts) * 1000, 1) if firsts else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _per_repeat(records: list[TurnRecord], fn: Any) -> list[float]:
    """fn over each repeat's returning turns (turn > 1)."""
    out = []
    for rep in sorted({r.repeat for r in records}):
        turns = [r for r in records if r.repeat == rep and r.turn > 1]
        if turns:
            out.append(fn(turns))
    return out


TOTALS: tuple[tuple[str, Any, int, float], ...] = (
    ("recomputed tokens per returning turn (mean)",
     lambda t: statistics.mean(r.num_recomputed_tokens for r in t), 1, 1.0),
    ("prompt tokens computed per returning turn (prompt - cached, mean)",
     lambda t: statistics.mean(r.num_prompt_tokens - r.num_cached_tokens for r in t), 1, 1.0),
    ("new-item tokens per returning turn (mean)", lambda t: statistics.mean(r.num_new_item_tokens for r in t), 1, 1.0),
    ("engine TTFT p50 of returning turns, ms",
     lambda t: statistics.median(r.ttft_s for r in t if r.ttft_s is not None), 1, 1000.0),
    ("first chunk p50 of returning turns, ms (client)",
     lambda t: statistics.median(r.first_chunk_s for r in t if r.first_chunk_s is not None), 1, 1000.0),
    ("end-to-end p50 of returning turns, ms (client)", lambda t: statistics.median(r.e2e_s for r in t), 1, 1000.0),
)


def totals_table(records: list[TurnRecord]) -> str:
    """Per variant and server, each total as min / median over the repeats."""
    rows = ["| variant | measure | before (min / median over repeats) | after (min / median over repeats) "
            "| before / after (medians) |", "|---|---|---|---|---|"]
    for variant in VARIANTS:
        for label, fn, digits, scale in TOTALS:
            med = {}
            cells = []
            for s in ("before", "after"):
                vals = [v * scale for v in _per_repeat([r for r in records if r.variant == variant and r.server == s],
                                                      fn)]
                med[s] = statistics.median(vals) if vals else None
                cells.append(f"{_fmt(min(vals), digits)} / {_fmt(med[s], digits)}" if vals else "-")
            ratio = f"{med['before'] / med['after']:.2f}x" if med["before"] and med["after"] else "-"
            rows.append(f"| {variant} | {label} | {cells[0]} | {cells[1]} | {ratio} |")
    return "\n".join(rows)


def checks(records: list[TurnRecord], ways: dict[tuple[str, str], dict[str, int]]) -> list[str]:
    """Facts a reader needs to trust the tables: calls made, arguments resent changed, engine TTFTs read, and
    how the server says the turns continued their sessions."""
    out = []
    for variant in VARIANTS:
        for s in ("before", "after"):
            rs = [r for r in records if r.variant == variant and r.server == s]
            if not rs:
                continue
            how = ", ".join(f"{k} {v}" for k, v in sorted(ways.get((s, variant), {}).items())) or "not counted"
            out.append(f"{variant}/{s}: {len(rs)} turns, {sum(not r.has_tool_call for r in rs)} without a tool call, "
                       f"arguments resent changed in {sum(r.args_resent_changed for r in rs)}, engine TTFT missing "
                       f"in {sum(r.ttft_s is None for r in rs)}, mean completion tokens "
                       f"{statistics.mean(r.num_completion_tokens for r in rs):.1f}; turns by how the server "
                       f"continued them: {how}")
    return out


# --------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--before-src", type=Path, required=True, help="src/ of a tree before 587b8c8 (e.g. 910a5ee)")
    p.add_argument("--after-src", type=Path, default=ROOT / "src", help="src/ of the tree to compare")
    p.add_argument("--model", default="llama-tiny", help="llama-tiny, llama-small or an HF model folder")
    p.add_argument("--context", type=int, default=8192, help="context of the embedded llama-tiny built here")
    p.add_argument("--trace-dir", type=Path, default=TRACE_DIR)
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--steps", type=int, default=24, help="turns per session")
    p.add_argument("--token-scale", type=float, default=16.0, help="trace tokens per replayed token")
    p.add_argument("--max-context", type=int, default=5000, help="trace context cap (scaled tokens); sessions "
                   "that would pass it are skipped")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96, help="per reply (a call takes tens)")
    p.add_argument("--allow-endoftext", action="store_true",
                   help="let replies end on <|endoftext|> (no logit_bias; see the module docstring)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--out", type=Path, default=OUT_DIR)
    return p.parse_args(argv)


def resolve_model(a: argparse.Namespace) -> Path:
    from sessionserve.modelgen import make_model as mm

    if a.model == "llama-small":
        return mm.ensure_model("llama", "small")
    if a.model == "llama-tiny":
        out = a.out / "models" / f"llama-tiny-ctx{a.context}"
        return out if (out / "config.json").is_file() else mm.make_model(out, "llama", "tiny", context=a.context)
    return Path(a.model)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    a.model_dir = resolve_model(a)
    sessions = pick_sessions(a.trace_dir, a.sessions, a.steps, a.token_scale, a.max_context)
    filler = FillerText(a.model_dir / "tokenizer.json")
    srcs = {"before": a.before_src.resolve(), "after": a.after_src.resolve()}
    commits = {name: tree_commit(src) for name, src in srcs.items()}
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.monotonic()
    records: list[TurnRecord] = []
    ways: dict[tuple[str, str], dict[str, int]] = {}
    for repeat in range(a.repeats):
        for name in ("before", "after") if repeat % 2 == 0 else ("after", "before"):
            turns, counted = run_server(name, srcs[name], sessions, repeat, a, filler)
            records += turns
            for variant, by_way in counted.items():
                total = ways.setdefault((name, variant), {})
                for way, n in by_way.items():
                    total[way] = total.get(way, 0) + n
    wall_s = time.monotonic() - t0
    (a.out / "turns.json").write_text(json.dumps([asdict(r) for r in records], indent=1))

    steps = ", ".join(f"{s.session_id} (turn 1 {s.steps[0].new_input_tokens} tokens, then "
                      f"{statistics.median(st.new_input_tokens for st in s.steps[1:]):.0f} median new)"
                      for s in sessions)
    lines = [f"# {started:%Y-%m-%d %H:%M} UTC, {wall_s / 60:.1f} min; before {commits['before']} "
             f"({srcs['before']}), after {commits['after']} ({srcs['after']}); model {a.model_dir}; "
             f"{a.repeats} repeats; sessions: {steps}", ""]
    for variant in VARIANTS:
        lines += [f"## per turn, variant `{variant}` (pooled over sessions and repeats)", "",
                  per_turn_table(records, variant, a.steps), ""]
    lines += ["## totals (returning turns 2..N)", "", totals_table(records), ""]
    lines += [f"- {c}" for c in checks(records, ways)]
    text = "\n".join(lines)
    (a.out / "continuation.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
