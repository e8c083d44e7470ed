"""Helpers for the reliability tests: live servers with chosen engine options, and the checks that
the engine is back to rest (no request running, every KV block free in every tier)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from sessionserve import LLMEngine
from sessionserve.config import Config
from sessionserve.server.app import create_app
from sessionserve.server.auth import Auth
from tests.server.conftest import KEYS, LiveServer, run_app

ALICE = {"Authorization": "Bearer key-alice"}
BOB = {"Authorization": "Bearer key-bob"}


@contextmanager
def live_server(model_dir: Path, spool_dir: Path, app_options: dict[str, Any] | None = None,
                **engine_options: Any) -> Iterator[LiveServer]:
    """A server on a free loopback port over a tiny-model engine; `engine_options` override the defaults."""
    options: dict[str, Any] = {"num_blocks": 128, "block_size": 16, "max_num_seqs": 16, "residency_policy": "keep",
                               "host_kv_bytes": 16 << 20, "disk_kv_bytes": 16 << 20, "spool_dir": str(spool_dir)}
    options.update(engine_options)
    engine = LLMEngine(Config.from_kwargs(**options), model_dir)
    app = create_app(engine, model_name="tiny", auth=Auth(KEYS), **(app_options or {}))
    with run_app(app) as url:
        yield LiveServer(url, engine, app)


def chat(server: LiveServer, messages: list[dict[str, Any]], *, headers: dict[str, str] | None = None,
         session_id: str | None = None, timeout_s: float = 120.0, **body: Any) -> httpx.Response:
    """POST /v1/chat/completions (greedy unless `body` says otherwise)."""
    hdrs = {**ALICE, **(headers or {})}
    if session_id is not None:
        hdrs["X-Session-ID"] = session_id
    payload = {"model": "tiny", "messages": messages, "temperature": 0, **body}
    return httpx.post(server.url + "/v1/chat/completions", json=payload, headers=hdrs, timeout=timeout_s)


def sse_events(lines: list[str]) -> list[dict[str, Any]]:
    """The JSON events of an SSE body's `data:` lines (without the final [DONE])."""
    return [json.loads(ln[len("data: "):]) for ln in lines if ln.startswith("data: ") and ln != "data: [DONE]"]


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for: {what}")
        time.sleep(0.02)


def is_idle(server: LiveServer) -> bool:
    """No request in the engine, none in flight in the server, no KV move under way."""
    ss = server.app.state.ss
    busy = server.call(lambda e: e.has_unfinished() or e.sessions.num_moves_pending > 0
                       or e.sessions.num_blocked > 0)
    return not busy and ss.bridge.num_in_flight == 0 and not ss.in_flight


def wait_idle(server: LiveServer, timeout_s: float = 30.0) -> None:
    wait_until(lambda: is_idle(server), timeout_s, "no request running and no KV move pending")


def close_all_sessions(server: LiveServer) -> int:
    return sum(server.call(lambda e: [e.close_session(s.session_id) for s in list(e.sessions)]))


def kv_state(eng: LLMEngine) -> dict[str, int]:
    """Free and total blocks of each tier, and the disk tier's bytes and files (engine thread)."""
    state = {"device_free": eng.kv.num_free_blocks, "device_total": eng.kv.pool.num_blocks,
             "block_tables": len(eng.kv.block_tables), "stored_copies": 0}
    mover = eng.mover
    if mover is not None:
        state["stored_copies"] = mover.num_stored
        if mover.host is not None:
            state["host_free"], state["host_total"] = mover.host.num_free_blocks, mover.host.num_blocks
        if mover.disk is not None:
            state["disk_bytes"], state["disk_files"] = mover.disk.used_bytes, mover.disk.num_files
    return state


def assert_all_free(server: LiveServer, spool_dir: Path | None = None) -> None:
    """Every KV block is free in every tier, the pools are consistent, and the spool holds no file."""
    def check(e: LLMEngine) -> dict[str, int]:
        e.kv.check_integrity()
        if e.mover is not None and e.mover.host is not None:
            e.mover.host.check_integrity()
        return kv_state(e)

    state = server.call(check)
    assert state["device_free"] == state["device_total"], state
    assert state["block_tables"] == 0 and state["stored_copies"] == 0, state
    assert state.get("host_free") == state.get("host_total"), state
    assert state.get("disk_bytes", 0) == 0 and state.get("disk_files", 0) == 0, state
    if spool_dir is not None and spool_dir.is_dir():
        assert not list(spool_dir.iterdir()), list(spool_dir.iterdir())


def bench_module(name: str):  # noqa: ANN201 - a module
    """bench/<name>.py loaded as a module (bench/ is scripts, not a package)."""
    path = Path(__file__).resolve().parents[2] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module
