"""A live sessionserve server on 127.0.0.1 with a tiny model, shared by the server tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from sessionserve import LLMEngine
from sessionserve.config import Config
from sessionserve.server.app import create_app
from sessionserve.server.auth import Auth

KEYS = {"key-alice": "alice", "key-bob": "bob"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, is_alive: Callable[[], bool] = lambda: True, timeout_s: float = 120.0) -> None:
    """Poll GET /health until it answers 200; raise if `is_alive()` turns false or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not is_alive():
            raise RuntimeError("server exited before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError("server did not start")


@contextmanager
def run_app(app: object) -> Iterator[str]:
    """Serve `app` with uvicorn on a free loopback port in a thread; yield its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, thread.is_alive)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@dataclass
class LiveServer:
    url: str
    engine: LLMEngine
    app: object

    def call(self, fn):  # noqa: ANN001, ANN201 - run fn(engine) in the engine thread, wait for it
        import asyncio

        return asyncio.run(self._call(fn))

    async def _call(self, fn):  # noqa: ANN001, ANN202
        import asyncio
        import concurrent.futures

        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.app.state.ss.bridge._commands.put(lambda: fut.set_result(fn(self.engine)))
        return await asyncio.wrap_future(fut)


@pytest.fixture(scope="package")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    config = Config.from_kwargs(num_blocks=256, block_size=16, max_num_seqs=16, residency_policy="predictive",
                                host_kv_bytes=64 << 20, disk_kv_bytes=64 << 20,
                                spool_dir=str(tmp_path_factory.mktemp("spool")))
    engine = LLMEngine(config, tiny_llama)
    app = create_app(engine, model_name="tiny", auth=Auth(KEYS), max_sessions_per_tenant=50)
    with run_app(app) as url:
        yield LiveServer(url, engine, app)
