"""Prometheus metrics of one server: latency histograms, queue and KV gauges, token counters.

Each server owns its registry (tests run several in one process). Request
figures are recorded by the server as requests finish; engine gauges are
sampled in the engine thread after steps.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model"]
        self.model = model_name
        self.ttft = Histogram("sessionserve_time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("sessionserve_time_per_output_token_seconds", "Time per output token after the first",
                              labels, buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0), registry=r)
        self.e2e = Histogram("sessionserve_e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("sessionserve_requests", "Finished requests", labels + ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("sessionserve_prompt_tokens", "Prompt tokens received", labels, registry=r)
        self.cached_tokens = Counter("sessionserve_cached_prompt_tokens", "Prompt tokens not recomputed", labels,
                                     registry=r)
        self.generation_tokens = Counter("sessionserve_generation_tokens", "Tokens generated", labels, registry=r)
        self.errors = Counter("sessionserve_request_errors", "Requests answered with an error", ["status"],
                              registry=r)
        # Engine gauges carry the model's name: a server may run several engines.
        self.queue_depth = Gauge("sessionserve_num_requests_waiting", "Requests waiting to run", labels, registry=r)
        self.running = Gauge("sessionserve_num_requests_running", "Requests running", labels, registry=r)
        self.preemptions = Gauge("sessionserve_num_preemptions", "Requests whose computed KV was freed, to be "
                                 "recomputed, since start (cause: memory, or priority for a waiting interactive turn)",
                                 labels + ["cause"], registry=r)
        self.sessions = Gauge("sessionserve_sessions", "Open sessions by state/residency", labels + ["residency"],
                              registry=r)
        self.kv_blocks = Gauge("sessionserve_kv_blocks", "KV blocks in use by tier", labels + ["tier"], registry=r)
        self.shared_kv_bytes = Gauge("sessionserve_shared_kv_bytes", "Device KV bytes in blocks that more than one "
                                     "sequence reads (prefix hits, forks)", labels, registry=r)
        self.prefix_hit_rate = Gauge("sessionserve_prefix_cache_hit_rate", "Prefix cache hit rate (tokens)",
                                     labels, registry=r)
        self.recompute_tokens = Gauge("sessionserve_session_recompute_tokens", "Tokens recomputed after drops",
                                      labels, registry=r)
        self.implicit = Gauge("sessionserve_implicit_sessions",
                              "Requests without a session id: requests, hits (continued a live session), forks, "
                              "opened, evicted, open", labels + ["what"], registry=r)
        self.kv_store = Gauge("sessionserve_kv_store_blocks", "KV store folder (shared by replicas): blocks "
                              "written, loaded (not recomputed), dropped (not written), gone (trimmed by others)", labels + ["what"], registry=r)
        self.host_prefix = Gauge("sessionserve_host_prefix_cache_blocks", "Host prefix cache: blocks held, kept "
                                 "(device evictions copied), loaded back, dropped for the budget",
                                 labels + ["what"], registry=r)
        self.prefetch = Gauge("sessionserve_session_restores", "Session KV restores by outcome",
                              labels + ["outcome"], registry=r)
        self.spec_tokens = Gauge("sessionserve_spec_decode_tokens",
                                 "Speculative decoding: tokens proposed, accepted; verification steps",
                                 labels + ["what"], registry=r)
        self.step_seconds = Histogram("sessionserve_engine_step_seconds", "Engine step time", labels,
                                      buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
                                      registry=r)
        self.role_busy = Gauge("sessionserve_cpu_role_busy_fraction", "Share of a CPU role's thread time spent "
                               "working over the last 10 s (tokenize, engine, tools)", ["role"], registry=r)
        self.role_seconds = Gauge("sessionserve_cpu_role_seconds", "Seconds a CPU role's threads spent working "
                                  "(wall) and their CPU time, since start", ["role", "kind"], registry=r)
        self.role_threads = Gauge("sessionserve_cpu_role_threads", "Threads of a CPU role", ["role"], registry=r)
        self.continuations = Counter(
            "sessionserve_session_continuations", "Chat turns by how their prompt continued a session: exact (the "
            "conversation the session holds matched; only the new messages were tokenized and sent, the model's own "
            "reply tokens kept), prefix (re-rendered and cut to the longest common prefix), new, none (no session)",
            labels + ["how"], registry=r)
        self.aborted = Gauge("sessionserve_aborted_requests", "Requests aborted (client gone, closed), by whether "
                             "they had started computing", labels + ["stage"], registry=r)
        self.aborted_prefill = Gauge("sessionserve_aborted_prefill_tokens", "Prompt tokens computed for requests "
                                     "that were then aborted (not served from the cache)", labels, registry=r)
        self.spool_orphans = Gauge("sessionserve_spool_orphans_removed", "Spool files a process that died left "
                                   "behind, removed at start (files, bytes)", labels + ["unit"], registry=r)
        self.failed_steps = Gauge("sessionserve_failed_steps", "Engine steps that raised; each request then ran "
                                  "alone and only the ones that raised failed", labels, registry=r)
        self.admission = Gauge("sessionserve_admission", "Session admission by working set: turns waiting at the "
                               "door now, sessions admitted, turns that waited or were refused (429) since start, "
                               "sessions that lost their place when the door started to hold, turns run on loan "
                               "while the engine idled, whether the door enforces its budget now (1: yes)",
                               labels + ["what"], registry=r)
        self.route_steps = Counter("sessionserve_route_steps", "Chat steps of model 'auto' by the model that ran "
                                   "them and why", ["routed_to", "reason"], registry=r)
        self.route_escalations = Counter("sessionserve_route_escalations",
                                         "Execution steps run again on the large model after the small one's "
                                         "answer failed validation", ["reason"], registry=r)

    def record_request(self, *, ttft_s: float | None, e2e_s: float, num_prompt: int, num_cached: int,
                       num_output: int, finish_reason: str, model: str | None = None) -> None:
        m = model or self.model
        if ttft_s is not None:
            self.ttft.labels(m).observe(ttft_s)
            if num_output > 1:
                self.tpot.labels(m).observe(max(0.0, e2e_s - ttft_s) / (num_output - 1))
        self.e2e.labels(m).observe(e2e_s)
        self.requests.labels(m, finish_reason).inc()
        self.prompt_tokens.labels(m).inc(num_prompt)
        self.cached_tokens.labels(m).inc(num_cached)
        self.generation_tokens.labels(m).inc(num_output)

    def observe_step(self, step_s: float, model: str | None = None) -> None:
        """A step's time; called in the engine thread after each step."""
        self.step_seconds.labels(model or self.model).observe(step_s)

    def sample_gauges(self, eng, model: str | None = None) -> None:  # noqa: ANN001 - LLMEngine
        """Queue, KV and session gauges from the engine's state; in the engine thread, on a timer while steps
        run and while it is idle, and as steps stop (see AsyncEngine's `on_gauges`)."""
        m = model or self.model
        sched = eng.core.scheduler
        self.queue_depth.labels(m).set(len(sched.waiting))
        self.running.labels(m).set(len(sched.running))
        self.preemptions.labels(m, "memory").set(sched.num_preemptions - sched.num_priority_preemptions)
        self.preemptions.labels(m, "priority").set(sched.num_priority_preemptions)
        usage = eng.kv_usage()
        self.kv_blocks.labels(m, "device").set(usage["device_blocks_used"])
        self.shared_kv_bytes.labels(m).set(usage.get("device_blocks_shared", 0) * usage["block_bytes"])
        self.kv_blocks.labels(m, "host").set(usage.get("host_blocks_used", 0))
        self.kv_blocks.labels(m, "disk").set(usage.get("disk_bytes_used", 0) // max(1, usage["block_bytes"]))
        for key in ("running", "device", "host", "disk", "offloading", "restoring", "none"):
            self.sessions.labels(m, key).set(usage.get(f"sessions_{key}", 0))
        q, hit, _ = eng.kv.pool.stats()
        self.prefix_hit_rate.labels(m).set(hit / q if q else 0.0)
        core = eng.core
        self.spec_tokens.labels(m, "proposed").set(core.num_spec_proposed)
        self.spec_tokens.labels(m, "accepted").set(core.num_spec_accepted)
        self.spec_tokens.labels(m, "steps").set(core.num_spec_steps)
        self.aborted.labels(m, "before_start").set(core.num_aborted_before_start)
        self.aborted.labels(m, "running").set(core.num_aborted - core.num_aborted_before_start)
        self.aborted_prefill.labels(m).set(core.num_aborted_prefill_tokens)
        self.failed_steps.labels(m).set(core.num_failed_steps)
        disk = eng.mover.disk if eng.mover is not None else None
        if disk is not None:
            self.spool_orphans.labels(m, "files").set(disk.num_removed_orphan_files)
            self.spool_orphans.labels(m, "bytes").set(disk.num_removed_orphan_bytes)
        door = core.door
        if door is not None:
            self.admission.labels(m, "waiting").set(len(door.held))
            self.admission.labels(m, "admitted").set(len(door.admitted))
            self.admission.labels(m, "waited_total").set(door.num_held_total)
            self.admission.labels(m, "rejected_total").set(door.num_rejected)
            self.admission.labels(m, "demoted_total").set(door.num_demoted)
            self.admission.labels(m, "lent_total").set(door.num_lent)
            self.admission.labels(m, "enforcing").set(int(door.enforcing))
        total = eng.sessions.total_stats()
        self.recompute_tokens.labels(m).set(total.num_recompute_tokens)
        self.prefetch.labels(m, "hit").set(total.num_prefetch_hits)
        self.prefetch.labels(m, "late").set(total.num_prefetch_late)
        self.prefetch.labels(m, "miss").set(total.num_restore_misses)
        host = getattr(eng, "host_prefix_cache", None)
        if host is not None:
            self.host_prefix.labels(m, "held").set(len(host))
            for what in ("kept", "loaded", "dropped"):
                self.host_prefix.labels(m, what).set(getattr(host.stats, f"num_blocks_{what}"))
        store = getattr(eng, "kv_store", None)
        if store is not None:
            st = store.stats
            for what in ("written", "loaded", "dropped", "gone"):
                self.kv_store.labels(m, what).set(getattr(st, f"num_blocks_{what}"))

    def sample_implicit(self, implicit, model: str | None = None) -> None:  # noqa: ANN001 - ImplicitSessions
        m = model or self.model
        for what in ("requests", "hits", "forks", "opened", "evicted"):
            self.implicit.labels(m, what).set(getattr(implicit, f"num_{what}"))
        self.implicit.labels(m, "open").set(implicit.num_open)

    def sample_roles(self, roles) -> None:  # noqa: ANN001 - obs.cpu_roles.CpuRoles
        for role, snap in roles.snapshot().items():
            self.role_busy.labels(role).set(snap["busy_fraction"])
            self.role_seconds.labels(role, "busy").set(snap["busy_s"])
            self.role_seconds.labels(role, "cpu").set(snap["cpu_s"])
            self.role_threads.labels(role).set(snap["threads"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
