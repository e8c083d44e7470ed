"""The simulated fleet: replicas on their own clocks behind our router or power of two choices."""

from __future__ import annotations

import pytest

from sessionserve.config import Config
from sessionserve.sim.derived import builtin_profile
from sessionserve.sim.engine import SimEngine
from sessionserve.planning.fleet import make_router, simulate_fleet
from sessionserve.workload.metrics import summarize
from sessionserve.workload.replay import LoadSpec
from sessionserve.workload.trace import AgentSession, Step, ToolCall

PROFILE = builtin_profile("h100-llama3-8b")


def sessions(num: int = 16, steps: int = 5) -> list[AgentSession]:
    """Agents with a shared 2k-token head (tool definitions) and growing private contexts."""
    def one(i: int) -> AgentSession:
        body = [Step(3000 if k == 0 else 400 + 20 * i, 60, (ToolCall("Bash", 2.0 + (i + k) % 3),), "tool",
                     (0,) if k == 0 else (), 2048 if k == 0 else 0) for k in range(steps - 1)]
        return AgentSession(f"s{i}", (*body, Step(200, 30, (), "end")))

    return [one(i) for i in range(num)]


def fleet(n: int, **kw: int) -> list[SimEngine]:
    opts = {"kv_cache_bytes": 2 << 30, "host_kv_bytes": 16 << 30, "max_num_seqs": 64, **kw}
    return [SimEngine(Config.from_kwargs(**opts), PROFILE) for _ in range(n)]


def run(n: int, router: str, seed: int = 0, agents: int = 12):
    engines = fleet(n)
    result = simulate_fleet(engines, sessions(), LoadSpec("closed", agents), router, seed=seed)
    for eng in engines:  # every session closed everywhere: nothing held, nothing leaked
        eng.kv.check_integrity()
        assert eng.kv.pool.num_used_blocks == 0 and not eng.sessions.sessions
    return result, summarize(result)


def test_deterministic_and_every_session_completes() -> None:
    a, sa = run(2, "p2c", seed=5)
    b, sb = run(2, "p2c", seed=5)
    assert sa == sb and [s.end_s for s in a.sessions] == [s.end_s for s in b.sessions]
    assert sa["num_completed"] == 16 and sa["num_steps"] == 16 * 5
    # A closed-loop session's JCT is its waits plus its steps.
    assert all(s.jct_s >= s.total_wait_s for s in a.sessions)


def test_one_replica_is_the_same_for_either_router() -> None:
    (a, sa), (b, sb) = run(1, "p2c"), run(1, "session")
    assert sa == sb and a.extra["moves"] == b.extra["moves"] == 0
    assert a.extra["history_tokens_resent"] == 0  # every later step finds its session and sends its new tokens


def test_our_router_keeps_sessions_home_and_caches_more_than_power_of_two() -> None:
    (p, sp), (o, so) = run(2, "p2c"), run(2, "session")
    assert o.extra["moves"] < p.extra["moves"] and o.extra["history_tokens_resent"] < p.extra["history_tokens_resent"]
    assert so["cached_fraction"] > sp["cached_fraction"]
    # A step that lands away from the session's copy prefills what that replica's cache lacks of its history.
    assert sp["prompt_tokens"] == so["prompt_tokens"] and sp["prefilled_tokens"] > so["prefilled_tokens"]


def test_unknown_router() -> None:
    with pytest.raises(ValueError, match="unknown router"):
        make_router("random")



def test_baseline_routers_in_the_fleet() -> None:
    (st, sst), (pr, spr), (p2, sp2) = run(2, "sticky"), run(2, "prefix"), run(2, "p2c")
    assert sst["num_completed"] == spr["num_completed"] == 16
    assert st.extra["moves"] == 0  # a session's every step on its hashed replica
    assert pr.extra["moves"] < p2.extra["moves"]  # the history's prefix pulls a session back to its copy
    assert spr["cached_fraction"] > sp2["cached_fraction"]
