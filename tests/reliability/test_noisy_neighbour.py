"""One tenant cannot hurt another: Alice's streams run on unharmed while Bob sends the adversarial corpus.

The driver is bench/noisy_neighbour.py's (`run_noisy_neighbour`): Alice
streams greedy chat completions alone (the quiet run), then while Bob (in a
process of his own) sends every case of tests/reliability/adversarial.py and
a few hundred fuzzed requests, then alone again. Each corpus case is a test of
its own here (its contract: no 5xx, error JSON, bounded time and /health
latency for heavy ones, ...). Alice's streams must all complete with the quiet
run's text; her p99 inter-token gap is bounded against the quiet run's just
before, loosely (a shared 2-core machine is noisy: the bench prints the real
ratio against the issue's 2x), and no gap may be a stall. Afterwards the
server is idle, every KV block is free and /health is fast.

A dedicated server with a queue of 4 checks that streams past the queue limit
get a 429 with Retry-After before the stream starts, never a 200 carrying an
SSE error.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessionserve.config import ServerConfig
from tests.reliability import adversarial
from tests.reliability.conftest import (
    assert_all_free,
    bench_module,
    close_all_sessions,
    is_idle,
    live_server,
    wait_idle,
)
from tests.server.conftest import LiveServer

NUM_FUZZ = 300
# Alice's p99 gap while Bob sends the corpus: at most this many times her quiet p99, or the floor (whichever
# is larger: her quiet p99 is 10-25 ms here, and two shared cores add tens of ms once a second process runs).
# The goal is 2x, shown by the bench run of the whole corpus (bench/RESULTS.md: 1.63-1.65x over 3 runs); this
# subset has no schema cases (a short window where floods and hang-ups weigh more) and runs on shared CI
# machines: this bound catches stalls, not that.
GAP_P99_RATIO_BOUND = 10.0
GAP_P99_FLOOR_S = 0.25
# No gap in Alice's streams may be this long: quiet runs' longest are 10-60 ms, a loaded machine's up to ~1 s
# (a compiler process starting beside the engine); the stalls this harness was built for were 7-27 s.
STALL_BOUND_S = 2.0
HEALTH_AFTER_BOUND_S = 0.5
QUEUE_LIMIT = 4


nn = bench_module("noisy_neighbour")


def _target(server: LiveServer, **fields: Any) -> adversarial.Target:
    # A request gets 20 s, past every bound of the corpus: a stuck one fails its case, and the run stays bounded.
    return adversarial.Target(server.url, vocab_size=server.engine.runner.arch.vocab_size,
                              max_model_len=server.engine.max_model_len,
                              max_request_bytes=ServerConfig().max_request_bytes, timeout_s=20.0, **fields)


@pytest.fixture(scope="module")
def noisy(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The whole run, once: the report and the server's state after it."""
    spool = tmp_path_factory.mktemp("noisy") / "spool"
    with live_server(tiny_llama, spool, num_blocks=512, host_kv_bytes=0, disk_kv_bytes=0) as server:
        report = nn.run_noisy_neighbour(server.url, _target(server), case_names=CI_CASES, num_fuzz=NUM_FUZZ,
                                        num_bob_workers=2)
        print("\n" + report.summary())
        idle_deadline = time.monotonic() + 30
        while not is_idle(server) and time.monotonic() < idle_deadline:
            time.sleep(0.05)
        after = {"is_idle": is_idle(server)}
        t0 = time.perf_counter()
        after["health_status"] = httpx.get(server.url + "/health", timeout=30).status_code
        after["health_s"] = time.perf_counter() - t0
        close_all_sessions(server)
        try:
            assert_all_free(server, spool)
            after["leak"] = None
        except AssertionError as exc:
            after["leak"] = str(exc)
    return {"report": report, "after": after}


# The pathological JSON schemas stop grammar compiler processes, which start again beside the engine (seconds
# of CPU on two shared cores): the whole corpus, schemas included, is the slow test below and the bench;
# tests/reliability/test_request_isolation.py checks the compile limit itself in CI.
CI_CASES = [n for n in adversarial.case_names() if not n.startswith("JSON schema:")]


@pytest.mark.parametrize("name", CI_CASES)
def test_corpus_case_holds(noisy: dict[str, Any], name: str) -> None:
    outcome = next(c for c in noisy["report"].cases if c["name"] == name)
    assert not outcome["problems"], "\n".join([*outcome["problems"], f"notes: {outcome['notes']}",
                                               f"slowest: {outcome['slowest']}"])


