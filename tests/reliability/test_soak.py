"""A short soak: agent-like sessions for ~40 s over loopback, then everything accounted for and at rest.

The driver is bench/soak.py's (`run_soak`): several agents run multi-turn
conversations with tool waits, explicit and implicit sessions, streamed,
blocking and abandoned turns. Every turn must be completed or abandoned by
the client (a 409 while an abandoned turn's abort lands is retried, as a
client would); any error status or transport error fails. Afterwards no
request runs, every KV block is free, latency and memory growth are bounded.

Parked sessions stay on the device or are dropped here (no host or disk tier):
moves under history rewrites hit a known engine fault, covered by its own
test in test_rewrite_then_abort.py.
"""

from __future__ import annotations

import gc
import os
import threading
import tracemalloc
import urllib.parse
from pathlib import Path

import httpx

from tests.reliability.conftest import assert_all_free, bench_module, live_server, wait_idle

DURATION_S = 40.0
NUM_AGENTS = 6
P99_BOUND_S = 5.0
RSS_GROWTH_BOUND_BYTES = 512 << 20
HEAP_GROWTH_BOUND_BYTES = 4 << 20


def test_soak_accounts_for_every_turn_and_leaves_nothing_behind(tiny_llama: Path, tmp_path: Path) -> None:
    soak = bench_module("soak")
    with live_server(tiny_llama, tmp_path / "spool", num_blocks=160, residency_policy="predictive",
                     host_kv_bytes=0, disk_kv_bytes=0) as server:
        soak.run_soak(server.url, 3.0, NUM_AGENTS, seed=1, api_key="key-alice")  # warm-up: allocator pools, prefix cache
        wait_idle(server)
        # Bounded caches are not leaks: the wait predictor's memo (keyed by the clients' free-float hints), and
        # urllib's cache of split URLs (the soak's client runs in this process; every session has its URL).
        server.call(lambda e: e.sessions.predictor.clear_memo())
        urllib.parse.clear_cache()
        gc.collect()
        tracemalloc.start()
        heap_before, objects_before = tracemalloc.get_traced_memory()[0], len(gc.get_objects())
        rss = [soak.rss_bytes(os.getpid())]
        done = threading.Event()
        sampler = threading.Thread(target=lambda: [rss.append(soak.rss_bytes(os.getpid()))
                                                   for _ in iter(lambda: done.wait(2.0), True)])
        sampler.start()
        try:
            stats, elapsed_s = soak.run_soak(server.url, DURATION_S, NUM_AGENTS, seed=0, api_key="key-alice")
        finally:
            done.set()
            sampler.join()
        result = soak.summarize(stats, elapsed_s)

        assert elapsed_s < DURATION_S + 30, result
        assert result.outcomes.get("completed", 0) >= 100 and result.outcomes.get("abandoned", 0) >= 5, result
        # Every turn is completed, abandoned, or an error; the only errors allowed are none at all.
        assert result.errors_by_status == {}, result
        assert result.num_conversations == result.num_conversations_completed, result
        assert result.latency_p99_s < P99_BOUND_S, result

        wait_idle(server, timeout_s=15)
        text = httpx.get(server.url + "/metrics").text
        assert not [ln for ln in text.splitlines() if ln.startswith('sessionserve_request_errors_total{status="5')]
        server.call(lambda e: [e.close_session(s.session_id) for s in list(e.sessions)])
        assert_all_free(server)
        server.call(lambda e: e.sessions.predictor.clear_memo())
        urllib.parse.clear_cache()
        gc.collect()
        heap_growth, object_growth = tracemalloc.get_traced_memory()[0] - heap_before, len(gc.get_objects()) - objects_before
        tracemalloc.stop()
        # Memory: bounded in total (the allocator and caches settle over the first minute or so: RSS
        # growth alone cannot tell a leak from settling in a 40 s run); and what Python holds after every
        # session is closed does not grow with the turns served: a request, turn or session object kept
        # per turn would add more than one object per two turns (and its token lists to the heap).
        turns = sum(result.outcomes.values())
        assert rss[-1] - rss[0] < RSS_GROWTH_BOUND_BYTES, [r >> 20 for r in rss]
        assert object_growth < turns / 2, (object_growth, turns)
        assert heap_growth < HEAP_GROWTH_BOUND_BYTES, (heap_growth, turns)
