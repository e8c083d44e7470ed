"""Soak: agent-like sessions against a live server for a long time; nothing may leak or go wrong.

Several concurrent agents run conversations over loopback HTTP: multi-turn
chat completions with a session id (explicit, or none: an implicit session),
a tool wait between turns (`expected_wait_s` sent), some turns streamed, some
abandoned mid-way (a stream closed after a few chunks, a blocking call given
up). Every request is accounted for: completed, abandoned by the client, or
answered with an error status; a transport error or a 5xx is a failure. At
the end every session is closed and the engine must be back at rest: no
request running, every KV block free in every tier.

The report (printed, and written as JSON with --out): duration, request
counts by outcome, errors by status, p50/p99 latency of completed requests,
RSS of the process at start (after a warm-up) and end, KV blocks used at
start and end. The server runs in this process (engine thread + uvicorn on a
free 127.0.0.1 port), so RSS covers server and load generator together.

    .venv/bin/python bench/soak.py                                # 30 minutes, tiny model, 6 agents
    .venv/bin/python bench/soak.py --duration-s 180 --out bench/out/soak.json
    .venv/bin/python bench/soak.py --agents 12 --model-size small --residency-policy keep

`tests/reliability/test_soak.py` runs the same driver (`run_soak`) for ~40 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]

KEY = "soak-key"
TOOLS = [{"type": "function", "function": {"name": "run_tests", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "maxLength": 24}}, "required": ["path"]}}}]


@dataclass
class SoakResult:
    duration_s: float = 0.0
    num_requests: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)  # completed | abandoned | error
    errors_by_status: dict[str, int] = field(default_factory=dict)  # "429", "transport", ...
    num_conversations: int = 0
    num_conversations_completed: int = 0
    num_conversations_errored: int = 0
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    latency_max_s: float | None = None
    rss_start_bytes: int | None = None
    rss_samples_mib: list[float] = field(default_factory=list)  # every --sample-s during the run
    rss_end_bytes: int | None = None
    kv_blocks_used_start: int | None = None
    kv_blocks_used_end: int | None = None
    kv_blocks_total: int | None = None
    requests_running_end: int | None = None


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process, from /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Stats:
    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.latencies_s: list[float] = []
        self.conversations: Counter[str] = Counter()


async def _turn(client: httpx.AsyncClient, stats: _Stats, rng: random.Random, messages: list[dict[str, Any]],
                session_id: str | None, mode: str, api_key: str) -> tuple[str, str]:
    """One chat turn: (outcome, assistant text). Outcome: completed | abandoned | an error status."""
    body: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": rng.randint(8, 40),
                            "temperature": rng.choice([0.0, 0.8]), "seed": rng.randint(0, 1 << 30),
                            "expected_wait_s": round(rng.uniform(0.05, 2.0), 2)}
    if rng.random() < 0.3:
        body["tools"] = TOOLS
    headers = {"Authorization": f"Bearer {api_key}"}
    if session_id is not None:
        headers["X-Session-ID"] = session_id
    url = "/v1/chat/completions"
    t0 = time.monotonic()
    try:
        if mode == "abandon-blocking":
            try:
                r = await client.post(url, json={**body, "max_tokens": 200, "ignore_eos": True}, headers=headers,
                                      timeout=rng.uniform(0.02, 0.2))
            except httpx.TimeoutException:
                return "abandoned", ""
            return ("completed", "") if r.status_code == 200 else (str(r.status_code), "")
        if mode == "blocking":
            r = await client.post(url, json=body, headers=headers)
            if r.status_code != 200:
                return str(r.status_code), ""
            stats.latencies_s.append(time.monotonic() - t0)
            return "completed", r.json()["choices"][0]["message"]["content"] or ""
        text: list[str] = []
        async with client.stream("POST", url, json={**body, "stream": True}, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return str(r.status_code), ""
            num_events, stop_after = 0, rng.randint(1, 4)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:  # an error found once the stream had started (e.g. a busy session)
                    err = event["error"]
                    return ("409" if err.get("code") == "session_busy" else f"stream:{err.get('type')}"), ""
                num_events += 1
                if mode == "abandon-stream" and num_events >= stop_after:
                    return "abandoned", ""  # leaving the block closes the connection
                text += [c["delta"].get("content") or "" for c in event.get("choices", [])]
        stats.latencies_s.append(time.monotonic() - t0)
        return "completed", "".join(text)
    except httpx.HTTPError as exc:
        return f"transport:{type(exc).__name__}", ""


async def _agent(url: str, agent: int, deadline: float, stats: _Stats, seed: int, api_key: str) -> None:
    rng = random.Random(seed * 1000 + agent)
    conv = 0
    auth = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while time.monotonic() < deadline:
            conv += 1
            stats.conversations["started"] += 1
            sid = f"soak-{agent}-{conv}" if rng.random() < 0.6 else None  # else an implicit session
            words = " ".join(rng.choice(["fix", "test", "read", "the", "bug", "file"]) for _ in range(20))
            messages: list[dict[str, Any]] = [{"role": "system", "content": f"You are agent {agent}."},
                                              {"role": "user", "content": f"task {conv}: {words}"}]
            ok = True
            for _ in range(rng.randint(2, 5)):
                mode = rng.choices(["blocking", "stream", "abandon-stream", "abandon-blocking"], [5, 4, 1, 1])[0]
                for _ in range(40):
                    outcome, reply = await _turn(client, stats, rng, messages, sid, mode, api_key)
                    if outcome != "409":
                        break
                    # The abandoned previous turn's abort may still be landing: a client retries.
                    stats.outcomes["retried-409"] += 1
                    await asyncio.sleep(0.05)
                if outcome in ("completed", "abandoned"):
                    stats.outcomes[outcome] += 1
                else:
                    stats.outcomes["error"] += 1
                    stats.errors[outcome] += 1
                    ok = False
                    break
                messages += [{"role": "assistant", "content": reply},
                             {"role": "user", "content": f"tool output: {rng.randint(0, 10**6)} tests passed"}]
                await asyncio.sleep(rng.uniform(0.0, 0.4))  # the tool runs
                if time.monotonic() > deadline:
                    break
            stats.conversations["completed" if ok else "errored"] += 1
            if sid is not None:
                r = await client.delete(f"/v1/sessions/{sid}", headers=auth)
                if r.status_code != 200:
                    stats.errors[f"delete:{r.status_code}"] += 1


def run_soak(url: str, duration_s: float, num_agents: int = 6, seed: int = 0,
             api_key: str = KEY) -> tuple[_Stats, float]:
    """Drive `num_agents` agents against `url` for `duration_s`; return the tallies and the time taken."""
    async def main() -> None:
        deadline = time.monotonic() + duration_s
        await asyncio.gather(*[_agent(url, a, deadline, stats, seed, api_key) for a in range(num_agents)])

    stats = _Stats()
    t0 = time.monotonic()
    asyncio.run(main())
    return stats, time.monotonic() - t0


def summarize(stats: _Stats, elapsed_s: float) -> SoakResult:
    return SoakResult(
        duration_s=round(elapsed_s, 1), num_requests=sum(v for k, v in stats.outcomes.items() if k != "retried-409"),
        outcomes=dict(stats.outcomes), errors_by_status=dict(stats.errors),
        num_conversations=stats.conversations["started"],
        num_conversations_completed=stats.conversations["completed"],
        num_conversations_errored=stats.conversations["errored"],
        latency_p50_s=percentile(stats.latencies_s, 0.50), latency_p99_s=percentile(stats.latencies_s, 0.99),
        latency_max_s=max(stats.latencies_s, default=None))


# -- the in-process server ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_call(app: Any, fn: Any) -> Any:
    """Run fn(engine) in the engine thread between steps and return its result."""
    import concurrent.futures

    fut: concurrent.futures.Future = concurrent.futures.Future()
    app.state.ss.bridge._commands.put(lambda: fut.set_result(fn(app.state.ss.engine)))
    return fut.result(timeout=60)


def settle_and_close(app: Any, timeout_s: float = 30.0) -> dict[str, int]:
    """Wait for the engine to be idle, close every session, return the KV state (blocks used, running)."""
    ss = app.state.ss
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = _engine_call(app, lambda e: e.has_unfinished() or e.sessions.num_moves_pending > 0)
        if not busy and ss.bridge.num_in_flight == 0:
            break
        time.sleep(0.05)
    _engine_call(app, lambda e: [e.close_session(s.session_id) for s in list(e.sessions)])
    return _engine_call(app, lambda e: {"used": e.kv.pool.num_used_blocks, "total": e.kv.pool.num_blocks,
                                        "running": e.core.scheduler.num_unfinished,
                                        "tables": len(e.kv.block_tables)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=1800.0)
    parser.add_argument("--agents", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="model folder (default: the generated tiny llama)")
    parser.add_argument("--model-size", default="tiny", choices=("tiny", "small"))
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--residency-policy", default="predictive")
    parser.add_argument("--host-kv-bytes", type=int, default=32 << 20)
    parser.add_argument("--disk-kv-bytes", type=int, default=32 << 20)
    parser.add_argument("--warmup-s", type=float, default=5.0, help="load before RSS and KV are first sampled")
    parser.add_argument("--sample-s", type=float, default=10.0, help="RSS sampling period")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT / "src"))
    import tempfile

    import uvicorn

    from sessionserve import LLMEngine
    from sessionserve.config import Config
    from sessionserve.modelgen import make_model as mm
    from sessionserve.server.app import create_app
    from sessionserve.server.auth import Auth

    model = args.model or str(mm.ensure_model("llama", args.model_size, ROOT / "bench" / "out" / "models"))
    config = Config.from_kwargs(num_blocks=args.num_blocks, block_size=16, max_num_seqs=16,
                                residency_policy=args.residency_policy, host_kv_bytes=args.host_kv_bytes,
                                disk_kv_bytes=args.disk_kv_bytes, spool_dir=tempfile.mkdtemp(prefix="soak-spool-"))
    app = create_app(LLMEngine(config, model), model_name="tiny", auth=Auth({KEY: "soak"}))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    while not server.started:
        time.sleep(0.05)
    try:
        run_soak(url, min(args.warmup_s, args.duration_s), args.agents, seed=args.seed + 1)
        kv_start = settle_and_close(app)
        rss_start = rss_bytes()
        samples: list[float] = []
        done = threading.Event()

        def sample() -> None:
            while not done.wait(args.sample_s):
                samples.append(round(rss_bytes() / (1 << 20), 1))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        stats, elapsed_s = run_soak(url, args.duration_s, args.agents, seed=args.seed)
        done.set()
        kv_end = settle_and_close(app)
        rss_end = rss_bytes()
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    result = summarize(stats, elapsed_s)
    result.rss_start_bytes, result.rss_end_bytes, result.rss_samples_mib = rss_start, rss_end, samples
    result.kv_blocks_used_start, result.kv_blocks_used_end = kv_start["used"], kv_end["used"]
    result.kv_blocks_total, result.requests_running_end = kv_end["total"], kv_end["running"]
    report = json.dumps(asdict(result), indent=2)
    print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report + "\n")
    failed = result.errors_by_status and any(k.startswith(("5", "transport")) for k in result.errors_by_status)
    sys.exit(1 if failed or kv_end["used"] or kv_end["running"] else 0)


if __name__ == "__main__":
    main()
