"""Fixtures for the agent runtime: a plain OpenAI-compatible fake endpoint, and our live server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi import FastAPI

from sessionserve.agent.fake_endpoint import FakeModelConfig, make_app, serve
from tests.server.conftest import LiveServer, server  # noqa: F401 - the live sessionserve fixture, reused


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[str, FastAPI]]:
    """(base URL, app) of a strict plain endpoint: unknown body fields get a 400, as from OpenAI."""
    app = make_app(FakeModelConfig(is_strict=True))
    with serve(app) as url:
        yield url, app


__all__ = ["LiveServer", "fake", "server"]
