"""Two engine replicas on a local Ray cluster (tiny model): affinity, prefix routing, failover, drain.

One Ray cluster and one Serve instance for the module; two apps on it: ours
(`SessionKVRouter`) at /ours and Ray Serve's default power-of-two router at
/base, each with 2 replicas and its own SQLite session store.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from sessionserve.router.ray_app import ServeOptions, build_app
from sessionserve.router.replica import STALE_SWEEP_PERIOD_S
from sessionserve.router.store import SQLiteStore
from tests.server.conftest import free_port, wait_healthy

ENGINE = {"num_blocks": 256, "block_size": 16, "max_num_seqs": 8, "num_threads": 1, "host_kv_bytes": 0, "disk_kv_bytes": 0}


@dataclass
class App:
    url: str
    store: SQLiteStore
    name: str

    def chat(self, messages: list[dict], session: str | None = None, max_tokens: int = 12) -> dict:
        headers = {"x-session-id": session} if session else {}
        r = httpx.post(f"{self.url}/v1/chat/completions", headers=headers, timeout=120,
                       json={"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/router/stats", timeout=30).json()


@dataclass
class Cluster:
    ours: App
    base: App


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("ray")
    ray.init(num_cpus=2, object_store_memory=150 << 20, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        apps, targets = {}, []
        for name, router in (("ours", "session_kv"), ("base", "pow2")):
            db = tmp / f"{name}.db"
            opts = ServeOptions(num_replicas=2, model=str(tiny_llama), model_name="tiny", engine_kwargs=ENGINE,
                                store_url=f"sqlite://{db}", router=router, replica_num_cpus=0,
                                routing_stats_period_s=0.2)
            targets.append(serve.RunTarget(build_app(opts), name=name, route_prefix=f"/{name}"))
            apps[name] = App(f"http://127.0.0.1:{port}/{name}", SQLiteStore(db), name)
        serve.run_many(targets)  # both apps start together
        for a in apps.values():
            wait_healthy(a.url)
        yield Cluster(apps["ours"], apps["base"])
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def kv_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A KV store folder for the tests that redeploy /ours with one (all of its replicas share it)."""
    return tmp_path_factory.mktemp("kv-store")


def _turn(history: list[dict], reply: dict, user: str) -> list[dict]:
    return history + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                      {"role": "user", "content": user}]


