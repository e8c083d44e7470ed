"""The Ray Serve application: an ingress in front of N engine replicas routed by `SessionKVRouter`.

    sessionserve serve --replicas 2 --store sqlite:///tmp/sessions.db     # one machine
    serve run sessionserve.router.ray_app:app_builder replicas=2 store=redis://host:6379/0   # a Ray cluster

`build_app(options)` returns the bound application for `serve.run`;
`app_builder(args)` is the same for `serve run` / a Serve config file
(`import_path: sessionserve.router.ray_app:app_builder`, `args: {replicas: 2}`).
`router="pow2"` deploys the same thing behind Ray Serve's default router;
`"sticky"` (consistent hashing on the session id), `"prefix"` (longest
cached prefix) and `"prefix-load"` (cached prefix weighed against load)
behind the baselines of `router.policy`: what our router is measured against.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ENGINE_DEPLOYMENT = "Engine"
ROUTERS = ("session_kv", "pow2", "sticky", "prefix", "prefix-load")


@dataclass(frozen=True)
class ServeOptions:
    num_replicas: int = 2
    model: str | None = None  # model folder; None: the embedded default
    model_name: str | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # Config.from_kwargs(...) of each replica
    api_keys: tuple[tuple[str, str], ...] = ()  # (key, tenant); empty: open
    store_url: str | None = None  # None: an SQLite file in the temp dir (shared by the replicas of this machine)
    # "session_kv" (ours), "pow2" (Ray Serve's default), or a baseline of router.policy: "sticky" (consistent
    # hashing on the session id), "prefix" (longest cached prefix), "prefix-load" (prefix weighed against load)
    router: str = "session_kv"
    router_kwargs: dict[str, Any] = field(default_factory=dict)  # PolicyConfig fields
    max_ongoing_requests: int = 64  # per replica; past it Serve queues at the router
    routing_stats_period_s: float = 0.5  # how often replicas report free KV blocks and parked sessions
    max_attempts: int = 4  # per request, across replicas that die under it
    engine_deployment: str = ENGINE_DEPLOYMENT
    replica_num_cpus: float = 1.0  # Ray CPU reservation per engine replica (0 lets tests pack them)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError("num_replicas must be >= 1")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}")


def default_store_url() -> str:
    return f"sqlite://{Path(tempfile.gettempdir()) / 'sessionserve-sessions.db'}"


def build_app(options: ServeOptions) -> Any:
    """The Serve application (bind it with `serve.run(build_app(...), route_prefix=...)`)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from sessionserve.router.ingress import Ingress
    from sessionserve.router.ray_router import SessionKVRouter
    from sessionserve.router.replica import EngineReplica

    if options.store_url is None:
        options = replace(options, store_url=default_store_url())
    timing = {"request_routing_stats_period_s": options.routing_stats_period_s,
                  "request_routing_stats_timeout_s": max(1.0, 4 * options.routing_stats_period_s)}
    if options.router != "pow2":
        router_config = RequestRouterConfig(request_router_class=SessionKVRouter,
                                            request_router_kwargs={"mode": options.router, **options.router_kwargs},
                                            **timing)
    else:
        router_config = RequestRouterConfig(**timing)  # Serve's default: power of two choices
    # NOTE: the replica count belongs to the deployment, not to a replica's init args: a Serve config that
    # changes only `num_replicas` of Engine scales in place (drained replicas release their sessions).
    bound = replace(options, num_replicas=1)
    engine = serve.deployment(
        EngineReplica, name=options.engine_deployment, num_replicas=options.num_replicas,
        max_ongoing_requests=options.max_ongoing_requests, request_router_config=router_config,
        ray_actor_options={"num_cpus": options.replica_num_cpus},
        graceful_shutdown_timeout_s=30, health_check_period_s=2, health_check_timeout_s=10,
    ).bind(bound)
    ingress = serve.deployment(serve.ingress()(Ingress), name="Ingress", num_replicas=1,
                               max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine, bound)


def app_builder(args: dict[str, Any]) -> Any:
    """For `serve run sessionserve.router.ray_app:app_builder replicas=2 store=... model=... router=pow2`."""
    return build_app(ServeOptions(
        num_replicas=int(args.get("replicas", 2)), model=args.get("model"), model_name=args.get("model_name"),
        store_url=args.get("store"), router=args.get("router", "session_kv"),
        engine_kwargs={k[len("engine_"):]: _parse(v) for k, v in args.items() if k.startswith("engine_")}))


def _parse(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)


def run_forever(options: ServeOptions, host: str, port: int) -> None:
    """`sessionserve serve --replicas N`: start (or join, with RAY_ADDRESS) Ray, run the app, block until a signal."""
    import signal
    import threading

    import ray
    from ray import serve

    ray.init(ignore_reinit_error=True, include_dashboard=False)  # joins $RAY_ADDRESS when it is set
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(options), name="sessionserve", route_prefix="/")
    print(f"sessionserve: {options.num_replicas} replicas ({options.router} router) on http://{host}:{port}",
          flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):  # a timed wait, so the signal handler gets to run
        pass
    serve.shutdown()
    ray.shutdown()


def serve_from_args(args: Any) -> None:
    """`sessionserve serve --replicas N [--store URL]`: the serve flags, applied to each replica."""
    import json

    keys = {k: "default" for k in args.api_key or []}
    if args.keys_file:
        keys.update(json.loads(Path(args.keys_file).read_text()))
    engine_kwargs = {"kv_cache_bytes": args.kv_cache_bytes, "max_num_seqs": args.max_num_seqs,
                         "max_num_batched_tokens": args.max_num_batched_tokens, "num_threads": args.threads,
                         "dtype": args.dtype, "device": args.device, "residency_policy": args.residency_policy,
                         "host_kv_bytes": args.host_kv_bytes, "host_kv_int8": args.host_kv_int8, "disk_kv_bytes": args.disk_kv_bytes, "spool_dir": args.spool_dir,
                         "kv_store_dir": args.kv_store_dir, "kv_store_bytes": args.kv_store_bytes,
                         "host_prefix_cache_bytes": args.host_prefix_cache_bytes, "admission": args.admission,
                         "admission_fill": args.admission_fill}
    options = ServeOptions(num_replicas=args.replicas, model=args.model, model_name=(args.served_model_name or [None])[0],
                           engine_kwargs=engine_kwargs, api_keys=tuple(sorted(keys.items())), store_url=args.store)
    run_forever(options, args.host, args.port)
