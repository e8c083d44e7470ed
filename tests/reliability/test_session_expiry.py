"""A session whose tool never returns: after the idle TTL it expires and frees its KV in every tier.

Three agents each get a reply that ends in a tool call (the session parks,
waiting on the tool for "an hour"). One session's KV stays on the device, one
moves to host memory, one to the spool on disk. Nobody comes back: once the
TTL passes, with no request arriving, every session is gone and every block
in every tier is free, the spool file included.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from sessionserve.core.residency import ActionKind, ResidencyAction
from sessionserve.core.session import Residency
from sessionserve.types.kv_mover import Tier
from tests.reliability.conftest import ALICE, assert_all_free, chat, kv_state, live_server, wait_until
from tests.server.conftest import LiveServer
from tests.server.test_openai_api import TOOLS

TTL_S = 1.0


def _park_on_a_tool(server: LiveServer, sid: str) -> None:
    r = chat(server, [{"role": "user", "content": f"{sid}: find the config parser"}], session_id=sid, tools=TOOLS,
             tool_choice={"type": "function", "function": {"name": "search_code"}}, max_tokens=60,
             expected_wait_s=3600.0)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls", r.text
    info = httpx.get(f"{server.url}/v1/sessions/{sid}", headers=ALICE).json()
    assert info["state"] == "parked" and info["waiting_tools"] == ["search_code"], info


def _move(server: LiveServer, sid: str, tier: Tier) -> None:
    key = f"alice/{sid}"
    server.call(lambda e: e.sessions.apply(ResidencyAction(ActionKind.OFFLOAD, key, tier), time.monotonic()))
    want = Residency.HOST if tier is Tier.HOST else Residency.DISK
    wait_until(lambda: server.call(lambda e: e.get_session(key).residency) is want, 10, f"{sid} on {tier.value}")


def test_parked_sessions_expire_and_free_every_tier(tiny_llama: Path, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    with live_server(tiny_llama, spool, residency_policy="keep") as server:
        for sid in ("on-device", "on-host", "on-disk"):
            _park_on_a_tool(server, sid)
        _move(server, "on-host", Tier.HOST)
        _move(server, "on-disk", Tier.DISK)
        held = server.call(kv_state)
        assert held["device_free"] < held["device_total"] and held["host_free"] < held["host_total"], held
        assert held["disk_files"] == 1 and len(list(spool.glob("*.kv"))) == 1, held

        server.call(lambda e: setattr(e.sessions, "idle_ttl_s", TTL_S))
        t0 = time.monotonic()
        # No request arrives: the engine's idle tick alone must expire them.
        wait_until(lambda: server.call(lambda e: e.sessions.num_expired) == 3, 10, "three sessions expired")
        assert time.monotonic() - t0 < TTL_S + 5
        for sid in ("on-device", "on-host", "on-disk"):
            assert httpx.get(f"{server.url}/v1/sessions/{sid}", headers=ALICE).status_code == 404
        assert_all_free(server, spool)

        # The id is free again: a new conversation under it starts from scratch.
        r = chat(server, [{"role": "user", "content": "start over"}], session_id="on-disk", max_tokens=3)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