def test_affinity_holds_across_steps(cluster: Cluster) -> None:
    app = cluster.ours
    owners: dict[str, set[str]] = {}
    cached: list[int] = []
    sessions = {f"aff-{i}": [{"role": "user", "content": f"Session {i}: list three facts about rivers."}]
                for i in range(4)}
    for step in range(3):
        for sid, history in sessions.items():
            reply = app.chat(history, session=sid)
            if step:
                cached.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
            rec = app.store.get(f"default/{sid}")
            assert rec.version == step + 1  # one committed turn per step, none lost or doubled
            owners.setdefault(sid, set()).add(rec.owner)
            sessions[sid] = _turn(history, reply, f"Step {step + 1}: and one more?")
    assert all(len(o) == 1 for o in owners.values()), owners
    assert len({next(iter(o)) for o in owners.values()}) == 2  # new sessions spread over both replicas
    assert min(cached) > 0  # every later step found its history's KV where it went
    router = app.stats()["router"]
    assert router["affinity_hit_rate"] == 1.0 and router["num_session_requests"] == 12
    # Each replica reports the time its engine stepped (wall and CPU), within its process's CPU time.
    deadline = time.monotonic() + 10
    live = app.stats()["replicas"]
    while not all((r.get("engine_cpu_s") or 0) > 0 for r in live.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        live = app.stats()["replicas"]
    assert all(0 < r["engine_cpu_s"] <= r["process_cpu_s"] and r["engine_busy_s"] > 0 for r in live.values()), live


RUN_TOOL = {"name": "run", "description": "Run a command", "input_schema": {
    "type": "object", "properties": {"cmd": {"type": "string", "enum": ["ls", "pwd"]}}, "required": ["cmd"]}}


def test_responses_and_messages_keep_their_sessions_on_one_replica(cluster: Cluster) -> None:
    """Responses chained by previous_response_id and Claude Code sessions (its session header) continue on the
    replica holding their KV: each turn reuses the whole previous prompt and reply."""
    app = cluster.ours
    tools = [{"type": "function", "name": RUN_TOOL["name"], "description": RUN_TOOL["description"],
              "parameters": RUN_TOOL["input_schema"]}]
    for i in range(3):
        previous, items, last = None, f"Responses session {i}: check the build.", None
        for step in range(3):
            body = {"model": "tiny", "input": items, "tools": tools, "tool_choice": "required", "temperature": 0,
                    "max_output_tokens": 100, **({"previous_response_id": previous} if previous else {})}
            r = httpx.post(f"{app.url}/v1/responses", json=body, timeout=120)
            assert r.status_code == 200, r.text
            resp = r.json()
            if last is not None:
                assert resp["usage"]["input_tokens_details"]["cached_tokens"] == \
                    last["usage"]["input_tokens"] + last["usage"]["output_tokens"] - 1
            call = next(o for o in resp["output"] if o["type"] == "function_call")
            previous, last = resp["id"], resp
            items = [{"type": "function_call_output", "call_id": call["call_id"], "output": f"step {step}"}]
        msgs: list[dict] = [{"role": "user", "content": f"Messages session {i}: check the build."}]
        held = None
        for step in range(3):
            r = httpx.post(f"{app.url}/v1/messages", timeout=120,
                           headers={"x-claude-code-session-id": f"cc-ray-{i}", "anthropic-version": "2023-06-01"},
                           json={"model": "tiny", "max_tokens": 100, "messages": msgs, "tools": [RUN_TOOL],
                                 "tool_choice": {"type": "any"}, "temperature": 0})
            assert r.status_code == 200, r.text
            m = r.json()
            if held is not None:
                assert m["usage"]["cache_read_input_tokens"] == held - 1
            held = m["usage"]["input_tokens"] + m["usage"]["cache_read_input_tokens"] + m["usage"]["output_tokens"]
            use = next(b for b in m["content"] if b["type"] == "tool_use")
            msgs += [{"role": "assistant", "content": m["content"]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "ok"}]}]


def test_a_copy_left_behind_is_closed_when_the_session_is_deleted(cluster: Cluster) -> None:
    """A replica closes its parked copy of a session deleted through another replica; the copy of a session the
    store gives to another replica (as a rebalance or a failover does) is kept, and that session goes on."""
    app = cluster.ours
    moved, deleted = "default/stale-moved", "default/stale-deleted"
    history = {k: [{"role": "user", "content": f"{k}: name a river."}] for k in (moved, deleted)}
    replies = {k: app.chat(h, session=k.split("/")[1]) for k, h in history.items()}
    rec = app.store.get(moved)
    other = next(r for r in app.stats()["replicas"] if r != rec.owner)
    before = sum(r.get("num_stale_copies_closed", 0) for r in app.stats()["replicas"].values())
    assert app.store.put(replace(rec, owner=other)) is not None
    assert app.store.delete(deleted)
    deadline = time.monotonic() + 30
    closed = 0
    while time.monotonic() < deadline:
        closed = sum(r.get("num_stale_copies_closed", 0) for r in app.stats()["replicas"].values()) - before
        if closed:
            break
        time.sleep(0.5)
    time.sleep(STALE_SWEEP_PERIOD_S + 1)  # every replica has swept since both changes
    closed = sum(r.get("num_stale_copies_closed", 0) for r in app.stats()["replicas"].values()) - before
    assert closed == 1  # the deleted session's copy only
    reply = app.chat(_turn(history[moved], replies[moved], "And another?"), session="stale-moved")
    assert reply["choices"][0]["message"]["content"]
    assert app.store.get(moved).version == rec.version + 2  # the takeover, then the turn: none lost or doubled
    assert app.store.get(deleted) is None


def _prefix_workload(app: App, tag: str, num_groups: int = 8, per_group: int = 3) -> int:
    cached = 0
    for j in range(per_group):
        for g in range(num_groups):
            system = (f"[{tag} group {g}] You are a meticulous assistant for a logistics team. " * 6).strip()
            reply = app.chat([{"role": "system", "content": system},
                              {"role": "user", "content": f"Question {j} about shipment {g * 10 + j}."}], max_tokens=2)
            cached += reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def test_prefix_routing_beats_default_routing_on_cached_tokens(cluster: Cluster) -> None:
    ours = _prefix_workload(cluster.ours, "ours")
    base = _prefix_workload(cluster.base, "base")
    stats = cluster.ours.stats()["router"]
    # Ours sends every repeat of a system prompt where it is cached: 8 groups x 2 repeats hit.
    assert stats["decisions"].get("prefix", 0) >= 16
    assert ours > base, (ours, base)
    print(f"cached prompt tokens: session_kv router {ours}, Ray default router {base}")