def test_bystander_streams_complete_with_the_quiet_text(noisy: dict[str, Any]) -> None:
    report = noisy["report"]
    assert report.quiet_is_repeatable, "greedy streams alone gave different texts: the reference is unusable"
    assert report.corpus.num_streams >= 10 and report.fuzz.num_streams >= 1, report.summary()
    assert not report.alice_failures, "\n".join(report.alice_failures[:20])


def test_bystander_gaps_stay_near_the_quiet_run(noisy: dict[str, Any]) -> None:
    report = noisy["report"]
    quiet, corpus, fuzz = report.quiet_before, report.corpus, report.fuzz
    bound_s = max(GAP_P99_RATIO_BOUND * quiet.p99_s, GAP_P99_FLOOR_S)
    assert corpus.p99_s <= bound_s, (f"p99 gap {corpus.p99_s * 1000:.1f} ms under the corpus vs "
                                     f"{quiet.p99_s * 1000:.1f} ms quiet (bound {bound_s * 1000:.1f} ms)")
    for phase in (corpus, fuzz):
        assert (phase.max_s or 0) < STALL_BOUND_S, f"a {phase.max_s:.2f} s stall in Alice's streams\n{report.summary()}"


def test_fuzzed_requests_never_get_a_5xx(noisy: dict[str, Any]) -> None:
    report = noisy["report"]
    assert report.fuzz_sent == NUM_FUZZ, report.fuzz_statuses
    assert report.fuzz_5xx == 0, "\n".join(report.fuzz_failures)
    transport = {k: v for k, v in report.fuzz_statuses.items() if k.startswith("transport")}
    assert not transport, "\n".join(report.fuzz_failures)


def test_server_is_idle_leak_free_and_healthy_after(noisy: dict[str, Any]) -> None:
    after = noisy["after"]
    assert after["is_idle"], "requests still running or KV moves pending 30 s after the run"
    assert after["leak"] is None, after["leak"]
    assert after["health_status"] == 200 and after["health_s"] < HEALTH_AFTER_BOUND_S, after


@pytest.mark.slow
def test_the_whole_corpus_with_the_schemas_holds(tiny_llama: Path, tmp_path: Path) -> None:
    with live_server(tiny_llama, tmp_path / "spool", num_blocks=512, host_kv_bytes=0, disk_kv_bytes=0) as server:
        report = nn.run_noisy_neighbour(server.url, _target(server), num_fuzz=NUM_FUZZ, num_bob_workers=2)
    print("\n" + report.summary())
    assert not [c for c in report.cases if c["problems"]], report.summary()
    assert not report.alice_failures and report.fuzz_5xx == 0, report.summary()


def test_streams_over_the_queue_limit_get_429_with_retry_after(tiny_llama: Path, tmp_path: Path) -> None:
    floods = [name for name in adversarial.case_names() if name.startswith("stream flood")]
    with live_server(tiny_llama, tmp_path / "spool", num_blocks=256, max_num_seqs=2, host_kv_bytes=0,
                     disk_kv_bytes=0, app_options={"max_queued_requests": QUEUE_LIMIT}) as server:
        target = _target(server, num_flood_streams=4 * QUEUE_LIMIT, flood_max_tokens=64)
        outcomes = adversarial.run_cases(target, floods, num_workers=1)
        for o in outcomes:
            assert o.is_ok, (o.name, o.problems)
            assert o.notes["num_429"] >= 1 and 200 in o.statuses, (o.name, o.statuses)
        wait_idle(server)
        close_all_sessions(server)
        assert_all_free(server)


def test_the_gap_check_sees_a_stall(tiny_llama: Path, tmp_path: Path) -> None:
    """The harness itself: an engine thread held for longer than STALL_BOUND_S shows as a gap in Alice's streams."""
    with live_server(tiny_llama, tmp_path / "spool", host_kv_bytes=0, disk_kv_bytes=0) as server:
        alice = nn.Bystander(server.url, num_streams=2)
        alice.run_rounds("warm-up", 1)
        alice.start("stalled")
        time.sleep(0.5)
        stall_s = STALL_BOUND_S + 1.0
        server.call(lambda e: time.sleep(stall_s))
        time.sleep(0.5)
        stats = nn.GapStats.of(alice.stop())
        assert stats.max_s >= stall_s - 0.1, stats
        wait_idle(server)
