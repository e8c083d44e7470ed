"""Router counters, and where the ingress finds the router Serve built in its process."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RouterStats:
    """Counters of one router (one per ingress process and deployment)."""

    decisions: Counter = field(default_factory=Counter)  # RouteReason value -> requests routed for that reason
    num_session_requests: int = 0  # requests that named a session
    num_affinity_hits: int = 0  # ... that went to the replica already holding the session
    num_prefix_hits: int = 0  # requests sent where >= 1 leading block was believed cached
    num_matched_blocks: int = 0  # sum of those believed-cached blocks
    num_failovers: int = 0  # sessions whose replica died, continued elsewhere
    num_migrations: int = 0  # sessions moved off a live or drained replica (rebalance, scale-down)
    dead_replicas: list[str] = field(default_factory=list)

    @property
    def affinity_hit_rate(self) -> float | None:
        return self.num_affinity_hits / self.num_session_requests if self.num_session_requests else None

    def to_dict(self) -> dict[str, Any]:
        return {"decisions": dict(self.decisions), "num_session_requests": self.num_session_requests,
                "num_affinity_hits": self.num_affinity_hits, "affinity_hit_rate": self.affinity_hit_rate,
                "num_prefix_hits": self.num_prefix_hits, "num_matched_blocks": self.num_matched_blocks,
                "num_failovers": self.num_failovers, "num_migrations": self.num_migrations,
                "dead_replicas": list(self.dead_replicas)}


# NOTE: Serve builds the router inside the handle, out of our reach; the ingress in the same process
# finds it here by deployment name. Written once per router, read by the ingress routes.
_ROUTERS: dict[str, Any] = {}
_ROUTERS_LOCK = threading.Lock()


def register_router(deployment_name: str, router: Any) -> None:
    with _ROUTERS_LOCK:
        _ROUTERS[deployment_name] = router


def router_for(deployment_name: str) -> Any | None:
    """The `SessionKVRouter` of this process for a deployment, or None (not created yet, or another router)."""
    with _ROUTERS_LOCK:
        return _ROUTERS.get(deployment_name)
