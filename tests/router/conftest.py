"""Router test fixtures: a real redis-server (from `.ci/with-redis`, or started here), never a mock."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

from tests.server.conftest import free_port


def _ping(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a live Redis: $SESSIONSERVE_TEST_REDIS_URL (set by `make test`), else a redis-server we start."""
    pytest.importorskip("redis")
    url = os.environ.get("SESSIONSERVE_TEST_REDIS_URL")
    if url:
        if not _ping(url):
            pytest.fail(f"SESSIONSERVE_TEST_REDIS_URL={url} does not answer")
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (make test installs it on Debian)")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="redis-test-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while not _ping(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.skip("redis-server could not be started")
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)