def _wait_running(app_name: str, num: int, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dep = serve.status().applications[app_name].deployments["Engine"]
        if dep.replica_states.get("RUNNING", 0) == num and sum(dep.replica_states.values()) == num:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{app_name}: not {num} running replicas: {dep.replica_states}")


def _redeploy_ours(app: App, model: Path, kv_store: Path, num_replicas: int) -> None:
    """Roll /ours out again with `num_replicas` replicas sharing the KV store folder `kv_store`."""
    opts = ServeOptions(num_replicas=num_replicas, model=str(model), model_name="tiny",
                        engine_kwargs={**ENGINE, "kv_store_dir": str(kv_store)},
                        store_url=f"sqlite://{app.store.path}", router="session_kv", replica_num_cpus=0,
                        routing_stats_period_s=0.2)
    serve.run(build_app(opts), name="ours", route_prefix="/ours")
    _wait_running("ours", num_replicas)


def _wait_replaced(app: App, victim: str, timeout_s: float = 90) -> None:
    """Until Serve replaced the dead replica and the router hears from both."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        live = app.stats()["replicas"]
        if victim not in live and len(live) == 2:
            break
        time.sleep(0.2)
    _wait_running("ours", 2)


def _kill_replica(app_name: str, replica_id: str) -> None:
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{app_name}#Engine#{replica_id}", namespace="serve"), no_restart=True)


LONG_TURN = {"max_tokens": 900, "ignore_eos": True}  # long enough that the kill lands mid-turn


def test_killed_replica_loses_no_session_and_output_is_unchanged(cluster: Cluster, tiny_llama: Path,
                                                                 kv_store: Path) -> None:
    app = cluster.ours
    # The replicas share a KV store folder: whoever continues a session reads its history's KV from there.
    _redeploy_ours(app, tiny_llama, kv_store, 2)
    users = ["Plan a three-day trip to Lisbon.", "Now make it cheaper.", "Write the final itinerary."]

    def turn(history: list[dict], sid: str, last: bool) -> dict:
        r = httpx.post(f"{app.url}/v1/chat/completions", headers={"x-session-id": sid}, timeout=120,
                       json={"model": "tiny", "messages": history, "temperature": 0,
                             **(LONG_TURN if last else {"max_tokens": 12})})
        assert r.status_code == 200, r.text
        return r.json()

    ref_replies, history = [], []
    for i, u in enumerate(users):  # the uninterrupted session
        history = history + [{"role": "user", "content": u}]
        ref_replies.append(turn(history, "fo-ref", i == 2))
        history.append({"role": "assistant", "content": ref_replies[-1]["choices"][0]["message"]["content"]})
    reference = app.store.get("default/fo-ref")

    history = []
    for i, u in enumerate(users[:2]):
        history = history + [{"role": "user", "content": u}]
        reply = turn(history, "fo", False)
        assert reply["choices"] == ref_replies[i]["choices"]
        history.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    history.append({"role": "user", "content": users[2]})
    held = app.store.get("default/fo")  # two turns, on the replica about to die
    victim = held.owner
    # Kill the session's replica while its last turn is generating.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(turn, history, "fo", True)
        time.sleep(0.4)
        assert not pending.done(), "the turn finished before the kill; make it longer"
        _kill_replica("ours", victim)
        reply = pending.result(timeout=120)
    assert reply["choices"] == ref_replies[2]["choices"]  # greedy: the same tokens as without the failure
    rec = app.store.get("default/fo")
    assert rec.owner not in (None, victim)
    assert rec.version == 3  # three turns committed: none lost, none run twice
    assert rec.token_ids == reference.token_ids
    stats = app.stats()
    assert stats["router"]["num_failovers"] >= 1 and victim in stats["router"]["dead_replicas"]
    heir = stats["replicas"][rec.owner]
    assert heir["num_sessions_adopted"] >= 1
    # The history (two finished turns) came from the KV store: at most its last partial block was recomputed.
    assert heir["kv_store_num_blocks_loaded"] >= len(held.token_ids) // 16 > 0
    assert heir["num_tokens_recomputed"] < 16, heir
    _wait_replaced(app, victim)


def test_stream_cut_by_a_kill_continues_on_another_replica(cluster: Cluster) -> None:
    app = cluster.ours  # deployed by the test above, with the KV store folder
    history = [{"role": "user", "content": "Describe a lighthouse."}]
    reply = app.chat(history, session="st", max_tokens=12)
    history += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                {"role": "user", "content": "Now describe the keeper, at length."}]
    body = {"model": "tiny", "messages": history, "temperature": 0, **LONG_TURN}
    reference = httpx.post(f"{app.url}/v1/chat/completions", json=body, timeout=120).json()
    expected = reference["choices"][0]["message"]["content"]
    victim = app.store.get("default/st").owner
    resumed_before = app.stats()["ingress"]["num_streams_resumed"]
    text, ids, events = "", set(), []
    with httpx.stream("POST", f"{app.url}/v1/chat/completions", headers={"x-session-id": "st"},
                      json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            events.append(obj)
            ids.add(obj["id"])
            text += "".join(c["delta"].get("content") or "" for c in obj["choices"])
            if len(events) == 6:
                _kill_replica("ours", victim)  # the stream has begun: 5 chunks of output are out
    assert text == expected  # greedy: the rerun's tail continues the delivered head exactly
    assert len(ids) == 1 and sum(1 for e in events for c in e["choices"] if "role" in c["delta"]) == 1
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    stats = app.stats()
    assert stats["ingress"]["num_streams_resumed"] == resumed_before + 1
    rec = app.store.get("default/st")
    assert rec.owner not in (None, victim) and rec.version == 2  # the cut turn committed once, on the heir
    _wait_replaced(app, victim)


def test_scale_down_drains_sessions_to_the_remaining_replica(cluster: Cluster, tiny_llama: Path,
                                                            kv_store: Path) -> None:
    app = cluster.ours
    sessions = {}
    for i in range(4):
        sessions[f"dr-{i}"] = [{"role": "user", "content": f"Drain session {i}: summarise the news."}]
        reply = app.chat(sessions[f"dr-{i}"], session=f"dr-{i}")
        sessions[f"dr-{i}"].append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    old = set(app.stats()["replicas"])
    assert len(old) == 2 and all(app.store.owned_by(r) for r in old)
    # NOTE: `serve.run` from Python rolls out new replicas (Serve versions the code per run); each old one
    # stops gracefully, which is the path a scale-down takes too: in-flight requests finish, then `__del__`.
    _redeploy_ours(app, tiny_llama, kv_store, 1)
    for r in old:
        assert app.store.owned_by(r) == []  # each stopped replica handed its sessions back
    assert all(app.store.get(f"default/{sid}").owner is None for sid in sessions)
    owners, num_history = set(), 0
    for sid, history in sessions.items():
        before = app.store.get(f"default/{sid}").version
        num_history += len(app.store.get(f"default/{sid}").token_ids)
        reply = app.chat(history + [{"role": "user", "content": "More."}],
                         session=sid)
        assert reply["choices"][0]["message"]["content"] is not None
        rec = app.store.get(f"default/{sid}")
        assert rec.version == before + 1
        owners.add(rec.owner)
    assert len(owners) == 1 and not owners & old
    stats = app.stats()
    assert stats["router"]["num_migrations"] == len(sessions)
    # The stopped replicas' sessions moved through the KV store folder: what is redone is the last partial block
    # and the reply's end, which the chat template renders differently from the generated ids.
    heir_id, deadline = owners.pop(), time.monotonic() + 10
    while (heir := app.stats()["replicas"][heir_id])["num_turns"] < len(sessions) and time.monotonic() < deadline:
        time.sleep(0.2)  # replicas report their counters every 0.2 s
    assert heir["num_sessions_adopted"] == len(sessions) and heir["kv_store_num_blocks_loaded"] > 0
    assert heir["num_tokens_recomputed"] < num_history / 2, (heir, num_history)
