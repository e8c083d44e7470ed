"""What the Ray Serve benchmarks (router.py, failover.py) share: trace and replica flags, the trace, the cluster.

Not a benchmark itself. The cluster is local (2 CPUs' worth) and its workers
import sessionserve from this checkout's src/, so a benchmark run from a clean
worktree measures that worktree's code, not an installed copy.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def add_serve_args(p: argparse.ArgumentParser, *, max_context: int, token_scale: float, max_wait_s: float,
                   device_kv_bytes: int) -> None:
    """The flags both benchmarks take (trace, model, per-replica engine), with each one's defaults."""
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--trace", default="weka_claude_code")
    p.add_argument("--num-sessions", type=int, default=16)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--max-context", type=int, default=max_context)
    p.add_argument("--token-scale", type=float, default=token_scale)
    p.add_argument("--time-scale", type=float, default=10.0)
    p.add_argument("--max-wait-s", type=float, default=max_wait_s)
    p.add_argument("--model-size", default="small", choices=("tiny", "small"))
    p.add_argument("--device-kv-bytes", type=int, default=device_kv_bytes)
    p.add_argument("--host-kv-bytes", type=int, default=512 * MiB)
    p.add_argument("--disk-kv-bytes", type=int, default=0, help="disk tier behind the host tier (0: none)")
    p.add_argument("--host-prefix-cache-bytes", type=int, default=0,
                   help="host memory for blocks the device prefix cache evicts (0: none)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)


def load_bench_trace(args: argparse.Namespace) -> Any:
    """The trace the flags describe: sessions of exactly `--max-steps` steps."""
    from sessionserve.workload.loader import load_trace

    return load_trace(args.trace, token_scale=args.token_scale, time_scale=args.time_scale,
                      max_sessions=args.num_sessions, max_steps=args.max_steps, min_steps=args.max_steps,
                      max_context_tokens=args.max_context, max_wait_s=args.max_wait_s, seed=args.seed)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Each replica's engine options."""
    return {"kv_cache_bytes": args.device_kv_bytes, "host_kv_bytes": args.host_kv_bytes,
            "disk_kv_bytes": args.disk_kv_bytes, "num_threads": args.threads, "max_num_seqs": 32,
            "max_num_batched_tokens": 1024,
            "host_prefix_cache_bytes": args.host_prefix_cache_bytes}


def start_cluster(threads: int) -> int:
    """Start a local Ray cluster and Serve's HTTP proxy on a free loopback port; return the port."""
    import ray
    from ray import serve

    from tests.server.conftest import free_port

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 * MiB,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT / "src")}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port
