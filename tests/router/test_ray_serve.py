"""Two engine replicas on a local Ray cluster (tiny model): affinity, prefix routing, failover, drain.

One Ray cluster and one Serve instance for the module; two apps on it: ours
(`SessionKVRouter`) at /ours and Ray Serve's default power-of-two router at
/base, each with 2 replicas and its own SQLite session store.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from sessionserve.router.ray_app import ServeOptions, build_app  # noqa: E402
from sessionserve.router.store import SQLiteStore  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402

ENGINE = dict(num_blocks=256, block_size=16, max_num_seqs=8, num_threads=1, host_kv_bytes=0, disk_kv_bytes=0)


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


def _wait_ready(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready")


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("ray")
    ray.init(num_cpus=2, object_store_memory=150 << 20, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        apps = {}
        for name, router in (("ours", "session_kv"), ("base", "pow2")):
            db = tmp / f"{name}.db"
            opts = ServeOptions(num_replicas=2, model=str(tiny_llama), model_name="tiny", engine_kwargs=ENGINE,
                                store_url=f"sqlite://{db}", router=router, replica_num_cpus=0,
                                routing_stats_period_s=0.2)
            serve.run(build_app(opts), name=name, route_prefix=f"/{name}", blocking=False)
            apps[name] = App(f"http://127.0.0.1:{port}/{name}", SQLiteStore(db), name)
        for a in apps.values():
            _wait_ready(a.url)
        yield Cluster(apps["ours"], apps["base"])
    finally:
        serve.shutdown()
        ray.shutdown()


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
