"""Builders for scheduler and engine tests: no model, no clock."""

from __future__ import annotations

from itertools import count
from typing import Any

from sessionserve.cache.kv_manager import KVCacheManager
from sessionserve.config import SchedulerConfig
from sessionserve.core.scheduler import Scheduler
from sessionserve.types.executor import ExecutorOutput
from sessionserve.types.sampling_params import SamplingParams
from sessionserve.types.scheduler_output import SchedulerOutput
from sessionserve.types.sequence import Program, Sequence

_ids = count()


def create_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                     max_num_batched_tokens: int = 64, chunked: bool = True, prefix: bool = True,
                     **policy: Any) -> Scheduler:
    """`policy`: SchedulerConfig's scheduling fields (scheduling_policy, aging_s, ...)."""
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     enable_chunked_prefill=chunked, **policy), kv)


def create_seq(num_prompt_tokens: int, max_tokens: int = 4, tokens: list[int] | None = None,
               rid: str | None = None, priority: int = 0, arrival_s: float = 0.0,
               program: Program | None = None) -> Sequence:
    ids = tokens if tokens is not None else [next(_ids) % 1000 + 10 for _ in range(num_prompt_tokens)]
    seq = Sequence(request_id=rid or f"r{next(_ids)}", token_ids=list(ids), num_prompt_tokens=len(ids),
                   sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                   arrival_s=arrival_s, priority=priority)
    if program is not None:
        seq.program = program
        seq.service_at_arrival = program.service_tokens
    return seq


class FakeExecutor:
    """Samples token 7 for every sampling chunk; records the plans it saw."""

    def __init__(self) -> None:
        self.plans: list[SchedulerOutput] = []

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput:
        self.plans.append(plan)
        return ExecutorOutput({c.seq.request_id: 7 for c in plan.chunks if c.samples}, {})


def run_step(sched: Scheduler, executor: FakeExecutor | None = None,
             now_s: float | None = None) -> tuple[SchedulerOutput, list[Sequence]]:
    plan = sched.schedule(now_s)
    result = (executor or FakeExecutor()).execute(plan)
    return plan, sched.update(plan, result.sampled)
