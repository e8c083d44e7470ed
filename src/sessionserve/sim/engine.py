"""`SimEngine`: the engine assembled as `LLMEngine` assembles it (`core.assembly`), with simulated mechanisms.

Same scheduler, admission door, session manager, residency policy, KV cache
manager and prefix index; the model runner is replaced by
`CostModelExecutor`, the mover thread by `VirtualMover`, the host prefix
cache by `SimHostPrefixCache`, `time.monotonic` by a `VirtualClock`. Token
level only: no tokenizer. Not modelled: the KV store shared by replicas
(`--kv-store-dir`) and speculative decoding.
"""

from __future__ import annotations

from sessionserve.config import Config
from sessionserve.core.assembly import COST_UPDATE_STEPS, Mechanisms, assemble
from sessionserve.core.engine import StepOutput
from sessionserve.core.residency import MoveCosts
from sessionserve.core.session import Session
from sessionserve.sim.clock import VirtualClock
from sessionserve.sim.executor import CostModelExecutor
from sessionserve.sim.mover import VirtualMover
from sessionserve.sim.prefix_cache import SimHostPrefixCache
from sessionserve.sim.profile import CostProfile
from sessionserve.types.kv_mover import Tier, int8_block_bytes
from sessionserve.types.sampling_params import SamplingParams


class SimEngine:
    """The engine on a virtual clock. `config.model` is ignored: the profile describes the model."""

    def __init__(self, config: Config, profile: CostProfile, clock: VirtualClock | None = None) -> None:
        self.config = config
        self.profile = profile
        self.clock = clock or VirtualClock()
        cc = config.cache
        self.block_bytes = profile.model.kv_bytes_per_token * cc.block_size
        # A token that is no end of sequence: turns run to max_tokens.
        self.executor = CostModelExecutor(profile.step, self.clock, token_id=profile.model.vocab_size // 2)
        parts = assemble(config, Mechanisms(
            executor=self.executor, clock=self.clock,
            num_blocks=cc.num_blocks or max(1, cc.kv_cache_bytes // self.block_bytes),
            max_model_len=min(config.scheduler.max_model_len or profile.model.max_model_len,
                              profile.model.max_model_len),
            mover=self._make_mover,
            host_prefix_cache=lambda pool, budget: SimHostPrefixCache(
                pool, self.clock, budget // self.block_bytes, self.block_bytes / profile.host_copy_bytes_per_s),
            costs=self._costs(None), indexed_policy=True))
        self.kv, self.sessions, self.core = parts.kv, parts.sessions, parts.core
        self.mover: VirtualMover | None = parts.mover  # type: ignore[assignment]
        self.host_prefix_cache = parts.host_prefix_cache
        self._next_id = 0

    def _make_mover(self) -> VirtualMover:
        sc, m, p = self.config.session, self.profile.model, self.profile
        host_block_bytes = (int8_block_bytes(self.block_bytes, m.kv_dtype_bytes, m.head_dim) if sc.host_kv_int8
                            else self.block_bytes)
        return VirtualMover(self.clock, self.block_bytes, sc.host_kv_bytes // host_block_bytes,
                            sc.disk_kv_bytes // self.block_bytes, p.host_copy_bytes_per_s,
                            p.disk_copy_bytes_per_s, p.move_latency_s)

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def _costs(self, recompute_s_per_token: float | None) -> MoveCosts:
        p = self.profile
        per_token = recompute_s_per_token or (p.step.per_token_s + p.step.overhead_s / 256)
        return MoveCosts(self.block_bytes / p.host_copy_bytes_per_s, self.block_bytes / p.disk_copy_bytes_per_s,
                         per_token)

    # -- the LLMEngine surface the driver uses ------------------------------------------------------

    def new_request_id(self) -> str:
        self._next_id += 1
        return f"req-{self._next_id}"

    def add_request(self, token_ids: list[int], params: SamplingParams, session_id: str | None = None) -> str:
        rid = self.new_request_id()
        self.core.add_request(rid, token_ids, params, session_id=session_id)
        return rid

    def open_session(self, session_id: str | None = None, priority: str = "interactive") -> str:
        self._next_id += 1
        sid = session_id or f"sess-{self._next_id}"
        self.core.open_session(sid, priority=priority)
        return sid

    def park(self, session_id: str, tools: tuple[str, ...] = (), expected_wait_s: float | None = None) -> None:
        self.sessions.set_wait(session_id, tuple(tools), expected_wait_s)

    def get_session(self, session_id: str) -> Session | None:
        return self.sessions.get(session_id)

    def close_session(self, session_id: str) -> bool:
        return self.core.close_session(session_id)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[StepOutput]:
        """One engine step; the clock advances by the step's predicted time (and by waits on moves)."""
        if self.core.num_steps % COST_UPDATE_STEPS == 0:
            self.sessions.costs = self._costs(self.core.prefill_s_per_token)
        return self.core.step()

    def kv_usage(self) -> dict[str, int]:
        """Same keys as `LLMEngine.kv_usage`."""
        usage = {"device_blocks_total": self.kv.pool.num_blocks, "device_blocks_used": self.kv.pool.num_used_blocks,
                 "device_blocks_cached": self.kv.pool.num_cached_blocks, "block_bytes": self.block_bytes}
        if self.mover is not None:
            usage["host_blocks_total"] = self.mover.capacity[Tier.HOST]
            usage["host_blocks_used"] = self.mover.used[Tier.HOST]
            usage["disk_bytes_used"] = self.mover.used[Tier.DISK] * self.block_bytes
        for residency, n in self.sessions.residency_counts().items():
            usage[f"sessions_{residency}"] = n
        return usage
