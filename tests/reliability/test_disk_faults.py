"""The disk tier failing under live sessions: unwritable spool, full disk, corrupt spool file.

Each time the session's next turn must give exactly the output of a session
that never moved (another tenant, so the prefix cache cannot help it): an
offload that cannot be written keeps the KV on the device (counted as a
failed offload), a full disk is never written, a corrupt file is recomputed
(counted as a corrupt restore; the prefix cache may still hold part of it).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from sessionserve.core.residency import ActionKind, ResidencyAction
from sessionserve.core.session import Residency
from sessionserve.types.kv_mover import Tier
from tests.reliability.conftest import ALICE, BOB, assert_all_free, chat, close_all_sessions, live_server, wait_until
from tests.server.conftest import LiveServer

FIRST = [{"role": "system", "content": "You are a coding agent."},
         {"role": "user", "content": "read the failing test and explain it " * 3}]


def _turns(server: LiveServer, sid: str, headers: dict[str, str], between=None) -> list[str]:
    """Two turns of one conversation; `between(sid)` runs while the session is parked."""
    r1 = chat(server, FIRST, session_id=sid, headers=headers, max_tokens=12, ignore_eos=True)
    assert r1.status_code == 200, r1.text
    if between is not None:
        between(sid)
    msgs = FIRST + [{"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "now fix it"}]
    r2 = chat(server, msgs, session_id=sid, headers=headers, max_tokens=12, ignore_eos=True)
    assert r2.status_code == 200, r2.text
    return [r1.json()["choices"][0]["message"]["content"], r2.json()["choices"][0]["message"]["content"]]


def _offload(server: LiveServer, sid: str) -> None:
    key = f"alice/{sid}"
    server.call(lambda e: e.sessions.apply(ResidencyAction(ActionKind.OFFLOAD, key, Tier.DISK), time.monotonic()))


def _residency(server: LiveServer, sid: str) -> Residency:
    return server.call(lambda e: e.get_session(f"alice/{sid}").residency)


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    spool = tmp_path_factory.mktemp("faults") / "spool"
    with live_server(tiny_llama, spool, host_kv_bytes=0, disk_kv_bytes=16 << 20, residency_policy="keep") as s:
        s.spool = spool  # type: ignore[attr-defined]
        yield s


@pytest.fixture(scope="module")
def reference(server: LiveServer) -> list[str]:
    return _turns(server, "reference", BOB)


def test_unwritable_spool_keeps_the_kv_on_device(server: LiveServer, reference: list[str]) -> None:
    spool: Path = server.spool  # type: ignore[attr-defined]
    aside = spool.with_name("spool-aside")

    def break_disk_and_offload(sid: str) -> None:
        spool.rename(aside)
        spool.write_text("not a directory")  # every write into the spool now fails (ENOTDIR, even as root)
        _offload(server, sid)
        wait_until(lambda: server.call(lambda e: e.sessions.num_failed_offloads) == 1, 10, "the offload failed")
        assert _residency(server, sid) is Residency.DEVICE  # kept, not lost
        spool.unlink()
        aside.rename(spool)

    assert _turns(server, "unwritable", ALICE, break_disk_and_offload) == reference
    assert server.call(lambda e: e.mover.stats.num_failures) == {"offload:disk": 1}
    info = httpx.get(server.url + "/v1/sessions/unwritable", headers=ALICE).json()
    assert info["stats"]["num_recompute_tokens"] == 0 and info["stats"]["num_offloaded_bytes"] == 0, info


def test_full_disk_is_never_written(server: LiveServer, reference: list[str]) -> None:
    def fill_disk_and_offload(sid: str) -> None:
        disk = server.engine.mover.disk
        budget = disk.budget_bytes
        disk.budget_bytes = disk.used_bytes  # no room left
        try:
            _offload(server, sid)
            assert _residency(server, sid) is Residency.DEVICE
            assert server.call(lambda e: e.mover.num_free_blocks(Tier.DISK)) == 0
        finally:
            disk.budget_bytes = budget

    assert _turns(server, "full", ALICE, fill_disk_and_offload) == reference
    assert not list(server.spool.glob("*.kv*"))  # type: ignore[attr-defined]


def test_corrupt_spool_file_is_recomputed(server: LiveServer, reference: list[str]) -> None:
    spool: Path = server.spool  # type: ignore[attr-defined]
    before = server.call(lambda e: e.sessions.num_corrupt_restores)

    def offload_and_corrupt(sid: str) -> None:
        _offload(server, sid)
        wait_until(lambda: _residency(server, sid) is Residency.DISK, 10, "session on disk")
        (path,) = spool.glob("*.kv")
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))

    assert _turns(server, "corrupt", ALICE, offload_and_corrupt) == reference
    assert server.call(lambda e: e.sessions.num_corrupt_restores) == before + 1
    # The bad copy is gone and never read into the session (its KV came from the tokens again).
    assert not list(spool.glob("*.kv*"))
    info = httpx.get(server.url + "/v1/sessions/corrupt", headers=ALICE).json()
    assert info["stats"]["num_restored_bytes"] == 0 and info["residency"] == "device", info


def test_everything_free_after_the_faults(server: LiveServer) -> None:
    wait_until(lambda: not server.call(lambda e: e.has_unfinished() or e.sessions.num_moves_pending), 10, "idle")
    close_all_sessions(server)
    assert_all_free(server, server.spool)  # type: ignore[attr-defined]
