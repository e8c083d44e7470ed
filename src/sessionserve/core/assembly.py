"""The engine, assembled once from a `Config`.

`LLMEngine` (the model on a device) and the simulator's `SimEngine` (a cost
model on a virtual clock) build the same objects here: the KV cache manager,
the tiers below its prefix cache, the session manager with the configured
residency policy and the engine core with its scheduler and admission door.
They differ only in the mechanisms they pass in (`Mechanisms`), so the
feature set and the sizing of every tier cannot drift between them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from sessionserve.cache.block_pool import BlockPool
from sessionserve.cache.kv_manager import KVCacheManager
from sessionserve.config import Config
from sessionserve.core.engine import EngineCore
from sessionserve.core.residency import MoveCosts, make_policy
from sessionserve.core.session_manager import SessionManager
from sessionserve.core.spec import Proposer, SpecPolicy
from sessionserve.types.executor import Executor
from sessionserve.types.kv_mover import KVMover

logger = logging.getLogger(__name__)

# How often (engine steps) an engine gives the residency policy fresh move and recompute costs.
COST_UPDATE_STEPS = 32


class LowerTier(Protocol):
    """A tier below the device prefix cache: loads the blocks it holds that follow the device's head."""

    def load(self, block_hashes: list[bytes]) -> int: ...


class HostPrefixTier(LowerTier, Protocol):
    """Keeps what the device prefix cache evicts (the pool's `on_evict`), and loads it back."""

    def keep(self, evicted: list[tuple[int, bytes]]) -> None: ...


@dataclass
class Mechanisms:
    """What the real engine and the simulator build differently; everything else is `assemble`'s.

    The factories are called only when the config asks for what they build (a host or disk tier, a host
    prefix cache, a shared KV store), with the device block pool where they need it.
    """

    executor: Executor
    clock: Callable[[], float]
    num_blocks: int  # device KV blocks
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    mover: Callable[[], KVMover] | None = None  # host and disk tiers for parked sessions
    host_prefix_cache: Callable[[BlockPool, int], HostPrefixTier] | None = None  # (pool, bytes)
    shared_store: Callable[[BlockPool], LowerTier] | None = None  # the KV store shared by replicas
    costs: MoveCosts | None = None  # the residency policy's first costs (None: its defaults)
    proposer: Proposer | None = None
    spec_policy: SpecPolicy | None = None
    indexed_policy: bool = False  # the residency policy's index on (`make_policy`): the simulator's choice


@dataclass
class Assembled:
    kv: KVCacheManager
    sessions: SessionManager
    core: EngineCore
    mover: KVMover | None
    host_prefix_cache: HostPrefixTier | None
    shared_store: LowerTier | None


def assemble(config: Config, m: Mechanisms) -> Assembled:
    cc, sc = config.cache, config.session
    kv = KVCacheManager(m.num_blocks, cc.block_size, cc.enable_prefix_caching)
    host_prefix = store = None
    if cc.enable_prefix_caching and cc.host_prefix_cache_bytes and m.host_prefix_cache is not None:
        host_prefix = m.host_prefix_cache(kv.pool, cc.host_prefix_cache_bytes)
        kv.pool.on_evict = host_prefix.keep
    if cc.enable_prefix_caching and sc.kv_store_dir is not None and m.shared_store is not None:
        store = m.shared_store(kv.pool)
    tiers = [t for t in (host_prefix, store) if t is not None]
    if tiers:
        kv.lower = lambda block_hashes: load_lower(tiers, block_hashes)
    mover = m.mover() if (sc.host_kv_bytes or sc.disk_kv_bytes) and m.mover is not None else None
    sessions = SessionManager(kv, mover, make_policy(sc.residency_policy, indexed=m.indexed_policy),
                              idle_ttl_s=sc.session_idle_ttl_s, max_sessions=sc.max_sessions, costs=m.costs)
    core = EngineCore(config.scheduler, kv, m.executor, m.clock, m.eos_token_ids, m.max_model_len,
                      sessions=sessions, proposer=m.proposer, spec_policy=m.spec_policy)
    return Assembled(kv, sessions, core, mover, host_prefix, store)


def load_lower(tiers: Sequence[LowerTier], block_hashes: list[bytes]) -> int:
    """The KV manager's lower tier: each tier in turn (host memory first, then the shared store). Never
    raises: what could not be loaded is computed."""
    num = 0
    for tier in tiers:
        try:
            num += tier.load(block_hashes)
        except Exception:  # noqa: BLE001 - a failed load costs a recompute, never the request
            logger.exception("loading KV blocks from %s failed", type(tier).__name__)
    return num
