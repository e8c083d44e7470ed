"""The real Codex CLI and Claude Code against `sessionserve serve`, end to end (R17).

bench/agent_clis.py's functions: one server on a free loopback port with the
long-context embedded model, each CLI run twice in one session (`codex exec`
then `exec resume --last`; `claude -p` then `-p --continue`). Each invocation
must exit 0 with no 4xx/5xx in the server log, and the client's second model
request (the resent conversation) must find at least 90% of its prompt in the
KV cache. A CLI that is not on PATH is skipped.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _agent_clis() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_agent_clis", ROOT / "bench" / "agent_clis.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def agent_clis() -> ModuleType:
    return _agent_clis()


@pytest.fixture(scope="module")
def server(agent_clis: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    """(base URL, server log, folder for the CLIs' outputs)."""
    out = tmp_path_factory.mktemp("agent-clis")
    log = out / "server.log"
    with agent_clis.serve(agent_clis.ensure_model(), log) as url:
        yield url, log, out


def _installed(client: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(shutil.which(client) is None, reason=f"`{client}` is not on PATH")


@pytest.mark.parametrize("client", [pytest.param(c, marks=_installed(c)) for c in ("codex", "claude")])
def test_cli_finishes_and_its_second_request_is_cached(client: str, agent_clis: ModuleType,
                                                       server: tuple[str, Path, Path]) -> None:
    url, log, out = server
    run = agent_clis.RUNNERS[client](url, log, out)
    table = agent_clis.format_table([run])
    assert [inv.exit_code for inv in run.invocations] == [0, 0], f"{table}\nCLI output in {out}"
    assert len(run.requests) >= 2, table
    assert run.requests[1].cached_fraction >= agent_clis.MIN_CACHED_FRACTION, table
    assert run.problems() == [], table
